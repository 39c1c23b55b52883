// node_package_test.js: the attention-client package installed from its
// tarball, run inside the temporary project node_package_test.sh made. The
// package is the installed one, at the server's version, with its own
// proto; every conformance case through attend (Float32Array in) and
// through one attendStream (plain arrays in) matches the expected answer
// with Float32Array data out; every errors.json request gets its status code
// (attend) and its AttendError in place (attendStream).
//
//   node node_package_test.js SERVER_ADDRESS CONFORMANCE_DIR CMAKE_VERSION
'use strict';

const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { test } = require('node:test');
const { AttentionClient, AttendError } = require('attention-client');

const [address, conformance, cmakeVersion] = process.argv.slice(2);
const installed = path.dirname(require.resolve('attention-client'));
const readJson = (file) => JSON.parse(fs.readFileSync(file, 'utf8'));
const CASES = fs.readdirSync(path.join(conformance, 'cases')).sort()
  .map((name) => readJson(path.join(conformance, 'cases', name)));
const ERRORS = readJson(path.join(conformance, 'errors.json'));
// The gRPC status codes errors.json names.
const CODES = { INVALID_ARGUMENT: 3, NOT_FOUND: 5 };

// A JSON request with its tensors' data as Float32Arrays, or as they are.
function request(json, { float32 }) {
  const copy = { ...json };
  for (const name of ['queries', 'keys', 'values']) {
    if (copy[name] && float32) {
      // NaN and Infinity come as strings in errors.json.
      copy[name] = { shape: copy[name].shape, data: Float32Array.from(copy[name].data, Number) };
    }
  }
  return copy;
}

function assertCase(testCase, response) {
  assert.ok(!(response instanceof AttendError), `${testCase.name}: ${response.message}`);
  for (const key of ['output', 'attention_weights']) {
    const what = `${testCase.name}: ${key}`;
    const actual = response[key];
    const expected = testCase.expected[key];
    assert.ok(actual.data instanceof Float32Array, `${what}: data is not a Float32Array`);
    assert.deepEqual(actual.shape, expected.shape, `${what}: shape`);
    assert.equal(actual.data.length, expected.data.length, `${what}: length`);
    actual.data.forEach((value, i) => {
      const bound = testCase.atol + testCase.rtol * Math.abs(expected.data[i]);
      assert.ok(Math.abs(value - expected.data[i]) <= bound,
        `${what}[${i}] = ${value}, expected ${expected.data[i]}`);
    });
  }
}

test('the installed package, at the server version, with its own proto', () => {
  assert.ok(installed.startsWith(path.join(process.cwd(), 'node_modules')), installed);
  const manifest = readJson(path.join(installed, 'package.json'));
  assert.equal(manifest.version, cmakeVersion);
  assert.equal(manifest.license, 'Apache-2.0');
  assert.ok(fs.existsSync(path.join(installed, 'proto', 'attention', 'v1', 'attention.proto')));
});

test('every conformance case, unary and in one stream', async () => {
  assert.ok(CASES.length > 20);
  const client = new AttentionClient(address, { timeoutMs: 60000 });
  try {
    for (const testCase of CASES) {
      assertCase(testCase, await client.attend(request(testCase.request, { float32: true })));
    }
    const items = [];
    const requests = CASES.map((testCase) => request(testCase.request, { float32: false }));
    for await (const item of client.attendStream(requests)) items.push(item);
    assert.equal(items.length, CASES.length);
    CASES.forEach((testCase, i) => assertCase(testCase, items[i]));
  } finally {
    client.close();
  }
});

test('every errors.json request, unary and in a stream between good ones', async () => {
  const client = new AttentionClient(address, { timeoutMs: 60000 });
  const good = request(CASES[0].request, { float32: true });
  try {
    for (const entry of ERRORS) {
      await assert.rejects(client.attend(request(entry.request, { float32: true })),
        (error) => error.code === CODES[entry.expected_code], entry.name);
    }
    const requests = ERRORS.flatMap((entry) => [request(entry.request, { float32: true }), good]);
    const items = [];
    for await (const item of client.attendStream(requests)) items.push(item);
    assert.equal(items.length, requests.length);
    ERRORS.forEach((entry, i) => {
      const item = items[2 * i];
      assert.ok(item instanceof AttendError, `${entry.name}: not an AttendError`);
      assert.equal(item.code, CODES[entry.expected_code], entry.name);
      assert.equal(item.request_id, entry.request.request_id);
      assertCase(CASES[0], items[2 * i + 1]);
    });
  } finally {
    client.close();
  }
});
