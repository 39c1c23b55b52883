// client_bench.js: the Node client's time per call for bench/client_bench.py
// (the `node` path): self-attention on dot_product, queries of the given
// shape as a Float32Array, one call at a time; prints {"seconds": median
// wall time per call, "cpu": the process's CPU time per call}.
// Needs client/node's dependencies (cd client/node && npm ci). CLIENT, when
// given, is another copy of attention_client.js to time (bench/client_bench.py's
// `node-grpcjs` and `node-old`).
//
//   node bench/client_bench.js TARGET B,n,d WARMUP CALLS [CLIENT]
'use strict';

const path = require('path');

async function main() {
  const [target, shapeText, warmup, calls,
    module = path.join(__dirname, '..', 'client', 'node', 'attention_client.js')] = process.argv.slice(2);
  const { AttentionClient } = require(path.resolve(module));
  const shape = shapeText.split(',').map(Number);
  const data = Float32Array.from({ length: shape[0] * shape[1] * shape[2] }, (_, i) => Math.sin(i));
  const client = new AttentionClient(target);
  const request = { model: 'dot_product', queries: { shape, data } };
  for (let i = 0; i < Number(warmup); i += 1) await client.attend(request);
  const times = [];
  const cpuStart = process.cpuUsage();
  for (let i = 0; i < Number(calls); i += 1) {
    const start = process.hrtime.bigint();
    await client.attend(request);
    times.push(Number(process.hrtime.bigint() - start) / 1e9);
  }
  const cpu = process.cpuUsage(cpuStart);
  client.close();
  times.sort((a, b) => a - b);
  console.log(JSON.stringify({
    seconds: times[Math.floor(times.length / 2)],
    cpu: (cpu.user + cpu.system) / 1e6 / Number(calls),
  }));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
