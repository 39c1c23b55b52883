// node_unary_test.js: the Node client's unary calls over node:http2
// (client/node/unary.js). Against a scripted HTTP/2 server in this process
// (the real server cannot stall, fail or misbehave on demand): the headers
// sent, one session for sequential and concurrent calls, a new one after
// GOAWAY, deadlines,
// AbortSignal, statuses from trailers and from HTTP statuses, retries only
// before the server committed or of an answer cut off before its status, round-robin past a stopped server, close().
// Against real attention-servers this test starts itself: an error status
// with its message, a 16 MiB request and answer, the bearer token, and a
// server restart on the same port. Run by tests/client/node_test.sh:
//
//   node tests/client/node_unary_test.js SERVER_BINARY MODEL_REPOSITORY
'use strict';

const assert = require('node:assert/strict');
const { once } = require('node:events');
const fs = require('node:fs');
const http2 = require('node:http2');
const os = require('node:os');
const path = require('node:path');
const { test } = require('node:test');

const NODE_DIR = path.join(__dirname, '..', '..', 'client', 'node');
const { AttentionClient } = require(path.join(NODE_DIR, 'attention_client.js'));
const wire = require(path.join(NODE_DIR, 'wire.js'));
const { startServer: startAttentionServer, randomValues } = require('../support/server.js');

const [SERVER_BIN, MODEL_REPOSITORY] = process.argv.slice(2);
const OK = 0;
const CANCELLED = 1;
const INVALID_ARGUMENT = 3;
const DEADLINE_EXCEEDED = 4;
const NOT_FOUND = 5;
const UNIMPLEMENTED = 12;
const INTERNAL = 13;
const UNAVAILABLE = 14;
const UNAUTHENTICATED = 16;
const SMALL = { model: 'dot_product', queries: { shape: [1, 1, 2], data: [1, 2] } };

// A gRPC message as one framed Buffer.
function frame(message) {
  const prefix = Buffer.alloc(5);
  prefix.writeUInt32BE(message.length, 1);
  return Buffer.concat([prefix, message]);
}

// An AttendResponse whose output is `values` of shape [1, 1, n].
function attendResponse(values) {
  return Buffer.concat(wire.tensorParts(1, { shape: [1, 1, values.length], data: values }, 'output'));
}

// Answers `stream` with `message` and then `trailers`.
function answer(stream, message, trailers = { 'grpc-status': '0' }) {
  stream.respond({ ':status': 200, 'content-type': 'application/grpc' }, { waitForTrailers: true });
  stream.once('wantTrailers', () => stream.sendTrailers(trailers));
  stream.end(frame(message));
}

function trailersOnly(stream, headers) {
  stream.respond({ ':status': 200, 'content-type': 'application/grpc', ...headers }, { endStream: true });
}

// An HTTP/2 server on 127.0.0.1 that hands each stream, once its request
// has come whole, to script(stream, headers, request, index), and counts
// sessions and streams.
class ScriptedServer {
  constructor(script) {
    this.script = script;
    this.sessions = [];
    this.streams = [];
    this.server = http2.createServer();
    this.server.on('session', (session) => this.sessions.push(session));
    this.server.on('stream', (stream, headers) => {
      const index = this.streams.length;
      this.streams.push({ stream, headers });
      const chunks = [];
      stream.on('data', (chunk) => chunks.push(chunk));
      stream.on('error', () => {});
      stream.on('end', () => {
        if (!stream.destroyed) this.script(stream, headers, Buffer.concat(chunks), index);
      });
    });
  }

  async start() {
    this.server.listen(0, '127.0.0.1');
    await once(this.server, 'listening');
    return `127.0.0.1:${this.server.address().port}`;
  }

  stop() {
    for (const session of this.sessions) session.destroy();
    this.server.close();
  }
}

// A scripted server and a client of it, both stopped after `body`.
async function withServer(script, options, body) {
  const server = new ScriptedServer(script);
  const client = new AttentionClient(await server.start(), { timeoutMs: 10000, ...options });
  try {
    await body(client, server);
  } finally {
    client.close();
    server.stop();
  }
}

const echoOutput = (stream) => answer(stream, attendResponse(Float32Array.of(3, 4)));
const never = () => {};
// Resolves to the rejection's error (fails when the promise resolves).
async function failure(promise) {
  try {
    await promise;
  } catch (error) {
    return error;
  }
  throw new assert.AssertionError({ message: 'the call did not fail' });
}

test('scripted server', async (t) => {
  await t.test('the request and its headers', () => withServer(echoOutput, { token: 't0k' },
    async (client, server) => {
      const response = await client.attend(SMALL);
      assert.deepEqual(Array.from(response.output.data), [3, 4]);
      const { headers } = server.streams[0];
      assert.equal(headers[':method'], 'POST');
      assert.equal(headers[':path'], '/attention.v1.AttentionService/Attend');
      assert.equal(headers['content-type'], 'application/grpc');
      assert.equal(headers.te, 'trailers');
      assert.equal(headers.authorization, 'Bearer t0k');
      assert.match(headers['user-agent'], /^attention-client-node\//);
      const [, amount] = headers['grpc-timeout'].match(/^(\d+)m$/);
      assert.ok(Number(amount) > 9000 && Number(amount) <= 10000, headers['grpc-timeout']);
    }));

  await t.test('the request is framed once, uncompressed', () => {
    let request = null;
    return withServer((stream, headers, bytes) => {
      request = bytes;
      echoOutput(stream);
    }, {}, async (client) => {
      const data = Float32Array.from({ length: 1 << 15 }, (_, i) => i);
      await client.attend({ model: 'dot_product', queries: { shape: [1, 1 << 10, 32], data } });
      assert.equal(request[0], 0);
      assert.equal(request.readUInt32BE(1), request.length - 5);
      assert.ok(request.subarray(5).includes(Buffer.from(data.buffer, 0, 64)));
    });
  });

  await t.test('one session for sequential and concurrent calls', () => {
    const waiting = [];
    // The concurrent calls are answered only once all of them have come:
    // calls sent one after another would never be.
    return withServer((stream, headers, request, index) => {
      if (index < 3) {
        echoOutput(stream);
        return;
      }
      waiting.push(stream);
      if (waiting.length === 16) waiting.forEach(echoOutput);
    }, {}, async (client, server) => {
      for (let i = 0; i < 3; i += 1) await client.attend(SMALL);
      const answers = await Promise.all(Array.from({ length: 16 }, () => client.attend(SMALL)));
      assert.equal(answers.length, 16);
      assert.equal(server.streams.length, 19);
      assert.equal(server.sessions.length, 1);
    });
  });

  await t.test('a new session after GOAWAY', () => withServer((stream) => {
    const { session } = stream;
    echoOutput(stream);
    stream.once('close', () => session.goaway());
  }, { maxAttempts: 1 }, async (client, server) => {
    for (let i = 0; i < 3; i += 1) {
      await client.attend(SMALL);
      // The GOAWAY follows the answer; the next call must not race it.
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
    assert.equal(server.sessions.length, 3);
  }));

  await t.test('a passed deadline fails the call and cancels its stream', () => withServer(never,
    { timeoutMs: 200 }, async (client, server) => {
      const start = Date.now();
      const error = await failure(client.attend(SMALL));
      assert.equal(error.code, DEADLINE_EXCEEDED, error.message);
      assert.ok(Date.now() - start >= 190, `failed after ${Date.now() - start} ms`);
      const { stream } = server.streams[0];
      if (!stream.closed) await once(stream, 'close');
      assert.equal(stream.rstCode, http2.constants.NGHTTP2_CANCEL);
    }));

  await t.test('an AbortSignal cancels the call', () => withServer(never, {}, async (client, server) => {
    const controller = new AbortController();
    setTimeout(() => controller.abort(), 50);
    const error = await failure(client.attend(SMALL, { signal: controller.signal }));
    assert.equal(error.code, CANCELLED, error.message);
    const { stream } = server.streams[0];
    if (!stream.closed) await once(stream, 'close');
    assert.equal(stream.rstCode, http2.constants.NGHTTP2_CANCEL);
    const early = await failure(client.attend(SMALL, { signal: AbortSignal.abort() }));
    assert.equal(early.code, CANCELLED);
    assert.equal(server.streams.length, 1);
  }));

  await t.test('status and message from trailers, percent-decoded', () => withServer((stream) => {
    trailersOnly(stream, { 'grpc-status': '5', 'grpc-message': 'no%20model%20%E2%9C%93' });
  }, {}, async (client) => {
    const error = await failure(client.attend(SMALL));
    assert.equal(error.code, NOT_FOUND);
    assert.equal(error.details, 'no model \u2713');
    assert.equal(error.message, '5 NOT_FOUND: no model \u2713');
  }));

  await t.test('an error after a message: its status, not retried', () => withServer((stream) => {
    answer(stream, attendResponse(Float32Array.of(1)), { 'grpc-status': '14', 'grpc-message': 'gone' });
  }, { maxAttempts: 3 }, async (client, server) => {
    const error = await failure(client.attend(SMALL));
    assert.equal(error.code, UNAVAILABLE);
    assert.equal(error.details, 'gone');
    assert.equal(server.streams.length, 1);
  }));

  await t.test('HTTP statuses without a gRPC status', async () => {
    for (const [httpStatus, code, tries] of [[503, UNAVAILABLE, 3], [502, UNAVAILABLE, 3],
      [404, UNIMPLEMENTED, 1], [400, INTERNAL, 1]]) {
      await withServer((stream) => stream.respond({ ':status': httpStatus }, { endStream: true }),
        { maxAttempts: 3 }, async (client, server) => {
          const error = await failure(client.attend(SMALL));
          assert.equal(error.code, code, `${httpStatus}: ${error.message}`);
          assert.equal(error.details, `Received HTTP status code ${httpStatus}`);
          assert.equal(server.streams.length, tries, `${httpStatus}: tries`);
        });
    }
  });

  await t.test('UNAVAILABLE before any answer is retried', () => withServer((stream, headers, request, index) => {
    if (index === 0) trailersOnly(stream, { 'grpc-status': '14' });
    else echoOutput(stream);
  }, { maxAttempts: 2 }, async (client, server) => {
    const response = await client.attend(SMALL);
    assert.deepEqual(Array.from(response.output.data), [3, 4]);
    assert.equal(server.streams.length, 2);
  }));

  await t.test('an answer cut off before its status is sent again', () => withServer((stream, headers, request, index) => {
    if (index > 0) {
      echoOutput(stream);
      return;
    }
    stream.respond({ ':status': 200, 'content-type': 'application/grpc' }, { endStream: false });
    stream.end(frame(attendResponse(Float32Array.of(1))));
  }, { maxAttempts: 2 }, async (client, server) => {
    const response = await client.attend(SMALL);
    assert.deepEqual(Array.from(response.output.data), [3, 4]);
    assert.equal(server.streams.length, 2);
  }));

  await t.test('other errors are not retried', () => withServer((stream) => {
    trailersOnly(stream, { 'grpc-status': String(INVALID_ARGUMENT), 'grpc-message': 'bad' });
  }, { maxAttempts: 5 }, async (client, server) => {
    assert.equal((await failure(client.attend(SMALL))).code, INVALID_ARGUMENT);
    assert.equal(server.streams.length, 1);
  }));

  await t.test('answers that are not one valid message', async () => {
    const cases = [
      [(stream) => answer(stream, Buffer.alloc(0), { 'grpc-status': '0' }), OK],
      [(stream) => trailersOnly(stream, { 'grpc-status': '0' }), UNIMPLEMENTED, /No message received/],
      [(stream) => answer(stream, Buffer.from([0x0a, 0xff]), { 'grpc-status': '0' }), INTERNAL,
        /Response message parsing error/],
      [(stream) => {
        stream.respond({ ':status': 200, 'content-type': 'application/grpc' }, { endStream: false });
        stream.end(Buffer.concat([frame(Buffer.alloc(2)), frame(Buffer.alloc(2))]));
      }, UNIMPLEMENTED, /Too many responses/],
      [(stream) => {
        stream.respond({ ':status': 200, 'content-type': 'application/grpc' }, { endStream: false });
        stream.end(frame(attendResponse(Float32Array.of(1))));
      }, INTERNAL, /Call ended without gRPC status/],
      [(stream) => stream.close(http2.constants.NGHTTP2_INTERNAL_ERROR), INTERNAL, /RST_STREAM with code 2/],
    ];
    for (const [script, code, details] of cases) {
      await withServer(script, { maxAttempts: 1 }, async (client) => {
        if (code === OK) {
          const models = await client.listModels();
          assert.deepEqual(models, []);
          return;
        }
        const error = await failure(client.attend(SMALL));
        assert.equal(error.code, code, error.message);
        assert.match(error.details, details);
      });
    }
  });

  await t.test('round-robin over two servers, and past a stopped one', async () => {
    const servers = [new ScriptedServer(echoOutput), new ScriptedServer(echoOutput)];
    const addresses = await Promise.all(servers.map((server) => server.start()));
    // No retries: a stopped server's failure shows.
    const client = new AttentionClient(addresses.join(','), { timeoutMs: 10000, maxAttempts: 1 });
    try {
      for (let i = 0; i < 10; i += 1) await client.attend(SMALL);
      assert.deepEqual(servers.map((server) => server.streams.length), [5, 5]);
      servers[0].stop();
      let failed = 0;
      for (let i = 0; i < 10; i += 1) await client.attend(SMALL).catch(() => { failed += 1; });
      // A call on the dropped session may fail, and the first try to
      // reconnect does; the stopped server is passed over after that.
      assert.ok(failed <= 2, `${failed} calls failed`);
      assert.equal(servers[1].streams.length, 5 + 10 - failed);
    } finally {
      client.close();
      servers[1].stop();
    }
  });

  await t.test('close() ends the session; later calls fail', () => withServer(echoOutput, {},
    async (client, server) => {
      await client.attend(SMALL);
      const closed = once(server.sessions[0], 'close');
      client.close();
      const late = new Promise((_, reject) => {
        setTimeout(() => reject(new Error('the session is still open 5 s after close()')), 5000).unref();
      });
      await Promise.race([closed, late]);
      const error = await failure(client.attend(SMALL));
      assert.equal(error.code, UNAVAILABLE, error.message);
      assert.equal(server.streams.length, 1);
    }));

  await t.test('a server that is not there is UNAVAILABLE', async () => {
    const server = new ScriptedServer(never);
    const address = await server.start();
    server.stop();
    const client = new AttentionClient(address, { maxAttempts: 2 });
    try {
      const error = await failure(client.attend(SMALL));
      assert.equal(error.code, UNAVAILABLE, error.message);
    } finally {
      client.close();
    }
  });
});

// An attention-server on `address` (port 0: one the system picks) with
// `flags`; resolves to { address, stop() } once it serves.
function startServer(address, flags = []) {
  return startAttentionServer(SERVER_BIN, MODEL_REPOSITORY, address, flags);
}

// softmax(q q^T / sqrt(d)) q of one (n, d) batch item, in float64.
function selfAttention(q, n, d) {
  const out = new Float64Array(n * d);
  const scores = new Float64Array(n);
  for (let i = 0; i < n; i += 1) {
    for (let j = 0; j < n; j += 1) {
      let dot = 0;
      for (let k = 0; k < d; k += 1) dot += q[i * d + k] * q[j * d + k];
      scores[j] = dot / Math.sqrt(d);
    }
    const top = Math.max(...scores);
    let sum = 0;
    for (let j = 0; j < n; j += 1) {
      scores[j] = Math.exp(scores[j] - top);
      sum += scores[j];
    }
    for (let j = 0; j < n; j += 1) {
      for (let k = 0; k < d; k += 1) out[i * d + k] += (scores[j] / sum) * q[j * d + k];
    }
  }
  return out;
}

test('real server', async (t) => {
  const tokens = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'node-unary-tokens-')), 'tokens');
  fs.writeFileSync(tokens, 's3cret\n');
  const server = await startServer('127.0.0.1:0');
  t.after(() => server.stop());

  await t.test('an error status with its message', async () => {
    const client = new AttentionClient(server.address);
    try {
      const error = await failure(client.attend({ ...SMALL, model: 'no_such_model' }));
      assert.equal(error.code, NOT_FOUND);
      assert.match(error.details, /no model named 'no_such_model'/);
    } finally {
      client.close();
    }
  });

  await t.test('a 16 MiB request and answer', async () => {
    const shape = [64, 64, 1024];
    const queries = randomValues(64 * 64 * 1024, 7);
    const client = new AttentionClient(server.address, { timeoutMs: 120000 });
    try {
      const response = await client.attend({ model: 'dot_product', queries: { shape, data: queries } });
      assert.deepEqual(response.output.shape, shape);
      for (const batch of [0, 21, 63]) {
        const size = 64 * 1024;
        const expected = selfAttention(queries.subarray(batch * size, (batch + 1) * size), 64, 1024);
        const actual = response.output.data.subarray(batch * size, (batch + 1) * size);
        let maxDiff = 0;
        actual.forEach((value, i) => { maxDiff = Math.max(maxDiff, Math.abs(value - expected[i])); });
        assert.ok(maxDiff < 1e-4, `batch ${batch}: max abs difference ${maxDiff}`);
      }
    } finally {
      client.close();
    }
  });

  await t.test('the bearer token', async () => {
    const secured = await startServer('127.0.0.1:0', ['--auth-token-file', tokens]);
    try {
      for (const [token, code] of [['s3cret', OK], [undefined, UNAUTHENTICATED], ['wrong', UNAUTHENTICATED]]) {
        const client = new AttentionClient(secured.address, { token });
        try {
          const got = await client.listModels().then(() => OK, (error) => error.code);
          assert.equal(got, code, `token ${token}`);
        } finally {
          client.close();
        }
      }
    } finally {
      await secured.stop();
    }
  });

  await t.test('a server restarted on the same port', async () => {
    const first = await startServer('127.0.0.1:0');
    const client = new AttentionClient(first.address, { maxAttempts: 1 });
    let second = null;
    try {
      assert.ok((await client.listModels()).length > 0);
      await first.stop();
      assert.equal((await failure(client.attend(SMALL))).code, UNAVAILABLE);
      second = await startServer(first.address);
      const response = await client.attend(SMALL);
      assert.deepEqual(response.output.shape, [1, 1, 2]);
    } finally {
      client.close();
      if (second !== null) await second.stop();
    }
  });
});
