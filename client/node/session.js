// session.js: a decoding session over one AttendSession stream (docs/api.md
// section 11): opened once, then stepped with the new rows only; the server
// keeps the keys and values. Made by AttentionClient.session().
//
// A session lives in one server process, so a replica that restarts or dies
// takes it along. The session therefore keeps what it sent (the opening, and
// for self memory every step's rows), and when its stream breaks it opens a
// new stream through the same channel, replays the rows as one prefill step
// (self memory equals causal attention on the whole prefix, so the state is
// the same) and sends the broken step again (docs/api.md section 11.6).
'use strict';

const grpc = require('@grpc/grpc-js');
const wire = require('./wire');
const { SessionLost, streamError } = require('./errors');

// What a session keeps for a replay unless told otherwise.
const REPLAY_LIMIT_BYTES = 64 << 20;
// How a stream ends when its server went away: UNAVAILABLE (a connection
// lost, a replica's shutdown: sections 6.5 and 11.5), CANCELLED (a stream
// reset by a proxy or by a server that stopped without gRPC's shutdown).
const BREAKS = new Set([grpc.status.UNAVAILABLE, grpc.status.CANCELLED]);
// The pauses between tries at opening the stream again, as the unary calls'
// retries wait (unary.js): from 50 ms, doubling, at most 1 s.
const REOPEN_BACKOFF_MS = [50, 1000];
// SessionRequest: open = 1, step = 2; SessionStep: queries = 1, keys = 3,
// values = 4.
const OPEN = 1;
const STEP = 2;
const STEP_QUERIES = 1;
const STEP_KEYS = 3;
const STEP_VALUES = 4;

// The bytes of message field `number` whose body is `parts` joined.
function messageField(number, parts) {
  const size = parts.reduce((total, part) => total + part.length, 0);
  return Buffer.concat([Buffer.from([(number << 3) | wire.LEN, ...wire.varint(size)]), ...parts]);
}

// A SessionRequest's bytes stepping with `rows` ({ shape, data }), and the
// step's own keys and values when given.
function stepRequest(rows, returnAttentionWeights, keys = null, values = null) {
  const parts = wire.tensorParts(STEP_QUERIES, rows, 'rows');
  if (keys) parts.push(...wire.tensorParts(STEP_KEYS, keys, 'keys'));
  if (values) parts.push(...wire.tensorParts(STEP_VALUES, values, 'values'));
  if (returnAttentionWeights) parts.unshift(Buffer.from([0x10, 0x01])); // field 2, true
  return messageField(STEP, parts);
}

// A SessionRequest's bytes opening a session: `small` (SessionOpen's fields
// but its tensors) through protobufjs, then keys (5) and values (6) from
// their memory.
function openRequest(serialize, small, keys, values) {
  const encoded = serialize({ open: small });
  let body = null;
  wire.forEachField(encoded, 0, encoded.length, 'SessionRequest', (number, type, start, stop) => {
    if (number === OPEN) body = encoded.subarray(start, stop);
  });
  const parts = [body];
  if (keys) parts.push(...wire.tensorParts(5, keys, 'keys'));
  if (values) parts.push(...wire.tensorParts(6, values, 'values'));
  return messageField(OPEN, parts);
}

// A self session's rows so far, kept per step, and the one (B, n, d) or
// (B, n, H, d) prefill they make.
class Rows {
  constructor() {
    this.steps = []; // { batch, rows, width, data: a copy of the step's values }
    this.count = 0;
    this.bytes = 0;
  }

  static bytesOf(rows) {
    return rows ? rows.data.length * 4 : 0;
  }

  append(rows) {
    const [batch, n, ...row] = rows.shape.map(Number);
    // A row's values: d, or H * d for grouped heads.
    const width = row.reduce((product, size) => product * size, 1);
    this.steps.push({ batch, n, width, row, data: Float32Array.from(rows.data) });
    this.count += n;
    this.bytes += Rows.bytesOf(rows);
  }

  // Every step's rows side by side, per example: (B, count, ...row).
  all() {
    const { batch, width, row: rowShape } = this.steps[0];
    const data = new Float32Array(batch * this.count * width);
    let row = 0;
    for (const step of this.steps) {
      for (let b = 0; b < batch; b += 1) {
        const from = step.data.subarray(b * step.n * width, (b + 1) * step.n * width);
        data.set(from, (b * this.count + row) * width);
      }
      row += step.n;
    }
    return { shape: [batch, this.count, ...rowShape], data };
  }
}

// The session's stream as promises: one answer per message, in order.
class Stream {
  constructor(call) {
    this.call = call;
    this.waiting = []; // { resolve, reject } per message sent and not answered
    this.ended = null; // the error that ended the call, once it has
    call.on('data', (response) => this.waiting.shift()?.resolve(response));
    call.on('error', (error) => this.end(error));
    call.on('status', (status) => {
      if (status.code === grpc.status.OK) {
        this.end(Object.assign(new Error('AttendSession: the stream ended without an answer'),
          { code: grpc.status.INTERNAL, details: 'the stream ended without an answer' }));
      }
    });
  }

  end(error) {
    this.ended = this.ended || error;
    for (const { reject } of this.waiting.splice(0)) reject(this.ended);
  }

  exchange(request) {
    if (this.ended) return Promise.reject(this.ended);
    return new Promise((resolve, reject) => {
      this.waiting.push({ resolve, reject });
      this.call.write(request);
    });
  }

  close() {
    if (!this.ended) this.call.end();
  }

  cancel() {
    this.call.removeAllListeners('data');
    this.call.cancel();
  }
}

class Session {
  // Use AttentionClient.session(), which opens it.
  constructor(client, small, keys, values, options) {
    const { memory = 'self', timeoutMs, replay = true, replayLimitBytes = REPLAY_LIMIT_BYTES } = options;
    this.client = client;
    this.replay = replay;
    this.replayLimitBytes = replayLimitBytes;
    this.deadline = timeoutMs === undefined ? Infinity : Date.now() + timeoutMs;
    const opening = openRequest(client.methods.AttendSession.encode, small, keys, values);
    this.opening = replay ? opening : null;
    // Cross memory is all in the opening: steps change nothing to replay.
    this.rows = memory === 'self' && replay ? new Rows() : null;
    // A self session's steps' own keys and values, when they carry them: the
    // replay's prefill carries them too.
    this.keys = new Rows();
    this.values = new Rows();
    this.unreplayable = null; // why a break can no longer be replayed
    this.forgetPast(opening.length);
    this.replays = 0;
    this.closed = false;
    this.tail = Promise.resolve(); // steps go one after another
    this.first = opening;
  }

  // Opens the stream; resolves to the session, or rejects with the opening's
  // AttendError.
  async open() {
    this.stream = this.start();
    const opened = await this.stream.exchange(this.first);
    this.first = null;
    if (opened.error) {
      this.close();
      throw streamError(opened);
    }
    this.opened(opened);
    return this;
  }

  // Sends the step's rows ({ shape: [B, n_new, d], data }); a dot_product
  // self session over grouped heads takes 4-D rows (B, n_new, H, d) and
  // options.keys (B, n_new, H_kv, d) and options.values (B, n_new, H_kv, d_v),
  // the step's own, appended instead of the rows. Resolves to
  // { output, attention_weights?, length }. Rejects with an AttendError for a
  // step the server refused (the session is as before it and can go on).
  // A broken stream is replayed and the step sent again (`replays` counts
  // it); without replay the stream's error, and with replay that cannot be
  // done a SessionLost saying why.
  step(rows, options = {}) {
    const own = { keys: options.keys || null, values: options.values || null };
    const result = this.tail.then(() => this.send(rows, options.return_attention_weights === true, own));
    this.tail = result.catch(() => {});
    return result;
  }

  // Ends the session: the server frees its keys and values.
  close() {
    if (this.closed) return;
    this.closed = true;
    this.stream.close();
  }

  start() {
    return new Stream(this.client.stub.AttendSession(this.client.metadata, { deadline: this.deadline }));
  }

  opened(response) {
    this.session_id = response.session_id;
    this.model = response.model;
    this.model_version = response.model_version;
    this.length = response.length || 0;
  }

  // Drops what the session keeps for a replay once it needs `bytes`, more
  // than the limit, or for `reason`: a later break then fails, saying why.
  forgetPast(bytes, reason = null) {
    const over = this.replay && bytes > this.replayLimitBytes;
    if (!over && reason === null) return;
    this.unreplayable = reason || `its opening and rows take ${bytes} bytes, more than `
      + `replayLimitBytes=${this.replayLimitBytes}`;
    this.rows = null;
    this.opening = null;
  }

  // Appends a step's rows (and its own keys and values) to what the
  // replay's prefill sends. A prefill is one step, so steps that differ in
  // which of keys and values they carry cannot be replayed as one.
  keepForReplay(rows, own) {
    const kept = [[this.keys, own.keys], [this.values, own.values]];
    if (this.rows.count > 0 && kept.some(([store, part]) => (part === null) !== (store.count === 0))) {
      this.forgetPast(0, 'its steps differ in whether they carry keys and values');
      return;
    }
    this.forgetPast(this.opening.length + this.rows.bytes + Rows.bytesOf(rows)
      + kept.reduce((total, [store, part]) => total + store.bytes + Rows.bytesOf(part), 0));
    if (!this.rows) return;
    this.rows.append(rows);
    for (const [store, part] of kept) if (part) store.append(part);
  }

  async send(rows, weights, own = { keys: null, values: null }) {
    if (this.closed) throw new Error('the session is closed');
    const request = stepRequest(rows, weights, own.keys, own.values);
    // The replayed stream may break too before it answers (a server short of
    // session memory preempts the session again): it is replayed again, until
    // the client's timeout after the first break.
    let response;
    let giveUp = null;
    while (!response) {
      try {
        response = await this.stream.exchange(request);
      } catch (error) {
        if (giveUp === null) giveUp = Date.now() + this.client.timeoutMs;
        if (!this.replay || !BREAKS.has(error.code) || Date.now() > giveUp) throw error;
        await this.replayOnNewStream(error);
      }
    }
    this.length = response.length || 0;
    if (response.error) throw streamError(response);
    if (this.rows) this.keepForReplay(rows, own);
    const { output, attention_weights: attentionWeights, length = 0 } = response;
    return attentionWeights ? { output, attention_weights: attentionWeights, length } : { output, length };
  }

  // After `error` broke the stream: a new stream holding the session as it
  // was, or a SessionLost.
  async replayOnNewStream(error) {
    this.stream.cancel();
    const broke = `the session's stream broke (${grpc.status[error.code]}: ${error.details})`;
    if (this.unreplayable !== null) {
      this.closed = true;
      throw new SessionLost(error.code, `${broke} and cannot be replayed: ${this.unreplayable}`);
    }
    const { length } = this;
    const giveUp = Date.now() + this.client.timeoutMs;
    let [backoff] = REOPEN_BACKOFF_MS;
    let tries = 0;
    let last = '';
    for (;;) {
      tries += 1;
      try {
        // A target that is restarting: wait for a connection first.
        await new Promise((resolve, reject) => {
          this.client.stub.waitForReady(giveUp,
            (failed) => (failed ? reject(Object.assign(failed, { ready: false })) : resolve()));
        });
        this.stream = this.start();
        const opened = await this.stream.exchange(this.opening);
        let refused = opened.error ? opened : null;
        if (!refused && this.rows && this.rows.count > 0) {
          const prefill = await this.stream.exchange(stepRequest(this.rows.all(), false,
            this.keys.count > 0 ? this.keys.all() : null,
            this.values.count > 0 ? this.values.all() : null));
          refused = prefill.error ? prefill : null;
        }
        if (refused && BREAKS.has(refused.error.code)) { // a server draining: another may take it
          throw Object.assign(new Error(refused.error.message),
            { code: refused.error.code, details: refused.error.message });
        }
        if (refused) {
          this.close();
          throw new SessionLost(refused.error.code,
            `${broke}; replaying it on a new stream was refused: ${refused.error.message}`);
        }
        this.opened(opened);
        this.length = length;
        this.replays += 1;
        return;
      } catch (again) {
        if (again instanceof SessionLost || (again.ready !== false && !BREAKS.has(again.code))) throw again;
        this.stream.cancel();
        last = again.ready === false
          ? `no server took a connection within ${this.client.timeoutMs} ms`
          : `${grpc.status[again.code]}: ${again.details}`;
      }
      if (Date.now() + backoff > giveUp) break;
      await new Promise((resolve) => setTimeout(resolve, backoff));
      backoff = Math.min(2 * backoff, REOPEN_BACKOFF_MS[1]);
    }
    this.closed = true;
    throw new SessionLost(error.code, `${broke}; ${tries} tries at opening it again in `
      + `${this.client.timeoutMs} ms failed, the last: ${last}`);
  }
}

module.exports = { Session, REPLAY_LIMIT_BYTES, stepRequest };
