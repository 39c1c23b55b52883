// node_wire_test.js: the Node client's own protobuf encoding (client/node's
// wire.js and serializers, no server). Requests it writes from Float32Array
// memory decode, with protobufjs, to the message protobufjs would encode
// from the same object, every AttendRequest field included (positions,
// window, soft-cap, 4-D tensors), and a session step with its own keys and
// values; answers it reads give the values protobufjs encoded, in every form
// a protobuf encoder may use (packed or not, runs split, a message field repeated and merged,
// unknown fields); a large answer's data are a view on the received bytes
// whatever their alignment, a small or shared one's a copy; a malformed
// answer throws an error naming the field.
// Run by tests/client/node_test.sh:
//
//   node tests/client/node_wire_test.js
'use strict';

const assert = require('node:assert/strict');
const path = require('node:path');
const { test } = require('node:test');

const NODE_DIR = path.join(__dirname, '..', '..', 'client', 'node');
const protobuf = require(path.join(NODE_DIR, 'node_modules', 'protobufjs'));
const wire = require(path.join(NODE_DIR, 'wire.js'));
const { AttentionClient } = require(path.join(NODE_DIR, 'attention_client.js'));
const { stepRequest } = require(path.join(NODE_DIR, 'session.js'));

// keepCase: the .proto names, as the client's messages use them.
const root = new protobuf.Root().loadSync(path.join(NODE_DIR, 'proto', 'attention', 'v1', 'attention.proto'),
  { keepCase: true });
const AttendRequest = root.lookupType('attention.v1.AttendRequest');
const AttendResponse = root.lookupType('attention.v1.AttendResponse');
const TO_OBJECT = { longs: Number, arrays: true };
// The client's serializers: AttendStream's requests (attend's are the same
// bytes behind a gRPC prefix), and every AttendResponse.
const client = new AttentionClient('127.0.0.1:1');
const { requestSerialize, responseDeserialize } = client.methods.Attend;
client.close();

const field = (number, wireType, payload) => Buffer.concat([
  Buffer.from(wire.varint(number * 8 + wireType)),
  wireType === wire.VARINT ? Buffer.from(wire.varint(payload))
    : wireType === wire.LEN ? Buffer.concat([Buffer.from(wire.varint(payload.length)), payload]) : payload,
]);
const floats = (values) => Buffer.from(Float32Array.from(values).buffer);
const tensor = (shape, values) => Buffer.concat([
  field(1, wire.LEN, Buffer.from(shape.flatMap((size) => wire.varint(size)))), field(2, wire.LEN, floats(values))]);
// A message as grpc-js hands an AttendStream answer to a deserializer: in
// memory of its own, behind the 5-byte gRPC frame header (unary.js's have
// no header before them).
const received = (message) => {
  const framed = Buffer.allocUnsafeSlow(message.length + 5);
  message.copy(framed, 5);
  return framed.subarray(5);
};
const ramp = (count, step) => Array.from({ length: count }, (_, i) => i * step - 1000);

test('requests decode to what protobufjs encodes, every field', () => {
  const request = {
    model: 'm', causal: true, return_attention_weights: true, scale: 0, request_id: 'r-\u00e9', version: 0,
    queries: { shape: [2, 1, 3], data: Float32Array.from([1, 2, 3, 4, 5, 6.5]) },
    keys: { shape: [2, 1, 3], data: [0.25, -1, 3, 1e-8, 7, 8] },
    values: { shape: [-1, 100000, 100000], data: [1] }, // sent as given; the server refuses it
    valid_lens: [1, 2],
  };
  const ours = AttendRequest.toObject(AttendRequest.decode(requestSerialize(request)), TO_OBJECT);
  const reference = AttendRequest.toObject(AttendRequest.decode(AttendRequest.encode(
    AttendRequest.fromObject({ ...request, queries: { ...request.queries, data: Array.from(request.queries.data) } }),
  ).finish()), TO_OBJECT);
  assert.deepEqual(ours, reference);
  assert.equal(ours.scale, 0); // present: proto3 `optional`
  assert.equal(ours.version, 0);
  const selfAttention = AttendRequest.decode(requestSerialize({ queries: { shape: [1, 1, 1], data: [1] } }));
  assert.equal(selfAttention.keys, null);
});

test('positions, window, soft-cap and 4-D tensors decode to what protobufjs encodes', () => {
  const request = {
    model: 'llama', position_ids: [7, 2 ** 40, 0], sliding_window: 0, softcap: 30,
    queries: { shape: [1, 3, 4, 2], data: Float32Array.from(ramp(24, 0.5)) },
    keys: { shape: [1, 3, 2, 2], data: ramp(12, 0.25) },
  };
  const ours = AttendRequest.toObject(AttendRequest.decode(requestSerialize(request)), TO_OBJECT);
  const reference = AttendRequest.toObject(AttendRequest.decode(AttendRequest.encode(
    AttendRequest.fromObject({ ...request, queries: { ...request.queries, data: Array.from(request.queries.data) } }),
  ).finish()), TO_OBJECT);
  assert.deepEqual(ours, reference);
  assert.deepEqual(ours.position_ids, [7, 2 ** 40, 0]);
  assert.deepEqual(ours.queries.shape, [1, 3, 4, 2]);
  assert.equal(ours.sliding_window, 0); // present: proto3 `optional`
  assert.equal(ours.softcap, 30);
  const plain = AttendRequest.decode(requestSerialize({ queries: { shape: [1, 1, 1], data: [1] } }));
  assert.equal(Object.prototype.hasOwnProperty.call(plain, 'sliding_window'), false);
});

test('a session step carries its own keys and values only when given', () => {
  const SessionRequest = root.lookupType('attention.v1.SessionRequest');
  const rows = { shape: [1, 1, 4, 2], data: Float32Array.from(ramp(8, 1)) };
  const keys = { shape: [1, 1, 2, 2], data: ramp(4, 2) };
  const values = { shape: [1, 1, 2, 3], data: ramp(6, 3) };
  const step = SessionRequest.toObject(SessionRequest.decode(stepRequest(rows, true, keys, values)),
    TO_OBJECT).step;
  assert.deepEqual(step.queries.shape, [1, 1, 4, 2]);
  assert.deepEqual(step.keys.shape, [1, 1, 2, 2]);
  assert.deepEqual(step.keys.data, keys.data.map((v) => Math.fround(v)));
  assert.deepEqual(step.values.shape, [1, 1, 2, 3]);
  assert.equal(step.return_attention_weights, true);
  const alone = SessionRequest.decode(stepRequest(rows, false)).step;
  assert.equal(alone.keys, null);
  assert.equal(alone.values, null);
});

test('answers in every encoding', () => {
  const values = [1.5, -2, 3, 4, 5, 6];
  const encoded = Buffer.from(AttendResponse.encode(AttendResponse.fromObject({
    output: { shape: [1, 2, 3], data: values }, attention_weights: { shape: [1, 2, 1], data: [0.5, 1] },
    request_id: 'r1', model_version: 3,
  })).finish());
  const shape = Buffer.concat([1, 2, 3].map((s) => field(1, wire.VARINT, s)));
  const unpacked = Buffer.concat([shape, ...values.map((v) => field(2, wire.I32, floats([v])))]);
  const split = Buffer.concat([shape, field(2, wire.LEN, floats(values.slice(0, 1))),
    field(2, wire.LEN, floats(values.slice(1)))]);
  const merged = Buffer.concat([field(1, wire.LEN, shape), field(1, wire.LEN, field(2, wire.LEN, floats(values)))]);
  const unknown = Buffer.concat([field(99, wire.VARINT, 7), field(100, wire.LEN, Buffer.from('xyz'))]);
  const full = responseDeserialize(encoded);
  assert.deepEqual(full.attention_weights.shape, [1, 2, 1]);
  assert.deepEqual(Array.from(full.attention_weights.data), [0.5, 1]);
  assert.equal(full.request_id, 'r1');
  assert.equal(full.model_version, 3);
  for (const bytes of [encoded, field(1, wire.LEN, unpacked), field(1, wire.LEN, split), merged,
    Buffer.concat([unknown, field(1, wire.LEN, split), unknown])]) {
    const response = responseDeserialize(bytes);
    assert.ok(response.output.data instanceof Float32Array);
    assert.deepEqual(response.output.shape, [1, 2, 3]);
    assert.deepEqual(Array.from(response.output.data), values);
  }
  const error = responseDeserialize(Buffer.from(AttendResponse.encode(AttendResponse.fromObject({
    error: { code: -1, message: 'odd' }, request_id: 'r2',
  })).finish()));
  assert.deepEqual([error.error.code, error.error.message, error.output], [-1, 'odd', undefined]);
});

test('malformed answers name the field', () => {
  const good = Buffer.from(AttendResponse.encode(AttendResponse.fromObject({
    output: { shape: [2, 3], data: [1, 2, 3, 4, 5, 6] } })).finish());
  assert.throws(() => responseDeserialize(good.subarray(0, good.length - 3)),
    /^Error: AttendResponse: field 1 needs \d+ bytes; \d+ are left$/);
  assert.throws(() => responseDeserialize(Buffer.from([0x0b])), /AttendResponse: field 1 has wire type 3/);
  assert.throws(() => responseDeserialize(field(1, wire.LEN, field(2, wire.LEN, Buffer.from('12345')))),
    /AttendResponse\.output\.data: 5 bytes of packed float32, not a multiple of 4/);
  const short = Buffer.from(AttendResponse.encode(AttendResponse.fromObject({
    output: { shape: [2, 3, 4], data: new Array(23).fill(1) } })).finish());
  assert.throws(() => responseDeserialize(short),
    /AttendResponse\.output: shape \[2,3,4\] needs 24 float32 values; 23 came/);
});

test('large answers are views on the received bytes, at every alignment', () => {
  const output = ramp(4096, 0.5);
  const weights = ramp(2048, 0.25);
  const misalignments = new Set();
  for (let pad = 0; pad < 4; pad += 1) {
    // An unknown field first shifts the tensors; the weights come before the
    // output, so the output's move must leave their bytes as they were.
    const message = Buffer.concat([field(99, wire.LEN, Buffer.alloc(pad, 7)),
      field(2, wire.LEN, tensor([1, 32, 64], weights)), field(1, wire.LEN, tensor([1, 64, 64], output)),
      field(3, wire.LEN, Buffer.from('after'))]);
    misalignments.add((5 + message.indexOf(floats(output))) % 4);
    const bytes = received(message);
    const response = responseDeserialize(bytes);
    assert.equal(response.output.data.buffer, bytes.buffer);
    assert.equal(response.attention_weights.data.buffer, bytes.buffer);
    assert.deepEqual(response.output.shape, [1, 64, 64]);
    assert.deepEqual(Array.from(response.output.data), output);
    assert.deepEqual(response.attention_weights.shape, [1, 32, 64]);
    assert.deepEqual(Array.from(response.attention_weights.data), weights);
    assert.equal(response.request_id, 'after');
  }
  assert.deepEqual([...misalignments].sort(), [0, 1, 2, 3]);
});

test('answers in memory shared with other bytes, or in several runs, are copied', () => {
  const output = ramp(4096, 0.5);
  const message = field(1, wire.LEN, tensor([1, 64, 64], output));
  const small = Buffer.from(field(1, wire.LEN, tensor([1, 2, 2], [1, 2, 3, 4])));
  const inside = Buffer.concat([Buffer.alloc(3), message, Buffer.alloc(8)]);
  const split = received(field(1, wire.LEN, Buffer.concat([field(1, wire.LEN, Buffer.from([1, 64, 64])),
    field(2, wire.LEN, floats(output.slice(0, 1001))), field(2, wire.LEN, floats(output.slice(1001)))])));
  const before = Buffer.from(inside);
  const copies = [responseDeserialize(small), responseDeserialize(inside.subarray(3, 3 + message.length)),
    responseDeserialize(split)];
  assert.deepEqual(inside, before);
  assert.deepEqual(Array.from(copies[0].output.data), [1, 2, 3, 4]);
  for (const response of copies.slice(1)) assert.deepEqual(Array.from(response.output.data), output);
  for (const [response, bytes] of [[copies[0], small], [copies[1], inside], [copies[2], split]]) {
    assert.notEqual(response.output.data.buffer, bytes.buffer);
  }
});
