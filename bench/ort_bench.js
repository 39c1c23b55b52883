// ort_bench.js: times ONNX graphs on onnxruntime-node's CPU execution provider.
//
// Run by bench/compare_ort.py, which exports the graphs and writes the
// manifest: node bench/ort_bench.js MANIFEST (NODE_PATH: the node_modules
// folder holding onnxruntime-node). Per case: a session with
// `threads` intra-op threads, one inter-op thread and every graph
// optimisation; the first answer checked against the expected output (over
// `tolerance`: exit 1); then the best of `repetitions` runs of at least
// `min_time` seconds, as bench/compare_torch.py times PyTorch. Prints
//   NAME  ms  GFLOPS  GFLOPS_per_core
// with CPU time from process.cpuUsage() (every thread of the process).
'use strict';

const fs = require('fs');
const ort = require('onnxruntime-node');

const ARRAYS = {float32: Float32Array, int32: Int32Array, bool: Uint8Array};

function readTensor({file, type, dims}) {
  const bytes = fs.readFileSync(file);
  const Type = ARRAYS[type];
  const data = new Type(bytes.buffer, bytes.byteOffset, bytes.length / Type.BYTES_PER_ELEMENT);
  return new ort.Tensor(type, Type.from(data), dims);
}

function readFloats(file) {
  const bytes = fs.readFileSync(file);
  return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.length / 4);
}

function cpuSeconds() {
  const {user, system} = process.cpuUsage();
  return (user + system) * 1e-6;
}

async function time(run, minTime, repetitions) {
  await run();  // warm-up
  let bestWall = Infinity;
  let bestCpu = Infinity;
  for (let r = 0; r < repetitions; r++) {
    let iterations = 0;
    let elapsed = 0;
    const start = process.hrtime.bigint();
    const cpuStart = cpuSeconds();
    while (elapsed < minTime || iterations < 3) {
      await run();
      iterations++;
      elapsed = Number(process.hrtime.bigint() - start) * 1e-9;
    }
    bestWall = Math.min(bestWall, elapsed / iterations);
    bestCpu = Math.min(bestCpu, (cpuSeconds() - cpuStart) / iterations);
  }
  return [bestWall, bestCpu];
}

async function main() {
  const manifest = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
  const options = {
    executionProviders: ['cpu'],
    graphOptimizationLevel: 'all',
    intraOpNumThreads: manifest.threads,
    interOpNumThreads: 1,
    executionMode: 'sequential',
  };
  console.log(`onnxruntime-node ${require('onnxruntime-node/package.json').version}, ` +
              `${manifest.threads} intra-op threads`);
  let failed = false;
  for (const c of manifest.cases) {
    const session = await ort.InferenceSession.create(c.model, options);
    const feeds = {};
    for (const [name, spec] of Object.entries(c.inputs)) feeds[name] = readTensor(spec);
    const expected = readFloats(c.expected);
    const got = (await session.run(feeds))[session.outputNames[0]].data;
    let diff = 0;
    for (let i = 0; i < expected.length; i++) diff = Math.max(diff, Math.abs(got[i] - expected[i]));
    if (!(diff <= manifest.tolerance) || got.length !== expected.length) {
      console.error(`${c.name}: answer differs from PyTorch's by ${diff}`);
      failed = true;
    }
    const [wall, cpu] = await time(() => session.run(feeds), manifest.min_time,
                                   manifest.repetitions);
    console.log(`${c.name.padEnd(52)} ${(wall * 1e3).toFixed(3).padStart(9)} ` +
                `${(c.flops / wall * 1e-9).toFixed(2).padStart(8)} ` +
                `${(c.flops / cpu * 1e-9).toFixed(2).padStart(16)}  max_abs_diff ${diff.toExponential(1)}`);
    await session.release();
  }
  process.exit(failed ? 1 : 0);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
