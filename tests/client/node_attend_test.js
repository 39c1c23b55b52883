// node_attend_test.js: AttentionClient.attend with large tensors (client/node)
// against the real attention-server at SERVER_ADDRESS, where the client
// reuses a request buffer between calls and answers are views on the
// received bytes: every answer equals dot-product attention computed here,
// still does after later calls, calls in flight together each get their own
// answer, and the callers' arrays are left as they were.
// Run by tests/client/node_test.sh:
//
//   node tests/client/node_attend_test.js SERVER_ADDRESS
'use strict';

const assert = require('node:assert/strict');
const path = require('node:path');
const { test } = require('node:test');

const NODE_DIR = path.join(__dirname, '..', '..', 'client', 'node');
const { AttentionClient } = require(path.join(NODE_DIR, 'attention_client.js'));

const SERVER_ADDRESS = process.argv[2];
// 128 KiB of queries: above the size the client keeps a spare buffer for.
const SHAPE = [2, 256, 64];
// Float32 engine against float64 here; batched answers may differ a little more.
const TOLERANCE = 1e-4;

// Queries of SHAPE filled from `seed`.
function queries(seed) {
  const [b, n, d] = SHAPE;
  return Float32Array.from({ length: b * n * d }, (_, i) => Math.sin(0.37 * i + seed));
}

// softmax(q q^T / sqrt(d)) q for each batch, in float64.
function selfAttention(q) {
  const [b, n, d] = SHAPE;
  const out = new Float64Array(b * n * d);
  const scores = new Float64Array(n);
  for (let batch = 0; batch < b; batch += 1) {
    const base = batch * n * d;
    for (let i = 0; i < n; i += 1) {
      let top = -Infinity;
      for (let j = 0; j < n; j += 1) {
        let dot = 0;
        for (let k = 0; k < d; k += 1) dot += q[base + i * d + k] * q[base + j * d + k];
        scores[j] = dot / Math.sqrt(d);
        top = Math.max(top, scores[j]);
      }
      let sum = 0;
      for (let j = 0; j < n; j += 1) {
        scores[j] = Math.exp(scores[j] - top);
        sum += scores[j];
      }
      for (let j = 0; j < n; j += 1) {
        for (let k = 0; k < d; k += 1) out[base + i * d + k] += (scores[j] / sum) * q[base + j * d + k];
      }
    }
  }
  return out;
}

function assertClose(actual, expected, what) {
  assert.ok(actual instanceof Float32Array, `${what}: not a Float32Array`);
  assert.equal(actual.length, expected.length, `${what}: length`);
  let maxDiff = 0;
  for (let i = 0; i < actual.length; i += 1) maxDiff = Math.max(maxDiff, Math.abs(actual[i] - expected[i]));
  assert.ok(maxDiff <= TOLERANCE, `${what}: max abs difference ${maxDiff}`);
}

test('large calls against the real server', async (t) => {
  const client = new AttentionClient(SERVER_ADDRESS, { timeoutMs: 60000 });
  t.after(() => client.close());
  const inputs = [0, 1, 2, 3].map(queries);
  const copies = inputs.map((q) => Float32Array.from(q));
  const expected = inputs.map(selfAttention);
  const attend = (q) => client.attend({ model: 'dot_product', queries: { shape: SHAPE, data: q } });

  await t.test('answers stay as they were after later calls', async () => {
    const answers = [];
    for (const q of inputs.slice(0, 3)) answers.push(await attend(q));
    answers.forEach((answer, i) => {
      assert.deepEqual(answer.output.shape, SHAPE);
      assertClose(answer.output.data, expected[i], `answer ${i}`);
    });
  });

  await t.test('calls in flight together each get their own answer', async () => {
    const answers = await Promise.all(inputs.map(attend));
    answers.forEach((answer, i) => assertClose(answer.output.data, expected[i], `concurrent answer ${i}`));
  });

  await t.test('the callers\' arrays are left as they were', () => {
    inputs.forEach((q, i) => assert.deepEqual(q, copies[i], `queries ${i}`));
  });
});
