// node_stream_test.js: AttentionClient.attendStream (client/node).
// Against the real attention-server at SERVER_ADDRESS: answers come in order
// and equal attend's, a refused request gets its error in place and the
// stream goes on, a long stream from an async generator, the deadline,
// leaving early. Against a scripted service in this process (the real server
// cannot fail a stream on demand): a stream is never retried while Attend
// still is, odd error codes, answer counts that do not match the requests.
// Run by tests/client/node_test.sh:
//
//   node tests/client/node_stream_test.js SERVER_ADDRESS
'use strict';

const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { test } = require('node:test');

const SOURCE_DIR = path.join(__dirname, '..', '..');
const NODE_DIR = path.join(SOURCE_DIR, 'client', 'node');
const grpc = require(path.join(NODE_DIR, 'node_modules', '@grpc', 'grpc-js'));
const protoLoader = require(path.join(NODE_DIR, 'node_modules', '@grpc', 'proto-loader'));
const { AttentionClient, AttendError } = require(path.join(NODE_DIR, 'attention_client.js'));

const SERVER_ADDRESS = process.argv[2];
// Concurrent requests may be batched; a batched answer may differ this much.
const BATCH_TOLERANCE = 1e-5;

function caseRequest(name) {
  const file = path.join(SOURCE_DIR, 'tests', 'conformance', 'cases', `${name}.json`);
  return JSON.parse(fs.readFileSync(file, 'utf8')).request;
}

async function collect(iterable) {
  const items = [];
  for await (const item of iterable) items.push(item);
  return items;
}

// The items of one stream, and the error that ended it (or null).
async function collectWithError(iterable) {
  const items = [];
  try {
    for await (const item of iterable) items.push(item);
  } catch (error) {
    return { items, error };
  }
  return { items, error: null };
}

function assertSameTensor(actual, expected, what) {
  assert.ok(actual && expected, `${what}: missing tensor`);
  assert.deepEqual(actual.shape.map(Number), expected.shape.map(Number), `${what}: shape`);
  assert.equal(actual.data.length, expected.data.length, `${what}: data length`);
  let maxDiff = 0;
  for (let i = 0; i < actual.data.length; i += 1) {
    maxDiff = Math.max(maxDiff, Math.abs(actual.data[i] - expected.data[i]));
  }
  assert.ok(maxDiff <= BATCH_TOLERANCE, `${what}: max abs difference ${maxDiff}`);
}

function assertSameAnswer(streamed, unary, what) {
  assert.ok(!(streamed instanceof Error), `${what}: ${streamed.message}`);
  assert.equal(streamed.request_id, unary.request_id, `${what}: request_id`);
  assertSameTensor(streamed.output, unary.output, `${what} output`);
  assertSameTensor(streamed.attention_weights, unary.attention_weights, `${what} weights`);
}

// (1, n, d) filled from `seed`.
function tensor(n, d, seed) {
  return { shape: [1, n, d], data: Array.from({ length: n * d }, (_, i) => Math.sin(0.37 * i + seed)) };
}

test('real server', async (t) => {
  const client = new AttentionClient(SERVER_ADDRESS, { timeoutMs: 60000 });
  t.after(() => client.close());

  await t.test('answers in order, equal to attend, errors in place', async () => {
    const names = ['dot_product_d2l_toy', 'additive_d2l_toy', 'multi_head_d2l_causal_bf16',
      'distance_scale_valid_lens_2d', 'bilinear_valid_lens_1d'];
    const requests = names.map((name, i) => ({
      ...caseRequest(name), return_attention_weights: true, request_id: `r${i}`,
    }));
    requests.splice(1, 0, {
      model: 'no_such_model', queries: tensor(2, 3, 0), request_id: 'bad1',
    });
    // Keys of 5 features for queries of 4: dot_product needs d_q == d_k.
    requests.splice(4, 0, {
      model: 'dot_product', queries: tensor(2, 4, 0), keys: tensor(3, 5, 1), request_id: 'bad2',
    });

    const items = await collect(client.attendStream(requests));

    assert.equal(items.length, requests.length);
    for (const [index, code] of [[1, grpc.status.NOT_FOUND], [4, grpc.status.INVALID_ARGUMENT]]) {
      assert.ok(items[index] instanceof AttendError, `item ${index} is not an AttendError`);
      assert.equal(items[index].code, code, items[index].message);
      assert.equal(items[index].request_id, requests[index].request_id);
    }
    assert.match(items[1].details, /no_such_model/);
    assert.match(items[4].details, /keys/);
    for (const index of [0, 2, 3, 5, 6]) {
      assertSameAnswer(items[index], await client.attend(requests[index]), requests[index].request_id);
    }
  });

  await t.test('a long stream from an async generator', async () => {
    // More answers (about 6 MB) than the server keeps unwritten: requests
    // must go out while answers are read.
    const distinct = [0, 1, 2].map((seed) => ({
      model: 'dot_product', queries: tensor(32, 32, seed), keys: tensor(256, 32, seed + 10),
      valid_lens: [200], return_attention_weights: true,
    }));
    const count = 150;
    async function* requests() {
      for (let i = 0; i < count; i += 1) yield { ...distinct[i % 3], request_id: `r${i}` };
    }
    const items = await collect(client.attendStream(requests()));
    assert.equal(items.length, count);
    const unary = await Promise.all(distinct.map((request) => client.attend(request)));
    items.forEach((item, i) => {
      assertSameAnswer(item, { ...unary[i % 3], request_id: `r${i}` }, `request ${i}`);
    });
  });

  await t.test('what the requests throw ends the stream after the others', async () => {
    function* requests() {
      yield { model: 'dot_product', queries: tensor(2, 3, 0), request_id: 'a' };
      yield { model: 'dot_product', queries: tensor(1, 3, 1), request_id: 'b' };
      throw new RangeError('no more requests');
    }
    const { items, error } = await collectWithError(client.attendStream(requests()));
    assert.ok(error instanceof RangeError, String(error));
    assert.deepEqual(items.map((item) => item.request_id), ['a', 'b']);
    for (const item of items) assert.ok(!(item instanceof Error), item.message);
  });

  await t.test('an endless iterable is read as answers come, and leaving early ends it', async () => {
    let pulled = 0;
    function* endless() {
      for (;;) {
        pulled += 1;
        yield { model: 'dot_product', queries: tensor(2, 3, 0) };
      }
    }
    let answers = 0;
    for await (const item of client.attendStream(endless())) {
      assert.deepEqual(item.output.shape.map(Number), [1, 2, 3]);
      answers += 1;
      if (answers === 10) break;
    }
    // At most 64 requests unanswered (attention_client.js's STREAM_WINDOW).
    assert.ok(pulled <= answers + 64 + 1, `${pulled} requests read for ${answers} answers`);
    const pulledAtBreak = pulled;
    await new Promise((resolve) => setTimeout(resolve, 50));
    assert.equal(pulled, pulledAtBreak, 'requests still read after the loop was left');
    const items = await collect(client.attendStream([{ model: 'dot_product', queries: tensor(1, 2, 0) }]));
    assert.equal(items.length, 1);
    assert.ok(!(items[0] instanceof Error), items[0].message);
  });

  await t.test('an abort signal cancels the stream after the answers so far', async () => {
    const controller = new AbortController();
    function* endless() {
      for (;;) yield { model: 'dot_product', queries: tensor(1, 2, 0) };
    }
    let answers = 0;
    let error = null;
    try {
      for await (const item of client.attendStream(endless(), { signal: controller.signal })) {
        assert.ok(!(item instanceof Error), item.message);
        answers += 1;
        if (answers === 5) controller.abort();
      }
    } catch (caught) {
      error = caught;
    }
    assert.ok(error, 'the aborted stream ended without an error');
    assert.equal(error.code, grpc.status.CANCELLED, error.message);
    assert.ok(answers >= 5, `${answers} answers`);
    const { error: early } = await collectWithError(client.attendStream(
      [{ model: 'dot_product', queries: tensor(1, 2, 0) }], { signal: AbortSignal.abort() }));
    assert.equal(early?.code, grpc.status.CANCELLED);
  });

  await t.test('a passed deadline fails the call', async () => {
    const { error } = await collectWithError(
      client.attendStream([{ model: 'dot_product', queries: tensor(1, 2, 0) }], { timeoutMs: 0 }));
    assert.ok(error, 'no error');
    assert.equal(error.code, grpc.status.DEADLINE_EXCEEDED, error.message);
  });
});

// AttentionService on 127.0.0.1 that follows the n-th script for its n-th
// AttendStream call (the last one repeats), and answers Attend with
// UNAVAILABLE first, then as a stream does. Scripts: 'fail' (UNAVAILABLE
// before reading), 'answer_one_then_fail', 'answer_all', 'answer_none',
// 'answer_twice'. A request whose model is 'error:<code>' is answered with an
// AttendError of that code, any other with its queries as the output.
class ScriptedService {
  constructor(...scripts) {
    this.scripts = scripts;
    this.streamCalls = 0;
    this.attendCalls = 0;
    this.server = new grpc.Server();
    const definition = protoLoader.loadSync('attention/v1/attention.proto', {
      includeDirs: [path.join(SOURCE_DIR, 'proto')], keepCase: true, longs: Number, defaults: false,
    });
    const { AttentionService } = grpc.loadPackageDefinition(definition).attention.v1;
    this.server.addService(AttentionService.service, {
      Attend: (call, callback) => this.attend(call, callback),
      AttendStream: (call) => this.attendStream(call),
      ListModels: (call, callback) => callback(null, { models: [] }),
    });
  }

  start() {
    return new Promise((resolve, reject) => {
      this.server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (error, port) => {
        if (error) reject(error);
        else resolve(`127.0.0.1:${port}`);
      });
    });
  }

  static answer(request) {
    const model = request.model || '';
    if (model.startsWith('error:')) {
      return {
        request_id: request.request_id,
        error: { code: Number(model.slice('error:'.length)), message: 'scripted error' },
      };
    }
    return { request_id: request.request_id, output: request.queries };
  }

  attend(call, callback) {
    this.attendCalls += 1;
    if (this.attendCalls === 1) {
      callback({ code: grpc.status.UNAVAILABLE, details: 'scripted failure' });
    } else {
      callback(null, ScriptedService.answer(call.request));
    }
  }

  attendStream(call) {
    const script = this.scripts[Math.min(this.streamCalls, this.scripts.length - 1)];
    this.streamCalls += 1;
    const fail = () => call.emit('error', { code: grpc.status.UNAVAILABLE, details: 'scripted failure' });
    if (script === 'fail') {
      fail();
      return;
    }
    let failed = false;
    call.on('data', (request) => {
      if (failed || script === 'answer_none') return;
      call.write(ScriptedService.answer(request));
      if (script === 'answer_twice') call.write(ScriptedService.answer(request));
      if (script === 'answer_one_then_fail') {
        failed = true;
        fail();
      }
    });
    call.on('end', () => {
      if (!failed) call.end();
    });
  }
}

function idRequests(...models) {
  return models.map((model, i) => ({ model, queries: tensor(1, 1, i), request_id: `r${i}` }));
}

test('scripted service', async (t) => {
  // One stream to a service following `scripts`: its items, the error that
  // ended it, and the service.
  async function stream(scripts, models = ['m', 'm', 'm']) {
    const service = new ScriptedService(...scripts);
    const address = await service.start();
    const client = new AttentionClient(address, { timeoutMs: 30000 });
    try {
      return { ...(await collectWithError(client.attendStream(idRequests(...models)))), service };
    } finally {
      client.close();
      service.server.forceShutdown();
    }
  }

  await t.test('UNAVAILABLE before any answer is not retried', async () => {
    const { items, error, service } = await stream(['fail', 'answer_all']);
    assert.ok(error, 'no error');
    assert.equal(error.code, grpc.status.UNAVAILABLE, error.message);
    assert.equal(items.length, 0);
    assert.equal(service.streamCalls, 1);
  });

  await t.test('UNAVAILABLE after an answer is not retried', async () => {
    const { items, error, service } = await stream(['answer_one_then_fail', 'answer_all']);
    assert.ok(error, 'no error');
    assert.equal(error.code, grpc.status.UNAVAILABLE, error.message);
    assert.equal(items.length, 1);
    assert.equal(service.streamCalls, 1);
  });

  await t.test('Attend on the same client is still retried', async () => {
    // The stream's exemption must not switch retries off for Attend.
    const service = new ScriptedService('answer_all');
    const client = new AttentionClient(await service.start(), { timeoutMs: 30000 });
    try {
      const response = await client.attend({ model: 'm', queries: tensor(1, 1, 0) });
      assert.deepEqual(response.output.shape.map(Number), [1, 1, 1]);
      assert.equal(service.attendCalls, 2);
    } finally {
      client.close();
      service.server.forceShutdown();
    }
  });

  await t.test('answer error codes become AttendErrors', async () => {
    const { items, error } = await stream(['answer_all'],
      ['error:5', 'm', 'error:0', 'error:99', 'error:16']);
    assert.equal(error, null);
    assert.equal(items.length, 5);
    assert.ok(items[0] instanceof AttendError);
    assert.equal(items[0].code, grpc.status.NOT_FOUND);
    assert.equal(items[0].details, 'scripted error');
    assert.equal(items[0].request_id, 'r0');
    assert.ok(!(items[1] instanceof Error));
    assert.equal(items[1].request_id, 'r1');
    // Not an error code: still an error, naming what came.
    for (const [index, code] of [[2, 0], [3, 99]]) {
      assert.equal(items[index].code, grpc.status.UNKNOWN);
      assert.match(items[index].details, new RegExp(`code ${code}\\b`));
    }
    assert.equal(items[4].code, grpc.status.UNAUTHENTICATED);
  });

  await t.test('an answer count other than the request count is INTERNAL', async () => {
    let { items, error } = await stream(['answer_none']);
    assert.ok(error instanceof AttendError, String(error));
    assert.equal(error.code, grpc.status.INTERNAL);
    assert.match(error.details, /answered 0 of 3/);
    assert.equal(items.length, 0);
    ({ error } = await stream(['answer_twice']));
    assert.ok(error instanceof AttendError, String(error));
    assert.equal(error.code, grpc.status.INTERNAL);
    assert.match(error.details, /sent answer \d+ with only \d+ requests sent/);
  });
});
