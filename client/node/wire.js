// wire.js: the protobuf wire form of attention.v1 tensors, written from and
// read into Float32Array memory, so no JavaScript number per value is made.
//
// Tensor.data is `repeated float` in proto3, so packed: on the wire one tag,
// a varint byte length, then the float32 values, little-endian. That is the
// byte form itself: a request carries a Float32Array's bytes as they are, and
// an answer's values are a view on the received bytes, or one copy of them
// (tensorData). The small fields of a message go through
// @grpc/proto-loader's (protobufjs) encoding (attention_client.js).
//
// Decoding follows the protobuf spec where a parser must be lenient: a
// repeated scalar may come packed or not, and a message field that appears
// more than once is merged (its repeated fields concatenated).
'use strict';

const os = require('os');

const VARINT = 0;
const I64 = 1;
const LEN = 2;
const I32 = 5;
// Float32Array uses the host's byte order; the wire's is little-endian.
const LITTLE_ENDIAN_HOST = os.endianness() === 'LE';

// An int64 as varint bytes; negatives take ten bytes (two's complement).
function varint(value) {
  const bytes = [];
  if (value >= 0 && value <= Number.MAX_SAFE_INTEGER) {
    let v = value;
    while (v > 0x7f) {
      bytes.push((v % 0x80) | 0x80);
      v = Math.floor(v / 0x80);
    }
    bytes.push(v);
    return bytes;
  }
  let v = BigInt.asUintN(64, BigInt(value));
  while (v > 0x7fn) {
    bytes.push(Number(v & 0x7fn) | 0x80);
    v >>= 7n;
  }
  bytes.push(Number(v));
  return bytes;
}

// [value, next position] of the varint at buf[pos], before `end`. Values past
// 2^53 lose precision, as Number int64s do (proto-loader's `longs: Number`).
function readVarint(buf, pos, end, what) {
  let value = 0n;
  for (let shift = 0n; shift < 70n; shift += 7n) {
    if (pos >= end) throw new Error(`${what}: the bytes end inside a varint`);
    const byte = buf[pos];
    pos += 1;
    value |= BigInt(byte & 0x7f) << shift;
    if (byte < 0x80) return [Number(BigInt.asIntN(64, value)), pos];
  }
  throw new Error(`${what}: a varint longer than 10 bytes`);
}

// Calls visit(number, wireType, start, stop, fieldStart) for each field of
// the message in buf[pos:end]: start:stop is a LEN field's payload or a
// fixed-size value's bytes; for a varint, start is its value.
function forEachField(buf, pos, end, what, visit) {
  while (pos < end) {
    const fieldStart = pos;
    let key;
    [key, pos] = readVarint(buf, pos, end, what);
    const number = Math.floor(key / 8);
    const wireType = key % 8;
    if (number <= 0) throw new Error(`${what}: field number ${number} at byte ${fieldStart}`);
    if (wireType === VARINT) {
      let value;
      [value, pos] = readVarint(buf, pos, end, what);
      visit(number, wireType, value, pos, fieldStart);
      continue;
    }
    let stop;
    if (wireType === LEN) {
      let size;
      [size, pos] = readVarint(buf, pos, end, what);
      stop = pos + size;
    } else if (wireType === I64 || wireType === I32) {
      stop = pos + (wireType === I64 ? 8 : 4);
    } else {
      throw new Error(`${what}: field ${number} has wire type ${wireType} (groups are not part of proto3)`);
    }
    if (stop > end) {
      throw new Error(`${what}: field ${number} needs ${stop - pos} bytes; ${end - pos} are left`);
    }
    visit(number, wireType, pos, stop, fieldStart);
    pos = stop;
  }
}

// The float32 values of `data` as little-endian bytes: the Float32Array's own
// memory when it is one (on a little-endian host), else one conversion (an
// Array of numbers, as messages were written before).
function floatBytes(data, what) {
  if (data === undefined || data === null) return Buffer.alloc(0);
  if (typeof data !== 'object' || typeof data.length !== 'number') {
    throw new TypeError(`${what}.data: expected a Float32Array or an array of numbers, got ${typeof data}`);
  }
  const floats = data instanceof Float32Array ? data : Float32Array.from(data);
  if (LITTLE_ENDIAN_HOST) return Buffer.from(floats.buffer, floats.byteOffset, floats.byteLength);
  const bytes = Buffer.alloc(floats.length * 4);
  floats.forEach((value, i) => bytes.writeFloatLE(value, i * 4));
  return bytes;
}

// The parts of message field `number` holding `tensor` ({ shape, data }) as
// an attention.v1.Tensor, to concatenate; the last one is the data's memory.
function tensorParts(number, tensor, what) {
  const shape = [];
  (tensor.shape || []).forEach((size, i) => {
    if (!Number.isInteger(Number(size))) {
      throw new TypeError(`${what}.shape[${i}]: expected an integer, got ${size}`);
    }
    shape.push(...varint(Number(size)));
  });
  const data = floatBytes(tensor.data, what);
  const head = [];
  if (shape.length > 0) head.push(0x0a, ...varint(shape.length), ...shape); // 1: shape, packed
  if (data.length > 0) head.push(0x12, ...varint(data.length)); // 2: data, packed; proto3 writes no empty one
  return [Buffer.from([(number << 3) | LEN, ...varint(head.length + data.length), ...head]), data];
}

// Splits the message in `buf` into the payload ranges of the LEN fields in
// `wanted` ({ number: [[start, stop], ...] }, every occurrence, in order) and
// the bytes of all other fields, joined.
function splitMessage(buf, wanted, what) {
  const found = Object.fromEntries(wanted.map((number) => [number, []]));
  const rest = [];
  forEachField(buf, 0, buf.length, what, (number, wireType, start, stop, fieldStart) => {
    if (number in found && wireType === LEN) found[number].push([start, stop]);
    else rest.push(buf.subarray(fieldStart, stop));
  });
  return [found, Buffer.concat(rest)];
}

// The Tensor whose occurrences are buf[start:stop] for [start, stop] of
// `ranges` (merged), as { shape: number[], data: Float32Array } (tensorData).
function decodeTensor(buf, ranges, what) {
  const shape = [];
  const runs = [];
  for (const [begin, finish] of ranges) {
    forEachField(buf, begin, finish, what, (number, wireType, start, stop) => {
      if (number === 1 && wireType === VARINT) {
        shape.push(start);
      } else if (number === 1 && wireType === LEN) {
        for (let pos = start; pos < stop;) {
          let size;
          [size, pos] = readVarint(buf, pos, stop, `${what}.shape`);
          shape.push(size);
        }
      } else if (number === 2 && (wireType === LEN || wireType === I32)) {
        if ((stop - start) % 4 !== 0) {
          throw new Error(`${what}.data: ${stop - start} bytes of packed float32, not a multiple of 4`);
        }
        runs.push([start, stop]);
      }
    });
  }
  const data = tensorData(buf, runs);
  if (shape.some((size) => size < 0)) throw new Error(`${what}: shape [${shape}] has a negative size`);
  const needed = shape.reduce((product, size) => product * size, 1);
  if (needed !== data.length) {
    throw new Error(`${what}: shape [${shape}] needs ${needed} float32 values; ${data.length} came`);
  }
  return { shape, data };
}

// Whether buf's memory holds nothing but this message, past at most the
// 5-byte gRPC frame header grpc-js reads a stream's answers into: true of
// every message of 4 KiB or more (grpc-js 1.14 joins each one into a Buffer
// of its own, as its gzip and deflate paths do; unary.js reads one into a
// Buffer of its own), never of Node's pooled small Buffers.
function ownsMemory(buf) {
  return buf.buffer.byteLength - buf.length <= 5 && buf.byteOffset + buf.length === buf.buffer.byteLength;
}

// The float32 values of the runs buf[start:stop] of `runs`, joined. One run
// of a message that owns its memory is a view on it, moved back 1-3 bytes
// first when misaligned (Float32Array needs 4-byte alignment): a move within
// memory already touched costs a fraction of a fresh Buffer's pages and
// garbage collection, which made up most of a large call's CPU
// (BENCHMARKS.md, "Clients"). The bytes it overwrites are the run's own tag
// and length, or of its tensor field, already parsed: at least 3 such bytes
// precede any run. Else the values are copied into memory of their own.
function tensorData(buf, runs) {
  if (LITTLE_ENDIAN_HOST && runs.length === 1 && ownsMemory(buf)) {
    const [start, stop] = runs[0];
    const from = buf.byteOffset + start;
    const to = from - (from % 4);
    if (to !== from) new Uint8Array(buf.buffer).copyWithin(to, from, from + stop - start);
    return new Float32Array(buf.buffer, to, (stop - start) / 4);
  }
  const bytes = runs.reduce((total, [start, stop]) => total + stop - start, 0);
  const data = new Float32Array(bytes / 4);
  const target = new Uint8Array(data.buffer);
  let offset = 0;
  for (const [start, stop] of runs) {
    target.set(buf.subarray(start, stop), offset);
    offset += stop - start;
  }
  if (!LITTLE_ENDIAN_HOST) {
    const view = new DataView(data.buffer);
    data.forEach((_, i) => { data[i] = view.getFloat32(i * 4, true); });
  }
  return data;
}

module.exports = { LEN, VARINT, I32, varint, forEachField, tensorParts, splitMessage, decodeTensor };
