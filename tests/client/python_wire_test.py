"""python_wire_test: the Python client's own protobuf encoding (the package's
wire.py, no server). Requests it writes from numpy memory parse, with the
generated classes, to exactly the message those classes would build from
Python lists, for every AttendRequest field, odd dtypes and layouts included;
a lone Tensor is byte-identical. Answers it reads give the values the
generated classes hold, in every form a protobuf encoder may use (packed or
not, runs split, a message field repeated and merged, unknown fields), and a
malformed answer is an INTERNAL error naming the field.

Run with the Python of a virtual environment the package is installed in
(tests/client/python_install.sh):

    build/tests/python-client-venv/bin/python tests/client/python_wire_test.py
"""

import struct
import unittest

import grpc
import numpy as np

import attention_client
from attention_client import client, pb2, wire


def slow_tensor(array):
    """What the generated classes build from a Python list: the reference."""
    array = np.asarray(array, dtype=np.float32)
    return pb2.Tensor(shape=list(array.shape), data=array.ravel().tolist())


def slow_request(queries, keys=None, values=None, *, model="dot_product", valid_lens=None,
                 scale=None, version=None, position_ids=None, **scalars):
    request = pb2.AttendRequest(model=model, queries=slow_tensor(queries), **scalars)
    if keys is not None:
        request.keys.CopyFrom(slow_tensor(keys))
    if values is not None:
        request.values.CopyFrom(slow_tensor(values))
    if valid_lens is not None:
        request.valid_lens.extend(int(v) for v in np.asarray(valid_lens).ravel())
    if scale is not None:
        request.scale = scale
    if version is not None:
        request.version = version
    if position_ids is not None:
        request.position_ids.extend(int(v) for v in np.asarray(position_ids).ravel())
    return request


def field(number, wire_type, payload):
    """One hand-encoded field: a varint int, or the bytes of a LEN/I32 field."""
    key = wire.varint(number << 3 | wire_type)
    if wire_type == wire.VARINT:
        return key + wire.varint(payload)
    if wire_type == wire.LEN:
        return key + wire.varint(len(payload)) + payload
    return key + payload


class RequestEncodingTest(unittest.TestCase):
    rng = np.random.default_rng(23)

    def check(self, *arrays, **arguments):
        encoded = client._request_bytes(*arrays, **arguments)
        parsed = pb2.AttendRequest.FromString(encoded)
        self.assertEqual(parsed, slow_request(*arrays, **arguments))
        return parsed

    def test_every_field(self):
        q = self.rng.normal(size=(2, 3, 4))
        k = self.rng.normal(size=(2, 5, 4))
        v = self.rng.normal(size=(2, 5, 6))
        parsed = self.check(q, k, v, model="additive_toy", valid_lens=[[1, 2, 3], [4, 5, 0]],
                            causal=True, scale=0.25, return_attention_weights=True,
                            request_id="r-\u00e9", version=3)
        self.assertEqual(list(parsed.valid_lens), [1, 2, 3, 4, 5, 0])
        self.assertEqual((parsed.scale, parsed.version), (0.25, 3))

    def test_positions_window_and_softcap(self):
        q = self.rng.normal(size=(2, 3, 4))
        parsed = self.check(q, position_ids=np.array([[7, 8, 9], [2 ** 40, 0, 1]]),
                            sliding_window=4, softcap=30.0)
        self.assertEqual(list(parsed.position_ids), [7, 8, 9, 2 ** 40, 0, 1])
        self.assertEqual((parsed.sliding_window, parsed.softcap), (4, 30.0))
        # 0 is a value, not absence.
        parsed = self.check(q, position_ids=[0, 1, 2], sliding_window=0, softcap=0.0)
        self.assertTrue(parsed.HasField("sliding_window"))
        self.assertTrue(parsed.HasField("softcap"))
        parsed = self.check(q)
        self.assertFalse(parsed.HasField("sliding_window"))
        self.assertFalse(parsed.HasField("softcap"))
        self.assertEqual(list(parsed.position_ids), [])

    def test_tensors_of_any_rank(self):
        # dot_product's grouped heads are 4-D; the server judges ranks.
        q = self.rng.normal(size=(1, 3, 4, 2))
        k = self.rng.normal(size=(1, 5, 2, 2))
        parsed = self.check(q, k, k)
        self.assertEqual(list(parsed.queries.shape), [1, 3, 4, 2])
        self.assertEqual(list(parsed.keys.shape), [1, 5, 2, 2])
        self.check(np.ones((2, 2)))

    def test_presence_of_optional_fields_and_tensors(self):
        # scale 0 and version 0 are values, not absence; keys and values
        # left out are absent messages (self-attention), never empty ones.
        parsed = self.check(np.ones((1, 2, 2)), scale=0.0, version=0)
        self.assertTrue(parsed.HasField("scale"))
        self.assertTrue(parsed.HasField("version"))
        self.assertFalse(parsed.HasField("keys"))
        self.assertFalse(parsed.HasField("values"))
        parsed = self.check(np.ones((1, 2, 2)))
        self.assertFalse(parsed.HasField("scale"))
        self.assertFalse(parsed.HasField("version"))

    def test_any_dtype_and_layout_becomes_little_endian_float32(self):
        base = self.rng.normal(size=(3, 4, 5))
        for name, array in (("float64", base), ("float16", base.astype(np.float16)),
                            ("int32", np.arange(60, dtype=np.int32).reshape(3, 4, 5)),
                            ("big-endian", base.astype(">f4")),
                            ("transposed", base.transpose(2, 1, 0)),
                            ("strided", base[:, ::2, 1:]),
                            ("Fortran", np.asfortranarray(base.astype(np.float32))),
                            ("nested list", base.tolist())):
            with self.subTest(input=name):
                self.check(array)

    def test_sizes_that_need_long_varints(self):
        # 4 * 40000 bytes: a three-byte length inside a three-byte length.
        self.check(self.rng.normal(size=(1, 40000, 1)).astype(np.float32))

    def test_empty_tensor_writes_no_data_field(self):
        array = np.zeros((1, 0, 3), dtype=np.float32)
        self.check(np.ones((1, 1, 3)), array, array)

    def test_lone_tensor_is_byte_identical(self):
        for shape in ((1, 1, 1), (2, 3, 4), (1, 300, 7), (1, 0, 2)):
            array = self.rng.normal(size=shape).astype(np.float32)
            with self.subTest(shape=shape):
                self.assertEqual(attention_client.to_tensor(array).SerializeToString(),
                                 slow_tensor(array).SerializeToString())
                np.testing.assert_array_equal(
                    attention_client.from_tensor(slow_tensor(array)), array)

    def test_bad_input_names_the_tensor(self):
        with self.assertRaisesRegex(ValueError, r"keys must be an array .* got a scalar"):
            client._request_bytes(np.ones((1, 1, 2)), np.float32(4))
        with self.assertRaisesRegex(ValueError, r"position_ids must be integers; got dtype float"):
            client._request_bytes(np.ones((1, 1, 2)), position_ids=[0.5])
        with self.assertRaisesRegex(ValueError, r"queries is required"):
            client._request_bytes(None)
        with self.assertRaisesRegex(ValueError, r"[Vv]alue out of range"):
            client._request_bytes(np.ones((1, 1, 2)), valid_lens=[2 ** 40])


class ResponseDecodingTest(unittest.TestCase):
    output = np.arange(24, dtype=np.float32).reshape(2, 3, 4) / 7
    weights = np.linspace(0, 1, 30, dtype=np.float32).reshape(2, 3, 5)

    def decode(self, data):
        return client._answer(data)

    def test_what_the_generated_classes_write(self):
        response = pb2.AttendResponse(output=slow_tensor(self.output),
                                      attention_weights=slow_tensor(self.weights),
                                      request_id="r1", model="m", model_version=4)
        result = self.decode(response.SerializeToString())
        self.assertIsInstance(result, attention_client.AttendResult)
        for actual, expected in zip(result, (self.output, self.weights)):
            self.assertEqual(actual.dtype, np.float32)
            np.testing.assert_array_equal(actual, expected)
            self.assertFalse(actual.flags.writeable)  # a view of the received bytes
        no_weights = pb2.AttendResponse(output=slow_tensor(self.output))
        self.assertIsNone(self.decode(no_weights.SerializeToString()).attention_weights)

    def test_unpacked_split_and_merged_encodings(self):
        values = self.output.ravel()
        shape = b"".join(field(1, wire.VARINT, size) for size in self.output.shape)
        unpacked = shape + b"".join(field(2, wire.I32, struct.pack("<f", x)) for x in values)
        split = (field(1, wire.LEN, b"".join(wire.varint(s) for s in self.output.shape))
                 + field(2, wire.LEN, values[:5].tobytes())
                 + field(2, wire.LEN, values[5:].tobytes()))
        # An embedded message that appears twice is merged: shape from the
        # first occurrence, data from the second.
        merged = (field(1, wire.LEN, shape)
                  + field(1, wire.LEN, field(2, wire.LEN, values.tobytes())))
        unknown = (field(99, wire.VARINT, 7) + field(100, wire.LEN, b"xyz")
                   + field(101, wire.I32, b"abcd"))
        for name, encoded in (("unpacked", field(1, wire.LEN, unpacked)),
                              ("split runs", field(1, wire.LEN, split)),
                              ("merged", merged),
                              ("unknown fields", unknown + field(1, wire.LEN, split) + unknown)):
            with self.subTest(encoding=name):
                result = self.decode(encoded)
                np.testing.assert_array_equal(result.output, self.output)
                self.assertIsNone(result.attention_weights)

    def test_error_answers(self):
        for code, status, text in ((5, grpc.StatusCode.NOT_FOUND, "no model"),
                                   (0, grpc.StatusCode.UNKNOWN, "error code 0"),
                                   (-1, grpc.StatusCode.UNKNOWN, "error code -1"),
                                   (99, grpc.StatusCode.UNKNOWN, "error code 99")):
            response = pb2.AttendResponse(request_id="r7", model="m")
            response.error.code = code
            response.error.message = "no model"
            with self.subTest(code=code):
                error = self.decode(response.SerializeToString())
                self.assertIsInstance(error, attention_client.AttendError)
                self.assertEqual(error.code(), status)
                self.assertIn(text, error.details())
                self.assertEqual(error.request_id, "r7")

    def assert_malformed(self, data, pattern):
        with self.assertRaises(attention_client.AttendError) as raised:
            self.decode(data)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INTERNAL)
        self.assertRegex(raised.exception.details(), pattern)

    def test_malformed_answers_name_the_field(self):
        good = pb2.AttendResponse(output=slow_tensor(self.output)).SerializeToString()
        self.assert_malformed(good[:-3], r"AttendResponse: field 1 needs \d+ bytes; \d+ are left")
        self.assert_malformed(good[:1], r"AttendResponse: the bytes end inside a varint")
        self.assert_malformed(b"\x0b", r"AttendResponse: field 1 has wire type 3")
        odd_bytes = field(1, wire.VARINT, 2) + field(2, wire.LEN, b"12345")
        self.assert_malformed(field(1, wire.LEN, odd_bytes),
                              r"AttendResponse\.output\.data: 5 bytes of packed float32, "
                              r"not a multiple of 4")
        short = pb2.AttendResponse(output=pb2.Tensor(shape=[2, 3, 4], data=[1.0] * 23))
        self.assert_malformed(short.SerializeToString(),
                              r"AttendResponse\.output: shape \[2, 3, 4\] needs 24 float32 "
                              r"values; 23 came")
        negative = pb2.AttendResponse(output=pb2.Tensor(shape=[-1, 2], data=[1.0, 2.0]))
        self.assert_malformed(negative.SerializeToString(),
                              r"AttendResponse\.output: shape \[-1, 2\] has a negative size")
        # A small field's own bytes broken: the generated class's error, named.
        self.assert_malformed(field(5, wire.LEN, field(2, wire.LEN, b"\xff\xfe")),
                              r"not a valid AttendResponse: .*")
        self.assert_malformed(pb2.AttendResponse(request_id="x").SerializeToString(),
                              r"AttendResponse\.output: absent, in an answer without error")


if __name__ == "__main__":
    unittest.main(verbosity=2)
