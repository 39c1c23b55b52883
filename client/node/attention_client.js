// attention_client.js: a small Node client for attention-server. Unary
// calls (attend, listModels) go over node:http2 (unary.js), AttendStream over
// @grpc/grpc-js; the service is loaded from proto/ by @grpc/proto-loader.
//
//   const { AttentionClient } = require('./attention_client');
//   const client = new AttentionClient('127.0.0.1:50051');
//   const models = await client.listModels();
//   const response = await client.attend({ model: 'dot_product', queries: { shape: [1, 2, 4], data: [...] } });
//   for await (const item of client.attendStream([request1, request2])) {
//     if (item instanceof AttendError) console.log(item.code, item.details); // the stream goes on
//     else console.log(item.output);
//   }
//   client.close();
//
// Messages are plain objects with the .proto field names (snake_case, as in
// proto JSON): { model, queries: { shape, data }, valid_lens, ... }. A
// tensor's data goes out from a Float32Array's memory as it is (an Array of
// numbers is converted once), and answers' data are Float32Arrays, large
// ones views on the received bytes; the wire is exactly what any protobuf
// encoder writes (wire.js). A failed call rejects with an error shaped like
// grpc-js's: .code is the gRPC status code, .details the server's message.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const wire = require('./wire');
const { UnaryTransport, callError, PREFIX_BYTES } = require('./unary');
const { AttendError, SessionLost, streamError } = require('./errors');
const { Session } = require('./session');

// The proto ships in the package: `npm ci` and `npm pack` copy it there
// (scripts/prepare.js), so nothing outside the package is read.
const PROTO_ROOT = path.join(__dirname, 'proto');
const SERVICE = 'attention.v1.AttentionService';
// AttendRequest's tensor fields, and AttendResponse's.
const REQUEST_TENSORS = [['queries', 2], ['keys', 3], ['values', 4]];
const RESPONSE_TENSORS = [['output', 1], ['attention_weights', 2]];
// Most requests of an AttendStream call sent and not yet answered. grpc-js
// reports a write done once its retry buffer holds it (up to 64 MiB here),
// not when it leaves, so 'drain' alone would let a long or endless iterable
// be read into memory, without yielding to I/O, before much is sent. Twice
// the answers the server keeps unwritten (32) keeps it busy.
const STREAM_WINDOW = 64;

// SessionMemory by the name session() takes.
const MEMORY = { self: 0, cross: 1 };

// Requests this large are written into a client's spare buffer (SpareBuffer);
// smaller ones come from Node's pool of small Buffers, which costs nothing.
const SPARE_MIN_BYTES = 64 << 10;
// A spare buffer larger than this is let go rather than kept.
const SPARE_MAX_BYTES = 64 << 20;

// The memory of a large request, kept by its client from one attend() call
// for the next: a fresh 1 MiB Buffer costs 10-20 times a copy into one
// already used (its pages, and the garbage collections that much new memory
// sets off). It is free again once the call has ended and Node has written
// it (node:http2 sends from the Buffer's memory as it is; a retry resends it).
class SpareBuffer {
  constructor() {
    this.memory = null;
  }

  // A Buffer of `size` bytes, the spare one when it is free and large enough.
  take(size) {
    if (size < SPARE_MIN_BYTES) return Buffer.allocUnsafe(size);
    const fits = this.memory !== null && this.memory.byteLength >= size;
    const memory = fits ? this.memory : Buffer.allocUnsafeSlow(size).buffer;
    if (fits) this.memory = null;
    return Buffer.from(memory, 0, size);
  }

  // Takes back a Buffer from take(), once nothing reads it any more.
  give(bytes) {
    const memory = bytes.buffer;
    if (bytes.length < SPARE_MIN_BYTES || memory.byteLength > SPARE_MAX_BYTES) return;
    if (this.memory === null || memory.byteLength > this.memory.byteLength) this.memory = memory;
  }
}

// An AttendRequest object as bytes: the small fields through protobufjs,
// then the tensors from their memory (protobuf lets fields come in any
// order), joined in one Buffer from take(size) after `headroom` bytes left
// for the caller (a gRPC prefix).
function encodeRequest(serialize, request, take, headroom = 0) {
  const small = { ...request };
  const parts = [];
  for (const [name, number] of REQUEST_TENSORS) {
    delete small[name];
    if (request[name] !== undefined && request[name] !== null) {
      parts.push(...wire.tensorParts(number, request[name], name));
    }
  }
  parts.unshift(serialize(small));
  const bytes = take(parts.reduce((total, part) => total + part.length, headroom));
  let offset = headroom;
  for (const part of parts) {
    bytes.set(part, offset);
    offset += part.length;
  }
  return bytes;
}

// `bytes`, holding a message after PREFIX_BYTES, with the gRPC prefix
// written there: not compressed, the message's length.
function framed(bytes) {
  bytes[0] = 0;
  bytes.writeUInt32BE(bytes.length - PREFIX_BYTES, 1);
  return bytes;
}

// The serializer of AttendRequest objects for AttendStream. What it throws
// fails the call with INTERNAL and this message (grpc-js).
function requestSerializer(serialize) {
  return (request) => encodeRequest(serialize, request, Buffer.allocUnsafe);
}

// AttendResponse (or SessionResponse: `message`) bytes as an object: the
// tensors as { shape, data: Float32Array }, every other field through
// protobufjs. What it throws fails the call with INTERNAL and this message
// (grpc-js).
function responseDeserializer(deserialize, message) {
  return (bytes) => {
    const numbers = RESPONSE_TENSORS.map(([, number]) => number);
    const [tensors, rest] = wire.splitMessage(bytes, numbers, message);
    const response = deserialize(rest);
    for (const [name, number] of RESPONSE_TENSORS) {
      if (tensors[number].length > 0) {
        response[name] = wire.decodeTensor(bytes, tensors[number], `${message}.${name}`);
      }
    }
    return response;
  };
}

// The service's methods (path, serializers), with Attend and AttendStream
// carrying the bytes above, and AttendSession the bytes session.js writes
// (SessionResponse has AttendResponse's tensor fields).
function loadMethods() {
  const definition = protoLoader.loadSync('attention/v1/attention.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // the .proto names, as in proto JSON and the conformance cases
    longs: Number, // shapes are int64; any real shape fits a JS number
    defaults: false,
  });
  const methods = { ...definition[SERVICE] };
  for (const name of ['Attend', 'AttendStream']) {
    methods[name] = {
      ...methods[name],
      encode: methods[name].requestSerialize,
      requestSerialize: requestSerializer(methods[name].requestSerialize),
      responseDeserialize: responseDeserializer(methods[name].responseDeserialize, 'AttendResponse'),
    };
  }
  methods.AttendSession = {
    ...methods.AttendSession,
    encode: methods.AttendSession.requestSerialize,
    requestSerialize: (bytes) => bytes,
    responseDeserialize: responseDeserializer(methods.AttendSession.responseDeserialize,
      'SessionResponse'),
  };
  return methods;
}

// The unary calls' options as unary.js takes them: the token as a header,
// maxAttempts within gRPC's 1..5.
function unaryOptions(options) {
  const { token, maxAttempts = 4 } = options;
  return {
    ...options,
    maxAttempts: Math.min(Math.max(maxAttempts, 1), 5),
    headers: token ? { authorization: `Bearer ${token}` } : {},
  };
}

// 'a:1,b:2' (IPv4 literals) -> 'ipv4:a:1,b:2', which one grpc-js channel
// balances (round_robin) for streams.
function channelTarget(target) {
  const entries = target.split(',').map((entry) => entry.trim());
  return entries.length > 1 ? `ipv4:${entries.join(',')}` : target;
}

class AttentionClient {
  // target: 'HOST:PORT' or a comma-separated list of IPv4 HOST:PORT.
  // options: timeoutMs (per call), token (sent as 'authorization: Bearer'),
  // rootCerts / privateKey / certChain (Buffers, PEM) or tls: true for TLS,
  // maxAttempts (1..5, unary calls only).
  constructor(target = '127.0.0.1:50051', options = {}) {
    const { timeoutMs = 30000, token, tls = false, rootCerts, privateKey, certChain } = options;
    const credentials = tls || rootCerts || certChain
      ? grpc.credentials.createSsl(rootCerts, privateKey, certChain)
      : grpc.credentials.createInsecure();
    this.methods = loadMethods();
    const StreamClient = grpc.makeGenericClientConstructor(
      { AttendStream: this.methods.AttendStream, AttendSession: this.methods.AttendSession }, SERVICE);
    // grpc-js connects only once a stream is made.
    this.stub = new StreamClient(channelTarget(target), credentials, {
      // No retry policy: gRPC replaying a stream loses or duplicates requests.
      'grpc.service_config': JSON.stringify({ loadBalancingConfig: [{ round_robin: {} }] }),
      'grpc.max_receive_message_length': -1,
      // grpc-js holds a stream's requests for a transparent retry: up to
      // 64 MiB of them (gRPC's default: 256 KiB), 256 MiB per channel.
      'grpc.per_rpc_retry_buffer_size': 64 << 20,
      'grpc.retry_buffer_size': 256 << 20,
      // grpc-js keeps HTTP/2's 64 KiB window unless told: the server then
      // sends a 1 MiB answer a window at a time, each waiting for this
      // process to grant more (BENCHMARKS.md, "Clients").
      'grpc-node.flow_control_window': 16 << 20,
    });
    this.unary = new UnaryTransport(target, unaryOptions(options));
    this.timeoutMs = timeoutMs;
    this.spare = new SpareBuffer();
    this.metadata = new grpc.Metadata();
    if (token) this.metadata.set('authorization', `Bearer ${token}`);
  }

  // One unary call of `method` with the framed request `bytes`: the answer
  // decoded. options: timeoutMs, signal; sent as UnaryTransport.call's.
  async call(method, bytes, options, sent) {
    const { timeoutMs = this.timeoutMs, signal } = options;
    const { path, responseDeserialize } = this.methods[method];
    const message = await this.unary.call(path, bytes, { deadline: Date.now() + timeoutMs, signal, sent });
    try {
      return responseDeserialize(message);
    } catch (error) {
      throw callError(grpc.status.INTERNAL, `Response message parsing error: ${error.message}`);
    }
  }

  // Resolves to the served models: [{ name, kind, num_heads, query_size, ... }].
  // options: timeoutMs (default: the client's), signal (an AbortSignal).
  async listModels(options = {}) {
    const { requestSerialize } = this.methods.ListModels;
    const message = requestSerialize({});
    const bytes = framed(Buffer.concat([Buffer.alloc(PREFIX_BYTES), message]));
    const response = await this.call('ListModels', bytes, options);
    return response.models || [];
  }

  // Resolves to the AttendResponse: { output: { shape, data }, attention_weights?, ... },
  // each data a Float32Array of its own (wire.tensorData). options: timeoutMs
  // (default: the client's), signal (an AbortSignal: aborting it rejects
  // with CANCELLED).
  async attend(request, options = {}) {
    let bytes;
    try {
      bytes = framed(encodeRequest(this.methods.Attend.encode, request, (size) => this.spare.take(size),
        PREFIX_BYTES));
    } catch (error) {
      throw callError(grpc.status.INTERNAL, `Request message serialization failure: ${error.message}`);
    }
    return this.call('Attend', bytes, options, () => this.spare.give(bytes));
  }

  // Sends every request of `requests` (an array, or any iterable or async
  // iterable of AttendRequest objects) over one AttendStream call, writing
  // while answers are read, and yields one item per request, in order: its
  // AttendResponse, or an AttendError (yielded, not thrown) for a request the
  // server refused; the stream goes on after it. options.timeoutMs is the
  // deadline of the whole stream (default: the client's); options.signal (an
  // AbortSignal) cancels it: the loop then throws CANCELLED after the items
  // already answered.
  //
  // Throws the grpc-js error when the call itself fails (UNAUTHENTICATED,
  // DEADLINE_EXCEEDED, UNAVAILABLE...), after the items already answered;
  // what `requests` threw, once the requests before it are answered; an
  // AttendError with code INTERNAL when the server answers more or fewer
  // times than it was asked. A stream is never retried (no retry policy):
  // resending is the caller's choice. Leaving the loop early cancels the call.
  async* attendStream(requests, options = {}) {
    const { timeoutMs = this.timeoutMs, signal } = options;
    if (signal?.aborted) throw callError(grpc.status.CANCELLED, 'Cancelled on client');
    const call = this.stub.AttendStream(this.metadata, { deadline: new Date(Date.now() + timeoutMs) });
    const abort = () => call.cancel();
    signal?.addEventListener('abort', abort, { once: true });
    // The reader below gets the call's error through its iterator; once it
    // has stopped, a late error (CANCELLED) must not become an uncaught one.
    call.on('error', () => {});
    let ended = false; // the call has its status, or the reader has left
    let writable = true; // false from a full write buffer until 'drain'
    let sent = 0;
    let answered = 0;
    let refused = null; // what `requests` threw
    // The writer waits on progress(); each event that may unblock it wakes it.
    let wake = () => {};
    const progress = () => new Promise((resolve) => { wake = resolve; });
    call.once('status', () => {
      ended = true;
      wake();
    });
    call.on('drain', () => {
      writable = true;
      wake();
    });

    const write = async () => {
      try {
        for await (const request of requests) {
          if (ended) return;
          sent += 1;
          writable = call.write(request);
          while (!ended && (!writable || sent - answered >= STREAM_WINDOW)) await progress();
          if (ended) return;
        }
      } catch (error) {
        refused = error;
      }
      if (!ended) call.end();
    };
    write();

    try {
      for await (const response of call) {
        if (answered >= sent) {
          throw new AttendError(grpc.status.INTERNAL,
            `AttendStream: the server sent answer ${answered + 1} with only ${sent} requests sent`);
        }
        answered += 1;
        wake();
        yield response.error ? streamError(response) : response;
      }
    } finally {
      signal?.removeEventListener('abort', abort);
      if (!ended) {
        ended = true;
        call.cancel();
        wake();
      }
    }
    if (refused !== null) throw refused;
    if (answered !== sent) {
      throw new AttendError(grpc.status.INTERNAL,
        `AttendStream: the server answered ${answered} of ${sent} requests`);
    }
  }

  // Opens a decoding session of `model` (docs/api.md section 11) over one
  // AttendSession stream; resolves to its Session, whose step(rows) sends
  // only the new rows: the server keeps the keys and values. Rejects with an
  // AttendError when the server refuses to open it (NOT_FOUND,
  // INVALID_ARGUMENT, RESOURCE_EXHAUSTED naming the limit).
  // options: memory 'self' (multi_head, dot_product: every step's rows are
  // appended and attended causally, `batch` examples side by side) or
  // 'cross' (every kind: keys, values (left out: keys) and valid_lens stay,
  // steps bring queries); scale, version; sliding_window and softcap (a
  // dot_product self session's, every step's); timeoutMs, the deadline of the
  // whole session (default: none, since it lives as long as its decoding);
  // replay (default true): when the stream breaks (UNAVAILABLE, CANCELLED:
  // its server died or shut down), open the session again through this
  // client's target, replay its rows as one prefill and resend the step
  // (session.replays counts it); the session keeps its opening and rows for
  // that, up to replayLimitBytes (default 64 MiB), past which they are
  // dropped and a later break rejects with a SessionLost saying so.
  async session(model, options = {}) {
    const {
      memory = 'self', batch, keys, values, valid_lens: validLens, scale, version,
      sliding_window: slidingWindow, softcap,
    } = options;
    if (!(memory in MEMORY)) throw new TypeError(`memory must be 'self' or 'cross'; got ${memory}`);
    const small = {
      model, memory: MEMORY[memory], batch, valid_lens: validLens, scale, version,
      sliding_window: slidingWindow, softcap,
    };
    return new Session(this, small, keys, values, options).open();
  }

  // Calls in flight finish; later ones fail with UNAVAILABLE, and no
  // connection is left open.
  close() {
    this.unary.close();
    this.stub.close();
  }
}

module.exports = { AttentionClient, AttendError, SessionLost };
