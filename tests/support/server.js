// server.js: what the Node client tests that use real servers share
// (node_unary_test.js, node_session_test.js): starting and stopping an
// attention-server, and the reproducible random inputs they send it.
'use strict';

const { spawn } = require('node:child_process');
const { once } = require('node:events');
const fs = require('node:fs');
const http = require('node:http');
const os = require('node:os');
const path = require('node:path');

// An attention-server (`binary`) on `address` (port 0: one the system picks)
// serving `repository`, with `flags`; resolves once it serves to { address,
// metricsAddress, stop(signal = 'SIGTERM') (resolves once it has exited),
// metric(name) (the sum of the samples of `name`) }. Its warm-up is off
// unless `flags` name a --warmup or --test-gate-warmup flag (the server
// refuses a flag given twice): these tests start a server for every case,
// and under ASan the warm-up is most of a start's 9 s (tests/README.md).
async function startServer(binary, repository, address, flags = []) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'node-test-server-'));
  const ports = path.join(dir, 'ports');
  const namesWarmup = flags.some((flag) => flag.startsWith('--warmup')
    || flag.startsWith('--test-gate-warmup'));
  const warmup = namesWarmup ? [] : ['--warmup', 'false'];
  const server = spawn(binary, ['--address', address, '--http-address', '127.0.0.1:0',
    '--metrics-address', '127.0.0.1:0', '--port-file', ports, '--threads', '1',
    '--model-repository', repository, ...warmup, ...flags], { stdio: 'ignore' });
  const exited = once(server, 'exit');
  const stop = async (signal = 'SIGTERM') => {
    if (server.exitCode === null && server.signalCode === null) server.kill(signal);
    await exited;
    fs.rmSync(dir, { recursive: true, force: true });
  };
  for (let tries = 0; !fs.existsSync(ports); tries += 1) {
    if (server.exitCode !== null || tries > 600) {
      await stop();
      throw new Error(`attention-server did not start on ${address}`);
    }
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  const lines = Object.fromEntries(fs.readFileSync(ports, 'utf8').trim().split('\n')
    .map((line) => line.split(' ')));
  const metric = async (name) => {
    const text = await new Promise((resolve, reject) => {
      http.get(`http://${lines.metrics}/metrics`, (reply) => {
        let body = '';
        reply.on('data', (chunk) => { body += chunk; });
        reply.on('end', () => resolve(body));
      }).on('error', reject);
    });
    return text.split('\n').filter((line) => line.split(/[ {]/)[0] === name)
      .reduce((total, line) => total + Number(line.split(' ').pop()), 0);
  };
  return { address: lines.grpc, metricsAddress: lines.metrics, stop, metric };
}

// Uniform values in [-1, 1) from `seed`.
function randomValues(count, seed) {
  const values = new Float32Array(count);
  let state = seed;
  for (let i = 0; i < count; i += 1) {
    state = (state * 1103515245 + 12345) % 2147483648;
    values[i] = state / 1073741824 - 1;
  }
  return values;
}

module.exports = { startServer, randomValues };
