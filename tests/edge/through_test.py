"""through_test: the existing Python suites, run through the edge.

Each server these suites start is started by deploy/edge/run.sh instead, and
every call goes through HAProxy to the server on loopback:

  - tests/server/inference_python_test.py: every Open Inference Protocol RPC,
    the conformance cases (raw and typed), every errors.json code, the stream
    in order with errors in place;
  - tests/client/python_test.py: attention.v1 conformance cases, masks,
    errors and their codes, streams (order, errors in place, deadline, early
    stop), and tokens with TLS (terminated at the edge: run.sh --tls-cert,
    --tls-key) and mutual TLS (--tls-client-ca);
  - tests/reliability/drain_python_test.py: SIGTERM to run.sh under
    closed-loop load, only OK and UNAVAILABLE, nothing computed lost, exit 0
    (ATTENTION_DRAIN_RUNS, default 5 here);
  - and here: a deadline and a cancellation reach the server (its metrics
    count them), the server's message cap answers RESOURCE_EXHAUSTED, and an
    interactive stream (one request, its answer, the next) is not delayed;
  - REST on the same port (the edge routes by content type): health, infer
    with the answer gRPC gives, a REST error with its HTTP status, a trace
    echoed, while gRPC calls on that port still reach the gRPC API.

    ATTENTION_SERVER_BIN=build/server/attention-server \\
        /usr/bin/python3 tests/edge/through_test.py
"""

import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import socket
import tempfile
import time
import unittest
from unittest import mock

import grpc
import h2.config
import h2.connection
import h2.events
import numpy as np

os.environ.setdefault("ATTENTION_DRAIN_RUNS", "5")
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for folder in ("edge", "server", "client", "reliability"):
    sys.path.insert(0, os.path.join(TESTS, folder))
import drain_python_test as drain  # noqa: E402
import inference_python_test as inference  # noqa: E402
import python_test as client  # noqa: E402
from launch import RUN_SH, Launch, free_port, listening, wait_for  # noqa: E402

EDGE_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca")


class EdgeServer:
    """The interface of the suites' Server classes, through the edge: TLS
    flags go to run.sh (the edge terminates TLS), the rest to the server."""

    def __init__(self, *flags):
        server_flags, run_flags = [], []
        flags = list(flags)
        while flags:
            flag = flags.pop(0)
            if flag in EDGE_FLAGS:
                run_flags += [flag, flags.pop(0)]
            else:
                server_flags.append(flag)
        self.launch = Launch("edge", ["--threads", "1", *server_flags], run_flags, metrics=True)
        self.launch.__enter__()
        self.address = self.launch.address
        self.metrics_address = self.launch.metrics_address

    metric = client.Server.metric

    def stop(self, sig=signal.SIGTERM):
        code = self.launch.terminate()
        self.launch.stop()
        return code


class InferenceThroughEdge(inference.InferencePythonTest):
    pass


class ClientThroughEdge(client.PythonClientTest):
    def test_stream_deadline_fails_the_call(self):
        # A request far longer than its 1 ms deadline (as the base test): the
        # server's refusal, relayed by HAProxy as a stream reset, can reach
        # the client before its own deadline timer fires; grpcio then reports
        # CANCELLED (seen once in a fresh-clone CI run). Either way the call
        # fails; a deadline that passes later is checked to reach the server
        # as DEADLINE_EXCEEDED by CallsReachTheServer.
        with self.assertRaises(grpc.RpcError) as error:
            list(self.client.attend_stream([dict(queries=np.ones((1, 2048, 64)))],
                                           timeout=1e-3))
        self.assertIn(error.exception.code(),
                      (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED))


class SecureThroughEdge(client.SecurePythonClientTest):
    pass


def edge_start_server(directory, flags):
    """drain_python_test's start_server, through run.sh (which gets the SIGTERM)."""
    address = f"127.0.0.1:{free_port()}"
    log = open(os.path.join(directory, "log"), "wb")
    process = subprocess.Popen(
        ["bash", RUN_SH, "--listen", address, "--", "--metrics-address", "", "--log-level",
         "debug", *flags], stdout=log, stderr=subprocess.STDOUT)
    wait_for(lambda: listening(address), "run.sh", process)
    return process, log, address


class DrainThroughEdge(unittest.TestCase):
    def test_sigterm_under_load_gives_only_ok_and_unavailable(self):
        drain.start_server = edge_start_server
        # drain's main() takes server flags from argv, which is unittest's here.
        with mock.patch.object(sys, "argv", sys.argv[:1]):
            self.assertEqual(drain.main(), 0)


class CallsReachTheServer(unittest.TestCase):
    """What the edge must not swallow: deadlines, cancellations, the server's
    own limits and its metrics."""

    @classmethod
    def setUpClass(cls):
        cls.fifo_dir = tempfile.TemporaryDirectory()
        cls.fifo = os.path.join(cls.fifo_dir.name, "gate")
        os.mkfifo(cls.fifo)
        cls.server = EdgeServer("--test-gate-fifo", cls.fifo, "--max-message-bytes", "100000")
        cls.channel = grpc.insecure_channel(cls.server.address)
        cls.stub = client.attention_client.pb2_grpc.AttentionServiceStub(cls.channel)
        cls.gate = os.open(cls.fifo, os.O_WRONLY)

    @classmethod
    def tearDownClass(cls):
        os.close(cls.gate)
        cls.channel.close()
        assert cls.server.stop() == 0
        cls.fifo_dir.cleanup()

    def request(self, model="gate", n=4):
        pb2 = client.attention_client.pb2
        return pb2.AttendRequest(model=model, queries=pb2.Tensor(
            shape=[1, n, 4], data=[0.5] * (n * 4)))

    def counted(self, code):
        return self.server.metric("attention_requests_total", code=code) or 0

    def wait_counted(self, code, at_least):
        give_up = time.monotonic() + 10
        while self.counted(code) < at_least and time.monotonic() < give_up:
            time.sleep(0.05)
        return self.counted(code)

    def test_deadline_and_cancellation_reach_the_server(self):
        # One call holds the gate model's batch; two more wait in its queue,
        # where the server drops a call whose deadline passed or whose client
        # cancelled, counting it, instead of computing it. Through an edge that
        # lost grpc-timeout or the RST_STREAM, both would be computed (OK).
        deadline_before = self.counted("DEADLINE_EXCEEDED")
        cancelled_before = self.counted("CANCELLED")
        held = self.stub.Attend.future(self.request(), timeout=30)
        time.sleep(0.3)
        start = time.monotonic()
        with self.assertRaises(grpc.RpcError) as raised:
            self.stub.Attend(self.request(), timeout=0.5)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertLess(time.monotonic() - start, 2.0)
        cancelled = self.stub.Attend.future(self.request(), timeout=30)
        time.sleep(0.3)
        cancelled.cancel()
        time.sleep(0.3)
        os.write(self.gate, b".")
        held.result()
        self.assertGreater(self.wait_counted("DEADLINE_EXCEEDED", deadline_before + 1),
                           deadline_before)
        self.assertGreater(self.wait_counted("CANCELLED", cancelled_before + 1), cancelled_before)

    def test_interactive_stream_is_not_held_back(self):
        # One request, wait for its answer, then the next: a proxy that
        # coalesces writes (waiting for full packets) delays each round trip
        # by up to 200 ms.
        pending = queue.Queue()

        def requests():
            while (request := pending.get()) is not None:
                yield request

        answers = self.stub.AttendStream(requests(), timeout=30)
        round_trips = []
        for _ in range(30):
            start = time.monotonic()
            pending.put(self.request(model="dot_product"))
            next(answers)
            round_trips.append(time.monotonic() - start)
        pending.put(None)
        self.assertLess(statistics.median(round_trips), 0.050, round_trips)

    def test_the_servers_message_cap_still_answers(self):
        with self.assertRaises(grpc.RpcError) as raised:
            self.stub.Attend(self.request(model="dot_product", n=10000), timeout=10)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.stub.Attend(self.request(model="dot_product"), timeout=10)


def h2_request(address, method, path, body=None, headers=()):
    """One request over HTTP/2 in plaintext (prior knowledge), as KServe's
    queue-proxy sends to an h2c port; (status, headers, body)."""
    connection = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    with socket.create_connection(tuple(address.rsplit(":", 1)), timeout=10) as s:
        connection.initiate_connection()
        stream = connection.get_next_available_stream_id()
        connection.send_headers(stream, [(":method", method), (":path", path),
                                         (":scheme", "http"), (":authority", address),
                                         *headers], end_stream=body is None)
        if body is not None:
            connection.send_data(stream, body, end_stream=True)
        s.sendall(connection.data_to_send())
        status, answer_headers, data, ended = None, {}, b"", False
        while not ended:
            chunk = s.recv(65536)
            if not chunk:
                raise AssertionError(f"the edge closed the connection: {status} {data!r}")
            for event in connection.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    answer_headers = dict(event.headers)
                    status = int(answer_headers[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    connection.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            s.sendall(connection.data_to_send())
        return status, answer_headers, data


class RestThroughEdge(unittest.TestCase):
    """One port, two protocols: the edge sends application/grpc* to the
    server's gRPC port and everything else to its REST port."""

    @classmethod
    def setUpClass(cls):
        cls.server = EdgeServer()
        cls.channel = grpc.insecure_channel(cls.server.address)
        cls.stub = client.attention_client.pb2_grpc.AttentionServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        assert cls.server.stop() == 0

    def test_rest_health_and_metadata(self):
        status, _, body = h2_request(self.server.address, "GET", "/v2/health/ready")
        self.assertEqual((status, json.loads(body)), (200, {"ready": True}))
        status, _, body = h2_request(self.server.address, "GET", "/v2/models/dot_product")
        self.assertEqual((status, json.loads(body)["name"]), (200, "dot_product"))

    def test_rest_infer_answers_as_grpc_does(self):
        queries = [0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 0.0, 1.0]
        keys = [float(i % 5) / 4 for i in range(12)]
        trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        request = {"inputs": [
            {"name": "queries", "datatype": "FP32", "shape": [1, 2, 4], "data": queries},
            {"name": "keys", "datatype": "FP32", "shape": [1, 3, 4], "data": keys}]}
        status, headers, body = h2_request(
            self.server.address, "POST", "/v2/models/dot_product/infer",
            json.dumps(request).encode(),
            [("content-type", "application/json"), ("traceparent", trace)])
        self.assertEqual(status, 200, body)
        self.assertTrue(headers.get("traceparent", "").startswith(trace[:36]), headers)
        output = json.loads(body)["outputs"][0]
        pb2 = client.attention_client.pb2
        alone = self.stub.Attend(pb2.AttendRequest(
            model="dot_product", queries=pb2.Tensor(shape=[1, 2, 4], data=queries),
            keys=pb2.Tensor(shape=[1, 3, 4], data=keys)), timeout=10)
        self.assertEqual(output["shape"], list(alone.output.shape))
        np.testing.assert_allclose(output["data"], alone.output.data, atol=1e-5)

    def test_rest_errors_keep_their_http_status(self):
        status, headers, body = h2_request(self.server.address, "GET", "/v2/models/no_such_model")
        self.assertEqual(status, 404, body)
        self.assertEqual(headers.get("content-type"), "application/json")
        self.assertIn("no_such_model", json.loads(body)["error"])


inference.Server = lambda: EdgeServer(
    "--model-repository", os.path.join(inference.CONFORMANCE, "models"), "--strict")
client.Server = EdgeServer

if __name__ == "__main__":
    unittest.main(verbosity=2)
