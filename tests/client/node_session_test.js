// node_session_test.js: AttentionClient.session (client/node/session.js)
// against real attention-servers this test starts. Steps equal causal
// attend on the prefix (self memory) and attend with the memory (cross);
// a refused step leaves the session as it was. Sessions that lose their
// server halfway through a decode (kill -9, then a new server on the same
// port; SIGTERM, its grace run out, the other server of the target list
// left): every step still succeeds, outputs equal an uninterrupted decode's
// on another server within 1e-4, and `replays` is 1. With replay off the
// break is the stream's error; with rows past replayLimitBytes a SessionLost
// that says so. Run by tests/client/node_test.sh:
//
//   node tests/client/node_session_test.js SERVER_BINARY MODEL_REPOSITORY
'use strict';

const assert = require('node:assert/strict');
const path = require('node:path');
const { test } = require('node:test');

const NODE_DIR = path.join(__dirname, '..', '..', 'client', 'node');
const { AttentionClient, AttendError, SessionLost } = require(path.join(NODE_DIR, 'attention_client.js'));
const { startServer: startAttentionServer, randomValues } = require('../support/server.js');

const [SERVER_BIN, MODEL_REPOSITORY] = process.argv.slice(2);
const INVALID_ARGUMENT = 3;
const NOT_FOUND = 5;
const UNAVAILABLE = 14;
const MODEL = 'mh_torch_small'; // multi_head, E = 16: self memory
const STEPS = 8; // a 3-row prompt, then one token a step
const BREAK_AT = STEPS / 2;

function startServer(address = '127.0.0.1:0', flags = []) {
  return startAttentionServer(SERVER_BIN, MODEL_REPOSITORY, address, flags);
}

// The decode's steps: a prompt of 3 rows, then single tokens, `width` wide.
function decodeRows(batch, seed, width = 16) {
  return Array.from({ length: STEPS }, (_, i) => {
    const shape = [batch, i === 0 ? 3 : 1, width];
    return { shape, data: randomValues(shape[0] * shape[1] * width, seed * 100 + i) };
  });
}

// The outputs of every step; beforeBreak() runs before step BREAK_AT.
async function decode(session, steps, beforeBreak = null) {
  const outputs = [];
  for (let i = 0; i < steps.length; i += 1) {
    if (i === BREAK_AT && beforeBreak) await beforeBreak();
    outputs.push((await session.step(steps[i])).output);
  }
  return outputs;
}

function assertClose(actual, expected, what, tolerance = 1e-4) {
  assert.deepEqual(actual.shape.map(Number), expected.shape.map(Number), `${what}: shape`);
  let maxDiff = 0;
  for (let i = 0; i < expected.data.length; i += 1) {
    maxDiff = Math.max(maxDiff, Math.abs(actual.data[i] - expected.data[i]));
  }
  assert.ok(maxDiff <= tolerance, `${what}: max abs difference ${maxDiff}`);
}

function assertSameDecode(outputs, expected) {
  assert.equal(outputs.length, expected.length);
  outputs.forEach((output, i) => assertClose(output, expected[i], `step ${i}`));
}

async function rejection(promise) {
  try {
    await promise;
  } catch (error) {
    return error;
  }
  throw new Error('expected a rejection');
}

test('sessions', async (t) => {
  const reference = await startServer();
  const client = new AttentionClient(reference.address, { timeoutMs: 30000 });
  t.after(async () => {
    client.close();
    await reference.stop();
  });
  const uninterrupted = async (steps, options = {}, model = MODEL) => {
    const session = await client.session(model, options);
    try {
      return await decode(session, steps);
    } finally {
      session.close();
    }
  };
  // A server for one test, stopped after it (if the test has not).
  const serverFor = async (sub, address, flags) => {
    const server = await startServer(address, flags);
    sub.after(() => server.stop());
    return server;
  };
  // kill -9 `server`, then a new one on its port (restarted.server): the
  // same target.
  const restarted = {};
  const killAndRestart = (sub, server) => async () => {
    await server.stop('SIGKILL');
    restarted.server = await serverFor(sub, server.address);
  };

  await t.test('self steps equal causal attend on the prefix', async () => {
    const tokens = randomValues(6 * 16, 1);
    const session = await client.session(MODEL);
    try {
      assert.equal(session.length, 0);
      assert.equal(session.model_version, 1);
      let length = 0;
      for (const n of [3, 1, 2]) {
        const step = await session.step({ shape: [1, n, 16], data: tokens.subarray(length * 16, (length + n) * 16) });
        length += n;
        assert.equal(step.length, length);
        assert.equal(step.attention_weights, undefined);
        const whole = await client.attend({
          model: MODEL, causal: true, queries: { shape: [1, length, 16], data: tokens.subarray(0, length * 16) },
        });
        const rows = { shape: [1, n, 16], data: whole.output.data.subarray((length - n) * 16, length * 16) };
        assertClose(step.output, rows, `after ${length} rows`);
      }
    } finally {
      session.close();
    }
  });

  await t.test('cross steps equal attend with the memory', async () => {
    const keys = { shape: [1, 5, 5], data: randomValues(25, 2) };
    const values = { shape: [1, 5, 3], data: randomValues(15, 3) };
    const session = await client.session('additive_small', { memory: 'cross', keys, values, valid_lens: [4] });
    try {
      assert.equal(session.length, 5);
      const queries = { shape: [1, 2, 6], data: randomValues(12, 4) };
      const step = await session.step(queries, { return_attention_weights: true });
      const expected = await client.attend({
        model: 'additive_small', queries, keys, values, valid_lens: [4], return_attention_weights: true,
      });
      assertClose(step.output, expected.output, 'output');
      assertClose(step.attention_weights, expected.attention_weights, 'weights');
    } finally {
      session.close();
    }
  });

  await t.test('a refused step leaves the session as it was; a refused opening rejects', async () => {
    const session = await client.session(MODEL);
    try {
      await session.step({ shape: [1, 2, 16], data: randomValues(32, 5) });
      const wrong = await rejection(session.step({ shape: [1, 1, 5], data: randomValues(5, 6) }));
      assert.ok(wrong instanceof AttendError);
      assert.equal(wrong.code, INVALID_ARGUMENT);
      assert.equal(session.length, 2);
      assert.equal((await session.step({ shape: [1, 1, 16], data: randomValues(16, 7) })).length, 3);
    } finally {
      session.close();
    }
    const unknown = await rejection(client.session('no_such_model'));
    assert.ok(unknown instanceof AttendError);
    assert.equal(unknown.code, NOT_FOUND);
    await assert.rejects(client.session(MODEL, { memory: 'both' }), TypeError);
  });

  await t.test('kill -9 mid-decode: replayed once on the restarted server', async (sub) => {
    const steps = decodeRows(2, 11); // B = 2: the kept rows are joined per example
    const server = await serverFor(sub);
    const moving = new AttentionClient(server.address);
    try {
      const session = await moving.session(MODEL, { batch: 2 });
      const outputs = await decode(session, steps, killAndRestart(sub, server));
      assert.equal(session.replays, 1);
      assert.equal(session.length, 3 + STEPS - 1);
      assert.equal(await restarted.server.metric('attention_sessions_open'), 1);
      session.close();
      assertSameDecode(outputs, await uninterrupted(steps, { batch: 2 }));
    } finally {
      moving.close();
    }
  });

  await t.test('SIGTERM: the session moves to the other server of the target', async (sub) => {
    const steps = decodeRows(1, 12);
    const servers = [await serverFor(sub, '127.0.0.1:0', ['--shutdown-grace-seconds', '1']),
      await serverFor(sub, '127.0.0.1:0', ['--shutdown-grace-seconds', '1'])];
    const moving = new AttentionClient(servers.map((server) => server.address).join(','));
    try {
      const session = await moving.session(MODEL);
      const open = await Promise.all(servers.map((server) => server.metric('attention_sessions_open')));
      assert.deepEqual([...open].sort(), [0, 1]);
      const holder = servers[open.indexOf(1)];
      const other = servers[open.indexOf(0)];
      // The stopped server ends the session with UNAVAILABLE once its grace
      // runs out (docs/api.md section 11.5) and exits; then the step.
      const outputs = await decode(session, steps, () => holder.stop('SIGTERM'));
      assert.equal(session.replays, 1);
      session.close();
      assert.equal(await other.metric('attention_sessions_opened_total'), 1);
      assertSameDecode(outputs, await uninterrupted(steps));
    } finally {
      moving.close();
    }
  });

  await t.test('cross memory is replayed from its opening', async (sub) => {
    const memory = {
      memory: 'cross', keys: { shape: [1, 5, 5], data: randomValues(25, 13) },
      values: { shape: [1, 5, 3], data: randomValues(15, 14) }, valid_lens: [4],
    };
    const steps = decodeRows(1, 15, 6).map((rows) => ({ shape: [1, 1, 6], data: rows.data.subarray(0, 6) }));
    const server = await serverFor(sub);
    const moving = new AttentionClient(server.address);
    try {
      const session = await moving.session('additive_small', memory);
      const outputs = await decode(session, steps, killAndRestart(sub, server));
      assert.equal(session.replays, 1);
      assert.equal(session.length, 5);
      session.close();
      assertSameDecode(outputs, await uninterrupted(steps, memory, 'additive_small'));
    } finally {
      moving.close();
    }
  });

  await t.test('without replay the break is the stream\'s error', async (sub) => {
    const server = await serverFor(sub);
    const moving = new AttentionClient(server.address);
    try {
      const session = await moving.session(MODEL, { replay: false });
      const broke = await rejection(decode(session, decodeRows(1, 16), killAndRestart(sub, server)));
      assert.ok(!(broke instanceof SessionLost), broke.message);
      assert.equal(broke.code, UNAVAILABLE, broke.message);
      assert.equal(session.replays, 0);
      session.close();
    } finally {
      moving.close();
    }
  });

  await t.test('rows past replayLimitBytes make the break fail saying why', async (sub) => {
    // The prompt (192 bytes) fits; the opening and two more tokens do not.
    const limit = 300;
    const server = await serverFor(sub);
    const moving = new AttentionClient(server.address);
    try {
      const session = await moving.session(MODEL, { replayLimitBytes: limit });
      const lost = await rejection(decode(session, decodeRows(1, 17), killAndRestart(sub, server)));
      assert.ok(lost instanceof SessionLost, lost.message);
      assert.equal(lost.code, UNAVAILABLE);
      assert.match(lost.details, new RegExp(`replayLimitBytes=${limit}`));
      assert.equal(session.replays, 0);
      await assert.rejects(session.step(decodeRows(1, 17)[1]), /closed/);
      session.close();
    } finally {
      moving.close();
    }
  });
});
