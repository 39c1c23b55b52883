// example.js: lists the server's models, then calls Attend and prints the
// response as one line of JSON.
//
//   node example.js [--target HOST:PORT] [request.json]
//
// request.json holds an AttendRequest in proto JSON (as the conformance cases'
// "request" objects); without one, the d2l toy example is sent: dot-product
// attention over 10 key-value pairs with valid lengths (2, 6).
'use strict';

const fs = require('fs');
const { AttentionClient } = require('./attention_client');

function parseArgs(argv) {
  const args = { target: process.env.ATTENTION_TARGET || '127.0.0.1:50051', request: null };
  for (let i = 0; i < argv.length; i += 1) {
    if (argv[i] === '--target' && i + 1 < argv.length) {
      args.target = argv[i + 1];
      i += 1;
    } else if (argv[i].startsWith('--')) {
      throw new Error(`unknown flag ${argv[i]}; usage: node example.js [--target HOST:PORT] [request.json]`);
    } else {
      args.request = argv[i];
    }
  }
  return args;
}

// Queries (2, 1, 2), keys (2, 10, 2), values (2, 10, 4): the toy shapes of d2l.ai.
function toyRequest() {
  const range = (n, f) => Array.from({ length: n }, (_, i) => f(i));
  return {
    model: 'dot_product',
    queries: { shape: [2, 1, 2], data: Float32Array.of(0.5, -1.0, 1.5, 0.25) },
    keys: { shape: [2, 10, 2], data: Float32Array.from(range(40, (i) => Math.sin(i))) },
    values: { shape: [2, 10, 4], data: Float32Array.from(range(80, (i) => i / 10)) },
    valid_lens: [2, 6],
    return_attention_weights: true,
  };
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const request = args.request ? JSON.parse(fs.readFileSync(args.request, 'utf8')) : toyRequest();
  const client = new AttentionClient(args.target);
  try {
    const models = await client.listModels();
    console.log(`models: ${models.map((m) => `${m.name} (${m.kind})`).join(', ')}`);
    const response = await client.attend(request);
    // Float32Array data as JSON arrays, as proto JSON writes `data`.
    console.log(JSON.stringify(response, (key, value) => (
      value instanceof Float32Array ? Array.from(value) : value)));
  } finally {
    client.close();
  }
}

main().catch((error) => {
  console.error(`error: ${error.message}`);
  process.exit(1);
});
