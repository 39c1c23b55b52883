// unary.js: gRPC unary calls over Node's own HTTP/2 (node:http2), for the
// client's Attend and ListModels. grpc-js copies every request into a framed
// Buffer of its own, joins every answer into another, and leaves HTTP/2's
// 16 KiB frames, so a 1 MiB answer comes in 64 of them; this sends a framed
// request from the caller's Buffer as it is, copies an answer once into a
// Buffer of its own, and takes frames of up to 4 MiB: about two thirds of
// grpc-js's CPU per large call (BENCHMARKS.md, "Clients"). It does what the client
// needs of gRPC for unary calls and no more: the wire format, deadlines,
// status codes as grpc-js reports them, retries on UNAVAILABLE with
// backoff, round-robin over several servers, TLS. Streams stay on grpc-js.
'use strict';

const http2 = require('node:http2');
const { Metadata, status: Status } = require('@grpc/grpc-js');
const { version } = require('./package.json');

const {
  NGHTTP2_CANCEL, NGHTTP2_REFUSED_STREAM, NGHTTP2_ENHANCE_YOUR_CALM, NGHTTP2_INADEQUATE_SECURITY,
  NGHTTP2_FLAG_END_STREAM, NGHTTP2_NO_ERROR,
} = http2.constants;

// The connection's and each stream's receive window: answers up to 16 MiB
// come without waiting for this process to grant more.
const WINDOW_BYTES = 16 << 20;
// The largest DATA frame the server may send: the most grpc's C++ server
// writes (4 MiB - 1), against HTTP/2's default of 16 KiB.
const MAX_FRAME_BYTES = (4 << 20) - 1;
// A server whose connection failed this recently is passed over while
// another is not failing.
const FAILED_FOR_MS = 1000;
// Backoff between tries on UNAVAILABLE: gRPC's (a random wait up to the
// backoff, which doubles from 50 ms to at most 1 s), as the service config
// of the package's grpc-js channel had it.
const INITIAL_BACKOFF_MS = 50;
const MAX_BACKOFF_MS = 1000;
const PREFIX_BYTES = 5;

// A failed call as grpc-js reports one: an Error with .code, .details and
// .metadata (the trailers).
function callError(code, details, metadata = new Metadata()) {
  return Object.assign(new Error(`${code} ${Status[code]}: ${details}`), { code, details, metadata });
}

// grpc-js's mapping of an HTTP status that came without a gRPC status.
function httpStatusCode(httpStatus) {
  switch (httpStatus) {
    case 400: return Status.INTERNAL;
    case 401: return Status.UNAUTHENTICATED;
    case 403: return Status.PERMISSION_DENIED;
    case 404: return Status.UNIMPLEMENTED;
    case 429: case 502: case 503: case 504: return Status.UNAVAILABLE;
    default: return Status.UNKNOWN;
  }
}

// The call's status from its trailers (or trailers-only headers): null when OK.
function trailerError(trailers, httpStatus) {
  const code = trailers['grpc-status'];
  if (code === '0') return null;
  const metadata = Metadata.fromHttp2Headers(trailers);
  if (code === undefined) {
    return callError(httpStatusCode(httpStatus), `Received HTTP status code ${httpStatus}`, metadata);
  }
  metadata.remove('grpc-status');
  metadata.remove('grpc-message');
  const message = trailers['grpc-message'] || '';
  let details = message;
  try {
    details = decodeURIComponent(message);
  } catch {
    // Not percent-encoded as gRPC asks: shown as it came.
  }
  return callError(Number(code), details, metadata);
}

// Why a stream closed without a gRPC status: a lost connection is
// UNAVAILABLE, a reset stream as grpc-js maps its code.
function resetError(stream, session, error) {
  const code = stream.rstCode;
  if (code === NGHTTP2_REFUSED_STREAM) return callError(Status.UNAVAILABLE, 'Stream refused by server');
  if (session.destroyed || (error && error.code !== 'ERR_HTTP2_STREAM_ERROR')) {
    return callError(Status.UNAVAILABLE, `Connection dropped${error ? `: ${error.message}` : ''}`);
  }
  if (code === NGHTTP2_ENHANCE_YOUR_CALM) {
    return callError(Status.RESOURCE_EXHAUSTED, 'Bandwidth exhausted or memory limit exceeded');
  }
  if (code === NGHTTP2_INADEQUATE_SECURITY) return callError(Status.PERMISSION_DENIED, 'Protocol not secure enough');
  const why = code === NGHTTP2_NO_ERROR ? ' (Call ended without gRPC status)' : '';
  return callError(Status.INTERNAL, `Received RST_STREAM with code ${code}${why}`);
}

// 'grpc-timeout' for a deadline `ms` from now: at most 8 digits and a unit
// (99999999 hours: longer, even Infinity).
function timeoutHeader(ms) {
  for (const [unit, factor] of [['m', 1], ['S', 1000], ['M', 60000], ['H', 3600000]]) {
    if (ms / factor < 1e8) return `${Math.max(1, Math.ceil(ms / factor))}${unit}`;
  }
  return '99999999H';
}

// The one message of a unary answer, from its DATA chunks: a Buffer of its
// own when 4 KiB or more (Buffer.allocUnsafe's pool only serves smaller
// ones), which wire.js then leaves the answer's tensors in.
class MessageReader {
  constructor() {
    this.prefix = Buffer.alloc(PREFIX_BYTES);
    this.prefixFilled = 0;
    this.message = null;
    this.filled = 0;
    this.count = 0;
  }

  // Takes one chunk; throws a call error for what a unary answer must not be.
  push(chunk) {
    let pos = 0;
    while (pos < chunk.length) {
      if (this.prefixFilled < PREFIX_BYTES) {
        const n = chunk.copy(this.prefix, this.prefixFilled, pos, pos + PREFIX_BYTES - this.prefixFilled);
        this.prefixFilled += n;
        pos += n;
        if (this.prefixFilled === PREFIX_BYTES) this.begin();
        continue;
      }
      const n = chunk.copy(this.message, this.filled, pos, pos + this.message.length - this.filled);
      this.filled += n;
      pos += n;
      if (this.filled === this.message.length) this.prefixFilled = 0;
    }
  }

  begin() {
    if (this.prefix[0] !== 0) {
      throw callError(Status.INTERNAL, 'Received a compressed message, which the client never asks for');
    }
    this.count += 1;
    if (this.count > 1) throw callError(Status.UNIMPLEMENTED, 'Too many responses received');
    this.message = Buffer.allocUnsafe(this.prefix.readUInt32BE(1));
    this.filled = 0;
    if (this.message.length === 0) this.prefixFilled = 0;
  }

  // The message, or the error of an answer without exactly one whole message.
  result() {
    if (this.message === null) return { error: callError(Status.UNIMPLEMENTED, 'No message received') };
    if (this.prefixFilled !== 0 || this.filled !== this.message.length) {
      return { error: callError(Status.INTERNAL, 'The answer ended inside a message') };
    }
    return { message: this.message };
  }
}

// One server's HTTP/2 session, made when a call needs it and again after it
// closes (GOAWAY, a restart, a lost connection). It keeps the process alive
// only while calls are in flight on it.
class Connection {
  constructor(origin, options) {
    this.origin = origin;
    this.options = options;
    this.current = null;
    this.failedAt = -Infinity;
  }

  session() {
    if (this.current === null || this.current.closed || this.current.destroyed) this.current = this.connect();
    return this.current;
  }

  connect() {
    const session = http2.connect(this.origin, this.options);
    session.active = 0;
    // Its streams report the error; one left unhandled would end the process.
    session.on('error', () => {});
    session.once('connect', () => {
      session.connected = true;
      session.setLocalWindowSize(WINDOW_BYTES);
    });
    const forget = () => {
      if (!session.connected) this.failedAt = Date.now();
      if (this.current === session) this.current = null;
    };
    session.once('goaway', forget);
    session.once('close', forget);
    return session;
  }

  failing() {
    return Date.now() - this.failedAt < FAILED_FOR_MS;
  }

  close() {
    if (this.current !== null) this.current.close();
    this.current = null;
  }
}

// A deadline and an AbortSignal as one promise that rejects when either
// comes first (error), cancelling the stream in flight (cancel).
class Stop {
  constructor(deadline, signal) {
    this.deadline = deadline;
    this.error = null;
    this.cancel = () => {};
    this.promise = new Promise((_, reject) => {
      this.stop = (error) => {
        if (this.error !== null) return;
        this.error = error;
        this.cancel();
        reject(error);
      };
    });
    this.promise.catch(() => {});
    this.signal = signal;
    this.onAbort = () => this.stop(callError(Status.CANCELLED, 'Cancelled on client'));
    const onDeadline = () => this.stop(callError(Status.DEADLINE_EXCEEDED, 'Deadline exceeded'));
    const left = deadline - Date.now();
    // setTimeout fires at once for more than 2^31 - 1 ms: no timer, as for Infinity.
    this.timer = left <= 0 ? onDeadline() : left < 2 ** 31 ? setTimeout(onDeadline, left) : undefined;
    if (signal) {
      if (signal.aborted) this.onAbort();
      else signal.addEventListener('abort', this.onAbort, { once: true });
    }
  }

  // The stream to cancel if the call stops while it is in flight.
  watch(stream) {
    this.cancel = () => stream.close(NGHTTP2_CANCEL);
    if (this.error !== null) this.cancel();
  }

  dispose() {
    clearTimeout(this.timer);
    if (this.signal) this.signal.removeEventListener('abort', this.onAbort);
  }
}

// The writes of one call's request, all tries: sent() runs once the call has
// ended and Node holds the bytes for no write any more (it sends from their
// memory as it is), so that they may be written over.
class Writes {
  constructor(sent) {
    this.sent = sent;
    this.pending = 0;
    this.ended = false;
  }

  send(stream, bytes) {
    this.pending += 1;
    stream.write(bytes, () => {
      this.pending -= 1;
      this.check();
    });
    stream.end();
  }

  end() {
    this.ended = true;
    this.check();
  }

  check() {
    if (this.ended && this.pending === 0) this.sent();
  }
}

// 'a:1,b:2' (or 'ipv4:a:1,b:2', 'dns:///a:1') -> ['a:1', 'b:2']; a port
// left out is gRPC's 443.
function addresses(target) {
  return target.replace(/^(ipv4:|dns:(\/\/[^/]*\/)?)/, '').split(',').map((entry) => {
    const address = entry.trim();
    return /:\d+$/.test(address) ? address : `${address}:443`;
  });
}

class UnaryTransport {
  // target: as addresses() reads it. options: headers (sent with every
  // call), maxAttempts, and tls / rootCerts / privateKey / certChain as the
  // client takes them.
  constructor(target, options) {
    const { headers = {}, maxAttempts = 1, tls = false, rootCerts, privateKey, certChain } = options;
    const secure = Boolean(tls || rootCerts || certChain);
    const connectOptions = {
      settings: { initialWindowSize: WINDOW_BYTES, maxFrameSize: MAX_FRAME_BYTES, enablePush: false },
    };
    if (secure) Object.assign(connectOptions, { ca: rootCerts, key: privateKey, cert: certChain });
    this.connections = addresses(target).map((address) => new Connection(
      `${secure ? 'https' : 'http'}://${address}`, connectOptions));
    this.next = 0;
    this.headers = {
      'content-type': 'application/grpc',
      te: 'trailers',
      'user-agent': `attention-client-node/${version}`,
      ...headers,
    };
    this.maxAttempts = maxAttempts;
    this.closed = false;
  }

  // The next server in turn that is not failing, else the next in turn.
  pick() {
    const count = this.connections.length;
    let index = this.next;
    for (let i = 0; i < count; i += 1) {
      const candidate = (this.next + i) % count;
      if (!this.connections[candidate].failing()) {
        index = candidate;
        break;
      }
    }
    this.next = (index + 1) % count;
    return this.connections[index];
  }

  // Resolves to the answer's message bytes for the framed request `bytes`
  // (prefix included) to `path`. options: deadline (ms since the epoch),
  // signal (an AbortSignal), sent (called once no write holds `bytes` any
  // more: the call has ended and Node has let go of the memory).
  async call(path, bytes, { deadline, signal, sent = () => {} }) {
    const stop = new Stop(deadline, signal);
    const writes = new Writes(sent);
    let backoff = INITIAL_BACKOFF_MS;
    try {
      for (let attempt = 1; ; attempt += 1) {
        if (stop.error !== null) throw stop.error;
        if (this.closed) throw callError(Status.UNAVAILABLE, 'The client is closed');
        const outcome = await Promise.race([this.attempt(path, bytes, stop, writes), stop.promise]);
        if (outcome.error === undefined) return outcome.message;
        const retry = ((outcome.error.code === Status.UNAVAILABLE && !outcome.committed) || outcome.cutOff) &&
          attempt < this.maxAttempts;
        if (!retry || this.closed) throw outcome.error;
        await Promise.race([new Promise((resolve) => setTimeout(resolve, Math.random() * backoff)), stop.promise]);
        backoff = Math.min(2 * backoff, MAX_BACKOFF_MS);
      }
    } finally {
      stop.dispose();
      writes.end();
    }
  }

  // One try on one server: resolves to { message } or { error, committed,
  // cutOff } (committed: the server sent headers, so gRPC would not retry it;
  // cutOff: the answer ended without its status, as an edge ends it when the
  // replica behind it is killed mid-answer: attention-server always sends
  // one, and these calls are idempotent, so it is sent again).
  attempt(path, bytes, stop, writes) {
    return new Promise((resolve) => {
      const connection = this.pick();
      let session;
      let stream;
      try {
        session = connection.session();
        stream = session.request({
          ...this.headers, ':method': 'POST', ':path': path,
          'grpc-timeout': timeoutHeader(stop.deadline - Date.now()),
        });
      } catch (error) {
        connection.current = null;
        resolve({ error: callError(Status.UNAVAILABLE, error.message) });
        return;
      }
      this.track(session, stream);
      stop.watch(stream);
      writes.send(stream, bytes);
      this.read(stream, session, resolve);
    });
  }

  // Keeps the process alive while `session` has calls in flight.
  track(session, stream) {
    if (session.active === 0) session.ref();
    session.active += 1;
    stream.once('close', () => {
      session.active -= 1;
      if (session.active === 0 && !session.destroyed) session.unref();
    });
  }

  // Reads the answer of `stream`; resolves as attempt() does once it closes.
  read(stream, session, resolve) {
    const reader = new MessageReader();
    let httpStatus;
    let trailers = null;
    let committed = false;
    let failure = null; // what the client itself found wrong with the answer
    let streamError = null;
    stream.on('response', (headers, flags) => {
      httpStatus = headers[':status'];
      if (flags & NGHTTP2_FLAG_END_STREAM) trailers = headers;
      else committed = true;
    });
    stream.on('trailers', (headers) => { trailers = headers; });
    stream.on('data', (chunk) => {
      if (failure !== null) return;
      try {
        reader.push(chunk);
      } catch (error) {
        // Not a call error: a length past what a Buffer can hold.
        failure = typeof error.code === 'number' ? error : callError(Status.RESOURCE_EXHAUSTED, error.message);
        stream.close(NGHTTP2_CANCEL);
      }
    });
    stream.on('error', (error) => { streamError = error; });
    stream.on('close', () => {
      if (failure !== null) {
        resolve({ error: failure, committed });
        return;
      }
      const error = trailers === null ? resetError(stream, session, streamError) : trailerError(trailers, httpStatus);
      const cutOff = trailers === null && stream.rstCode === NGHTTP2_NO_ERROR && !session.destroyed &&
        streamError === null;
      resolve(error === null ? reader.result() : { error, committed, cutOff });
    });
  }

  // Lets calls in flight finish, then closes every session; later calls fail.
  close() {
    this.closed = true;
    for (const connection of this.connections) connection.close();
  }
}

module.exports = { UnaryTransport, callError, PREFIX_BYTES };
