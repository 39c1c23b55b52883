"""server_trace_python_test: W3C traceparent and the JSON request log
(docs/api.md 6.10).

Against a real attention-server (127.0.0.1, port 0, --log-format json
--log-level debug), through both gRPC APIs and REST:
- a valid traceparent's trace id is the trace_id of the request's JSON log
  line, done or failed, with model, version, api, code, request_id,
  queue_ms and compute_ms as fields, and comes back in the response's
  traceparent (same trace id and flags, the server's own span id);
- without one, a new trace id in W3C form is logged and echoed, a new one
  per call;
- a malformed one (each rule of the specification broken once) is replaced
  by a new trace; a later version's header with more fields is kept;
- a call refused because the server is draining is answered with one
  HEADERS frame that ends the stream (its status and the traceparent, no
  initial metadata of its own), read off the wire with h2.

    ATTENTION_SERVER_BIN=build/server/attention-server /usr/bin/python3 tests/server/trace_python_test.py
"""

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import grpc
import h2.config
import h2.connection
import h2.events
from grpc_tools import protoc

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUBS = tempfile.TemporaryDirectory()
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{PARENT_ID}-01"
W3C = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def generate_stubs():
    proto_dir = os.path.join(SOURCE_DIR, "proto")
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    if protoc.main(["protoc", "-I", proto_dir, "-I", include, "--python_out", STUBS.name,
                    "--grpc_python_out", STUBS.name,
                    os.path.join(proto_dir, "inference", "grpc_service.proto")]) != 0:
        raise RuntimeError("protoc failed on proto/inference/grpc_service.proto")
    sys.path.insert(0, STUBS.name)


generate_stubs()
from inference import grpc_service_pb2 as ipb  # noqa: E402
from inference import grpc_service_pb2_grpc as ipb_grpc  # noqa: E402


class Server:
    def __init__(self, *flags):
        self.dir = tempfile.TemporaryDirectory()
        ports = os.path.join(self.dir.name, "ports")
        self.log_path = os.path.join(self.dir.name, "log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [os.environ["ATTENTION_SERVER_BIN"], "--address", "127.0.0.1:0",
                 "--metrics-address", "", "--http-address", "127.0.0.1:0",
                 "--port-file", ports, "--threads", "1",
                 "--log-format", "json", "--log-level", "debug", *flags],
                stdout=subprocess.DEVNULL, stderr=log)
        give_up = time.monotonic() + 60
        while not os.path.exists(ports):
            if self.process.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError(f"attention-server did not start:\n{self.log()}")
            time.sleep(0.05)
        with open(ports) as f:
            addresses = dict(line.split() for line in f.read().splitlines())
        self.address, self.http_address = addresses["grpc"], addresses["http"]
        self.channel = grpc.insecure_channel(self.address)

    def log(self):
        with open(self.log_path, encoding="utf-8") as f:
            return f.read()

    def request_line(self, request_id):
        """The JSON log line of the request `request_id` (it is written before the answer)."""
        for line in self.log().splitlines():
            entry = json.loads(line)
            if entry.get("request_id") == request_id:
                return entry
        raise AssertionError(f"no log line with request_id {request_id}:\n{self.log()}")

    def stop(self):
        self.channel.close()
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        self.dir.cleanup()
        return code


def field(number, payload):
    """A length-delimited protobuf field (payloads here are under 128 bytes)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def tensor(shape, value):
    """attention.v1.Tensor: packed shape (field 1), packed float data (field 2)."""
    count = 1
    for size in shape:
        count *= size
    return field(1, bytes(shape)) + field(2, struct.pack(f"<{count}f", *[value] * count))


def attend_request(model, request_id):
    """attention.v1.AttendRequest, serialized (the proto needs a newer protoc than
    python3-grpc-tools has, for its proto3 `optional`)."""
    return (field(1, model.encode()) + field(2, tensor([1, 2, 4], 0.5))
            + field(3, tensor([1, 3, 4], 0.25)) + field(4, tensor([1, 3, 4], 1.0))
            + field(9, request_id.encode()))


def metadata(traceparent):
    return () if traceparent is None else (("traceparent", traceparent),)


class TraceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server()
        cls.attend_call = cls.server.channel.unary_unary("/attention.v1.AttentionService/Attend")
        cls.inference = ipb_grpc.GRPCInferenceServiceStub(cls.server.channel)
        cls.calls = 0

    @classmethod
    def tearDownClass(cls):
        assert cls.server.stop() == 0

    def attend(self, traceparent, model="dot_product"):
        """Calls Attend; (its log line, the traceparent the server answered with)."""
        TraceTest.calls += 1
        request_id = f"call-{TraceTest.calls}"
        try:
            _, answer = self.attend_call.with_call(attend_request(model, request_id),
                                                   metadata=metadata(traceparent), timeout=30)
            echoed = dict(answer.initial_metadata()).get("traceparent")
            self.assertEqual(model, "dot_product", "a call to an unknown model succeeded")
        except grpc.RpcError as error:
            self.assertEqual((model, error.code()), ("no_such_model", grpc.StatusCode.NOT_FOUND))
            echoed = dict(error.initial_metadata()).get("traceparent")
        return self.server.request_line(request_id), echoed

    def test_given_traceparent_is_logged_and_echoed(self):
        line, echoed = self.attend(VALID)
        self.assertEqual(line["trace_id"], TRACE_ID)
        self.assertTrue(line["message"].startswith("request done"), line)
        self.assertEqual((line["model"], line["version"], line["api"], line["code"]),
                         ("dot_product", 1, "attention", "OK"))
        for field in ("queue_ms", "compute_ms"):
            self.assertIsInstance(line[field], (int, float), field)
            self.assertGreaterEqual(line[field], 0, field)
        self.assertIn(f"trace_id={TRACE_ID}", line["message"])
        match = W3C.match(echoed or "")
        self.assertIsNotNone(match, echoed)
        self.assertEqual(match.group(1), TRACE_ID)
        self.assertEqual(match.group(3), "01")
        self.assertNotEqual(match.group(2), PARENT_ID, "the server's span id is its own")
        self.assertEqual(match.group(2), line["span_id"])

    def test_failed_request_line_carries_the_fields(self):
        line, echoed = self.attend(VALID, model="no_such_model")
        self.assertEqual(line["level"], "warning")
        self.assertEqual((line["trace_id"], line["code"], line["model"], line["api"]),
                         (TRACE_ID, "NOT_FOUND", "no_such_model", "attention"))
        self.assertIsNone(line["version"])
        self.assertIsNone(line["compute_ms"])
        self.assertEqual(W3C.match(echoed).group(1), TRACE_ID)

    def test_inference_api_keeps_the_trace(self):
        request = ipb.ModelInferRequest(model_name="dot_product", id="infer-1")
        for name, shape in (("queries", [1, 2, 4]), ("keys", [1, 3, 4])):
            request.inputs.add(name=name, datatype="FP32", shape=shape)
            request.raw_input_contents.append(b"\x00\x00\x80\x3f" * (shape[1] * shape[2]))
        _, answer = self.inference.ModelInfer.with_call(request, metadata=metadata(VALID),
                                                         timeout=30)
        line = self.server.request_line("infer-1")
        self.assertEqual((line["trace_id"], line["api"], line["code"]),
                         (TRACE_ID, "inference", "OK"))
        self.assertEqual(W3C.match(dict(answer.initial_metadata())["traceparent"]).group(1),
                         TRACE_ID)

    def test_rest_keeps_the_trace(self):
        body = {"id": "rest-1", "inputs": [
            {"name": "queries", "datatype": "FP32", "shape": [1, 2, 4], "data": [0.5] * 8},
            {"name": "keys", "datatype": "FP32", "shape": [1, 3, 4], "data": [0.25] * 12}]}
        request = urllib.request.Request(
            f"http://{self.server.http_address}/v2/models/dot_product/infer",
            data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json", "traceparent": VALID})
        with urllib.request.urlopen(request, timeout=30) as answer:
            echoed = answer.headers["traceparent"]
        line = self.server.request_line("rest-1")
        self.assertEqual((line["trace_id"], line["api"], line["code"]), (TRACE_ID, "http", "OK"))
        self.assertEqual(W3C.match(echoed or "").group(1), TRACE_ID)

    def check_new_trace(self, traceparent):
        line, echoed = self.attend(traceparent)
        match = W3C.match(echoed or "")
        self.assertIsNotNone(match, f"{traceparent!r}: echoed {echoed!r}")
        self.assertEqual(line["trace_id"], match.group(1))
        self.assertRegex(line["trace_id"], r"^[0-9a-f]{32}$")
        self.assertNotEqual(line["trace_id"], "0" * 32)
        self.assertEqual(match.group(3), "00", "a new trace is not sampled")
        if traceparent is not None and len(traceparent) >= 35:
            self.assertNotEqual(line["trace_id"], traceparent[3:35], f"{traceparent!r} was kept")
        return line["trace_id"]

    def test_missing_traceparent_starts_a_new_trace_per_call(self):
        first = self.check_new_trace(None)
        second = self.check_new_trace(None)
        self.assertNotEqual(first, second)

    def test_malformed_traceparent_is_replaced(self):
        for malformed in [
                "",
                "garbage",
                VALID.upper(),                                  # hex must be lowercase
                VALID[:-1],                                     # too short
                VALID + "-extra",                               # version 00 has 4 fields
                VALID.replace("-", "_"),                        # separators
                f"ff-{TRACE_ID}-{PARENT_ID}-01",                # version ff is invalid
                f"00-{'0' * 32}-{PARENT_ID}-01",                # all-zero trace id
                f"00-{TRACE_ID}-{'0' * 16}-01",                 # all-zero parent id
                f"0x-{TRACE_ID}-{PARENT_ID}-01",                # version not hex
                f"00-{TRACE_ID[:-1]}g-{PARENT_ID}-01",          # trace id not hex
                f"01-{TRACE_ID}-{PARENT_ID}-01x",               # later version, no '-' after
        ]:
            with self.subTest(traceparent=malformed):
                self.check_new_trace(malformed)

    def test_later_version_with_more_fields_is_kept(self):
        line, echoed = self.attend(f"01-{TRACE_ID}-{PARENT_ID}-01-future")
        self.assertEqual(line["trace_id"], TRACE_ID)
        self.assertTrue(echoed.startswith("00-"), "the server answers in the version it speaks")


class RefusalWhileDrainingTest(unittest.TestCase):
    """Once the server stopped accepting (SIGTERM, while the gate model holds
    one call open), a new call's refusal is a single frame: a proxy in front
    relays all of it or, when the connection closes first, none of it, and
    never initial metadata without a status (docs/api.md 6.10)."""

    def setUp(self):
        self.gate_dir = tempfile.TemporaryDirectory()
        fifo = os.path.join(self.gate_dir.name, "gate")
        os.mkfifo(fifo)
        self.server = Server("--test-gate-fifo", fifo, "--warmup", "false")
        self.gate = os.open(fifo, os.O_RDWR)
        host, port = self.server.address.rsplit(":", 1)
        self.socket = socket.create_connection((host, int(port)), timeout=10)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding="utf-8"))
        self.h2.initiate_connection()
        self.socket.sendall(self.h2.data_to_send())

    def tearDown(self):
        self.socket.close()
        os.write(self.gate, b".")
        self.assertEqual(self.server.process.wait(timeout=60), 0)
        os.close(self.gate)
        self.server.channel.close()
        self.server.dir.cleanup()
        self.gate_dir.cleanup()

    def raw_attend(self, stream_id, model):
        """The HEADERS and DATA frames of stream `stream_id`'s answer, as h2 events."""
        message = attend_request(model, f"raw-{stream_id}")
        self.h2.send_headers(stream_id, [
            (":method", "POST"), (":scheme", "http"), (":authority", self.server.address),
            (":path", "/attention.v1.AttentionService/Attend"),
            ("content-type", "application/grpc"), ("te", "trailers"), ("traceparent", VALID)])
        self.h2.send_data(stream_id, b"\x00" + struct.pack(">I", len(message)) + message,
                          end_stream=True)
        self.socket.sendall(self.h2.data_to_send())
        events = []
        while not any(isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset))
                      for e in events):
            data = self.socket.recv(65536)
            self.assertTrue(data, "the server closed the connection")
            events += [e for e in self.h2.receive_data(data)
                       if getattr(e, "stream_id", None) == stream_id]
            self.socket.sendall(self.h2.data_to_send())
        return [e for e in events if isinstance(e, (h2.events.ResponseReceived,
                                                    h2.events.TrailersReceived,
                                                    h2.events.DataReceived))]

    def test_refusal_is_one_frame_with_status_and_traceparent(self):
        held = self.server.channel.unary_unary("/attention.v1.AttentionService/Attend").future(
            attend_request("gate", "held"), timeout=60)
        time.sleep(0.3)
        self.server.process.send_signal(signal.SIGTERM)
        # Calls are still computed until the signal is handled; the first
        # refusal then ends the loop.
        give_up = time.monotonic() + 30
        while True:
            frames = self.raw_attend(self.h2.get_next_available_stream_id(), "dot_product")
            statuses = [dict(f.headers).get("grpc-status") for f in frames
                        if not isinstance(f, h2.events.DataReceived)]
            if statuses[-1] != "0" or time.monotonic() > give_up:
                break
        self.assertEqual(len(frames), 1, f"one frame, not {frames}")
        (frame,) = frames
        self.assertIsInstance(frame, h2.events.ResponseReceived)
        self.assertIsNotNone(frame.stream_ended, "the frame ends the stream")
        headers = dict(frame.headers)
        self.assertEqual(headers.get("grpc-status"), "14", headers)
        self.assertIn("shutting down", headers.get("grpc-message", ""))
        self.assertEqual(W3C.match(headers.get("traceparent", "")).group(1), TRACE_ID)
        os.write(self.gate, b".")
        held.result()

if __name__ == "__main__":
    unittest.main(verbosity=2)
