"""python_test: the Python client (the attention-client package) against a
real attention-server: conformance cases through the numpy-in, numpy-out
call, errors as grpc.RpcError with the server's code, attend_stream (answers
in order, equal to attend's, a refused request's error in place), the
heatmap example writing a valid PNG, the layer cases with their
position_ids and ListModels' grouped heads and rotary, and dot_product over
grouped heads with a window and a soft-cap (attend, and session steps with
their own keys and values). Against a scripted service in this process (the
real server cannot fail a stream on demand): a stream is never retried, odd
error codes, answer counts that do not match the requests. Against a bare
HTTP/2 service: answers cut off before their status are sent
again.

Run with the Python of a virtual environment the package is installed in
(tests/client/python_install.sh):

    ATTENTION_SERVER_BIN=build/server/attention-server \
        build/tests/python-client-venv/bin/python tests/client/python_test.py
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
import threading
import time
import unittest
import urllib.request
from concurrent import futures

import attention_client
import grpc
import numpy as np

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFORMANCE = os.path.join(SOURCE_DIR, "tests", "conformance")


class Server:
    """attention-server on 127.0.0.1, ports picked by the system (the gRPC
    one is `address` when given, e.g. a stopped server's). Its warm-up is off
    unless `flags` name a --warmup or --test-gate-warmup flag (the server
    refuses a flag given twice): it is most of a start's time under ASan
    (tests/README.md), and these tests start many servers."""

    def __init__(self, *flags, address="127.0.0.1:0"):
        if not any(flag.startswith(("--warmup", "--test-gate-warmup")) for flag in flags):
            flags = (*flags, "--warmup", "false")
        self.dir = tempfile.TemporaryDirectory()
        ports = os.path.join(self.dir.name, "ports")
        self.log = open(os.path.join(self.dir.name, "log"), "wb")
        self.process = subprocess.Popen(
            [os.environ["ATTENTION_SERVER_BIN"], "--address", address,
             "--http-address", "127.0.0.1:0",
             "--metrics-address", "127.0.0.1:0", "--port-file", ports, "--threads", "1", *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        give_up = time.monotonic() + 60
        # The port file appears (atomically) once the server serves.
        while not os.path.exists(ports):
            if self.process.poll() is not None or time.monotonic() > give_up:
                self.stop()
                raise RuntimeError("attention-server did not start: " +
                                   read_text(os.path.join(self.dir.name, "log")))
            time.sleep(0.05)
        lines = dict(line.split() for line in read_text(ports).splitlines())
        self.address = lines["grpc"]
        self.metrics_address = lines["metrics"]
        self.http_address = lines["http"]

    def metric(self, name, **labels):
        """Sum of the samples of `name` with these labels; None when the
        server does not export `name` at all (absent is never 0)."""
        with urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=30) as reply:
            text = reply.read().decode()
        if f"# TYPE {name} " not in text:
            return None
        total = 0.0
        for line in text.splitlines():
            match = re.fullmatch(r"([a-z_]+)(?:\{(.*)\})? (\S+)", line)
            if not match or match.group(1) != name:
                continue
            found = dict(re.findall(r'([a-z_]+)="([^"]*)"', match.group(2) or ""))
            if all(found.get(key) == value for key, value in labels.items()):
                total += float(match.group(3))
        return total

    def stop(self, sig=signal.SIGTERM):
        self.process.send_signal(sig)
        self.process.wait(timeout=60)
        self.log.close()
        self.dir.cleanup()


def read_text(path):
    with open(path) as f:
        return f.read()


def tensor(t):
    return np.asarray(t["data"], dtype=np.float32).reshape(t["shape"])


def read_case(name):
    return json.loads(read_text(os.path.join(CONFORMANCE, "cases", name + ".json")))


def case_arguments(request):
    """A conformance case's request as attend's keyword arguments, weights asked."""
    arguments = {key: tensor(request[key]) for key in ("queries", "keys", "values")
                 if key in request}
    arguments.update(model=request["model"], valid_lens=request.get("valid_lens"),
                     causal=request.get("causal", False), scale=request.get("scale"),
                     return_attention_weights=True, request_id=request.get("request_id", ""))
    return arguments


# Concurrent requests may be batched; a batched answer may differ this much.
BATCH_TOLERANCE = 1e-5


class PythonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server("--model-repository", os.path.join(CONFORMANCE, "models"))
        cls.client = attention_client.AttentionClient(cls.server.address, timeout=30)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def check_case(self, name):
        case = read_case(name)
        result = self.client.attend(**case_arguments(case["request"]))
        for actual, key in ((result.output, "output"),
                            (result.attention_weights, "attention_weights")):
            expected = tensor(case["expected"][key])
            self.assertIsInstance(actual, np.ndarray)
            self.assertEqual(actual.dtype, np.float32)
            self.assertEqual(actual.shape, expected.shape, key)
            np.testing.assert_allclose(actual, expected, atol=case["atol"], rtol=case["rtol"],
                                       err_msg=f"{name}: {key}")

    def test_reproduces_the_d2l_toy_cases(self):
        self.check_case("dot_product_d2l_toy")
        self.check_case("additive_d2l_toy")

    def test_reproduces_masks_scale_and_self_attention(self):
        for name in ("dot_product_valid_lens_2d", "dot_product_scale_override",
                     "self_attention_torch_values_omitted", "multi_head_d2l_causal_bf16"):
            with self.subTest(case=name):
                self.check_case(name)

    def test_weights_only_when_asked(self):
        queries = np.ones((1, 2, 3))
        result = self.client.attend(queries)
        self.assertIsNone(result.attention_weights)
        # Self-attention over equal rows averages equal values: the input.
        np.testing.assert_allclose(result.output, queries, atol=1e-6)

    def test_lists_models(self):
        models = {m.name: m for m in self.client.list_models()}
        self.assertEqual(models["additive_toy"].kind, "additive")
        self.assertEqual(models["additive_toy"].query_size, 20)
        self.assertIn("dot_product", models)

    def test_server_errors_keep_their_code(self):
        with self.assertRaises(grpc.RpcError) as error:
            self.client.attend(np.ones((1, 1, 2)), model="no_such_model")
        self.assertEqual(error.exception.code(), grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(grpc.RpcError) as error:
            self.client.attend(np.ones((1, 1, 2)), np.ones((1, 3, 5)))
        self.assertEqual(error.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

    def test_bad_input_is_refused_before_sending(self):
        with self.assertRaisesRegex(ValueError, r"queries must be an array .* got a scalar"):
            self.client.attend(np.float32(2))
        # Any rank is sent: the server says which ones the model takes.
        with self.assertRaises(grpc.RpcError) as error:
            self.client.attend(np.ones((2, 2)))
        self.assertEqual(error.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("queries", error.exception.details())

    def test_heatmap_example_writes_a_png(self):
        with tempfile.TemporaryDirectory() as out:
            png = os.path.join(out, "heatmaps.png")
            run = subprocess.run(
                [sys.executable,
                 os.path.join(SOURCE_DIR, "client", "python", "examples", "heatmap_example.py"),
                 "--target", self.server.address, "--output", png, "--dpi", "80"],
                capture_output=True, text=True, timeout=120)
            self.assertEqual(run.returncode, 0, run.stderr)
            self.assertIn("Additive (additive_toy)", run.stdout)
            with open(png, "rb") as f:
                data = f.read()
        self.assertEqual(data[:8], b"\x89PNG\r\n\x1a\n")
        self.assertEqual(data[12:16], b"IHDR")
        width, height = struct.unpack(">II", data[16:24])
        # Two panels of 3 x 2.5 inches at 80 dpi.
        self.assertEqual((width, height), (480, 200))
        self.assertEqual(data[-8:-4], b"IEND")
        self.assertGreater(len(data), 2000)


    def assert_same_answer(self, streamed, unary, what):
        self.assertIsInstance(streamed, attention_client.AttendResult, what)
        for key in ("output", "attention_weights"):
            actual, expected = getattr(streamed, key), getattr(unary, key)
            self.assertEqual(actual.dtype, np.float32, f"{what}: {key}")
            self.assertEqual(actual.shape, expected.shape, f"{what}: {key}")
            self.assertLessEqual(float(np.max(np.abs(actual - expected))), BATCH_TOLERANCE,
                                 f"{what}: {key}")

    def test_stream_answers_in_order_with_errors_in_place(self):
        names = ["dot_product_d2l_toy", "additive_d2l_toy", "multi_head_d2l_causal_bf16",
                 "distance_scale_valid_lens_2d", "bilinear_valid_lens_1d"]
        requests = [case_arguments(read_case(name)["request"]) for name in names]
        for i, request in enumerate(requests):
            request["request_id"] = f"r{i}"
        unknown_model = dict(queries=np.ones((1, 2, 3)), model="no_such_model", request_id="bad1")
        # Keys of 5 features for queries of 4: dot_product needs d_q == d_k.
        wrong_shape = dict(queries=np.ones((1, 2, 4)), keys=np.ones((1, 3, 5)), request_id="bad2")
        requests.insert(1, unknown_model)
        requests.insert(4, wrong_shape)

        items = list(self.client.attend_stream(requests))

        self.assertEqual(len(items), len(requests))
        for index, code in ((1, grpc.StatusCode.NOT_FOUND),
                            (4, grpc.StatusCode.INVALID_ARGUMENT)):
            item = items[index]
            self.assertIsInstance(item, attention_client.AttendError, f"item {index}")
            self.assertIsInstance(item, grpc.RpcError)
            self.assertEqual(item.code(), code)
            self.assertEqual(item.request_id, requests[index]["request_id"])
        self.assertIn("no_such_model", items[1].details())
        self.assertIn("keys", items[4].details())
        for index in (0, 2, 3, 5, 6):
            self.assert_same_answer(items[index], self.client.attend(**requests[index]),
                                    requests[index]["request_id"])

    def test_stream_of_many_requests_from_a_generator(self):
        # More answers (about 6 MB) than the server keeps unwritten and than
        # HTTP/2's first windows hold: requests must go out while answers are read.
        rng = np.random.default_rng(7)
        distinct = [dict(queries=rng.normal(size=(1, 32, 32)), keys=rng.normal(size=(1, 256, 32)),
                         valid_lens=[200], return_attention_weights=True) for _ in range(3)]
        count = 150
        items = list(self.client.attend_stream(distinct[i % 3] for i in range(count)))
        self.assertEqual(len(items), count)
        unary = [self.client.attend(**request) for request in distinct]
        for i, item in enumerate(items):
            self.assert_same_answer(item, unary[i % 3], f"request {i}")

    def test_stream_request_that_cannot_be_built_ends_the_stream_after_the_others(self):
        requests = [dict(queries=np.ones((1, 2, 3))), dict(queries=np.full((1, 1, 3), 2.0)),
                    dict(queries=np.ones((1, 2, 3)), position_ids=[0.5, 1.5]),
                    dict(queries=np.ones((1, 2, 3)))]
        items = []
        with self.assertRaisesRegex(ValueError, r"position_ids must be integers"):
            for item in self.client.attend_stream(requests):
                items.append(item)
        self.assertEqual(len(items), 2)
        np.testing.assert_allclose(items[1].output, np.full((1, 1, 3), 2.0), atol=1e-6)

    def test_stream_stopped_early_leaves_the_client_usable(self):
        stream = self.client.attend_stream(dict(queries=np.ones((1, 2, 3))) for _ in range(1000))
        first = next(stream)
        stream.close()
        np.testing.assert_allclose(first.output, np.ones((1, 2, 3)), atol=1e-6)
        self.assertEqual(len(list(self.client.attend_stream([dict(queries=np.ones((1, 1, 2)))]))), 1)

    def test_stream_deadline_fails_the_call(self):
        # A request that takes far longer than its deadline: gRPC rounds
        # deadlines to the millisecond, within which the server now answers
        # a tiny request, so a 1 ns deadline alone did not always fail.
        with self.assertRaises(grpc.RpcError) as error:
            list(self.client.attend_stream([dict(queries=np.ones((1, 2048, 64)))], timeout=1e-3))
        self.assertEqual(error.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)


def grouped_attention(q, k, v, *, causal, window=0, softcap=0.0, offset=0):
    """dot_product over grouped heads, written plainly from docs/api.md 2.8:
    q (B, n_q, H, d), k (B, n_k, H_kv, d), v (B, n_k, H_kv, d_v); query i
    sits at position offset + i; soft-cap, then the masks (causal, window
    i - j < W) overwrite with -1e6."""
    batch, n_q, heads, d = q.shape
    group = heads // k.shape[2]
    out = np.zeros((batch, n_q, heads, v.shape[3]))
    i = offset + np.arange(n_q)[:, None]
    j = np.arange(k.shape[1])[None, :]
    allowed = np.ones((n_q, k.shape[1]), dtype=bool)
    if causal:
        allowed &= j <= i
    if window:
        allowed &= i - j < window
    for b in range(batch):
        for h in range(heads):
            scores = q[b, :, h].astype(np.float64) @ k[b, :, h // group].T / np.sqrt(d)
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            scores = np.where(allowed, scores, -1e6)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            out[b, :, h] = weights @ v[b, :, h // group]
    return out


class PythonGroupedHeadsTest(unittest.TestCase):
    """dot_product over grouped heads: 4-D arrays, a window and a soft-cap,
    through attend and through a session whose steps bring their own keys
    and values, against a plain reference."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server()
        cls.client = attention_client.AttentionClient(cls.server.address, timeout=30)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def test_attend_with_window_and_softcap(self):
        rng = np.random.default_rng(5)
        q, k = rng.normal(size=(2, 6, 4, 8)) * 2, rng.normal(size=(2, 6, 2, 8)) * 2
        v = rng.normal(size=(2, 6, 2, 3))
        result = self.client.attend(q, k, v, causal=True, sliding_window=2, softcap=1.5)
        self.assertEqual(result.output.shape, (2, 6, 4, 3))
        expected = grouped_attention(q, k, v, causal=True, window=2, softcap=1.5)
        np.testing.assert_allclose(result.output, expected, atol=1e-5)
        plain = self.client.attend(q, k, v, causal=True).output
        self.assertGreater(float(np.max(np.abs(plain - expected))), 1e-3)

    def test_session_steps_bring_their_own_keys_and_values(self):
        rng = np.random.default_rng(6)
        q, k = rng.normal(size=(1, 5, 4, 8)), rng.normal(size=(1, 5, 2, 8))
        v = rng.normal(size=(1, 5, 2, 3))
        with self.client.session("dot_product", sliding_window=3, softcap=2.0) as session:
            length = 0
            for n in (3, 1, 1):
                rows = slice(length, length + n)
                step = session.step(q[:, rows], keys=k[:, rows], values=v[:, rows])
                expected = grouped_attention(q[:, rows], k[:, :length + n], v[:, :length + n],
                                             causal=True, window=3, softcap=2.0, offset=length)
                length += n
                self.assertEqual(step.length, length)
                np.testing.assert_allclose(step.output, expected, atol=1e-5)


class PythonLayerTest(unittest.TestCase):
    """The layer cases (Hugging Face's layouts): positions, windows and
    grouped heads through attend and list_models."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server("--model-repository", os.path.join(CONFORMANCE, "layers", "models"))
        cls.client = attention_client.AttentionClient(cls.server.address, timeout=30)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def test_every_layer_case_with_its_positions(self):
        directory = os.path.join(CONFORMANCE, "layers", "cases")
        names = sorted(name for name in os.listdir(directory) if name.endswith(".json"))
        self.assertTrue(any(name.endswith("_positions.json") for name in names))
        for name in names:
            case = json.loads(read_text(os.path.join(directory, name)))
            request = case["request"]
            with self.subTest(case=name):
                arguments = case_arguments(request)
                arguments["return_attention_weights"] = request.get("return_attention_weights",
                                                                    False)
                if "position_ids" in request:
                    # (B, n_q), as a caller holds them.
                    arguments["position_ids"] = np.asarray(request["position_ids"]).reshape(
                        request["queries"]["shape"][:2])
                result = self.client.attend(**arguments)
                for key in ("output", "attention_weights"):
                    if key not in case["expected"]:
                        continue
                    np.testing.assert_allclose(getattr(result, key),
                                               tensor(case["expected"][key]), atol=case["atol"],
                                               rtol=case["rtol"], err_msg=f"{name}: {key}")

    def test_positions_change_the_answer(self):
        queries = np.random.default_rng(3).uniform(-1, 1, (1, 3, 64))
        plain = self.client.attend(queries, model="llama3_gqa", causal=True).output
        same = self.client.attend(queries, model="llama3_gqa", causal=True,
                                  position_ids=[0, 1, 2]).output
        # Rotary sees only the distances between positions: a shift of them
        # all changes nothing, other distances change the answer.
        shifted = self.client.attend(queries, model="llama3_gqa", causal=True,
                                     position_ids=[100, 101, 102]).output
        spread = self.client.attend(queries, model="llama3_gqa", causal=True,
                                    position_ids=[0, 5, 50]).output
        np.testing.assert_allclose(same, plain, atol=1e-6)
        np.testing.assert_allclose(shifted, plain, atol=1e-5)
        self.assertGreater(float(np.max(np.abs(spread - plain))), 1e-3)

    def test_lists_grouped_heads_and_rotary(self):
        models = {m.name: m for m in self.client.list_models()}
        llama = models["llama3_gqa"]
        self.assertEqual(llama.num_heads % llama.num_kv_heads, 0)
        self.assertLess(llama.num_kv_heads, llama.num_heads)
        self.assertEqual(llama.rope_type, "llama3")
        self.assertTrue(models["alibi_6_heads"].alibi)
        self.assertEqual(models["alibi_6_heads"].rope_type, "")

    def test_window_and_softcap_are_refused_for_a_layer_with_their_names(self):
        queries = np.ones((1, 2, 64))
        for arguments, field in ((dict(sliding_window=2), "sliding_window"),
                                 (dict(softcap=5.0), "softcap")):
            with self.subTest(field=field):
                with self.assertRaises(grpc.RpcError) as error:
                    self.client.attend(queries, model="llama3_gqa", **arguments)
                self.assertEqual(error.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(field, error.exception.details())


class PythonSessionTest(unittest.TestCase):
    """client.session(): AttendSession from Python (docs/api.md section 11)."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server("--model-repository", os.path.join(CONFORMANCE, "models"),
                            "--max-session-length", "6")
        cls.client = attention_client.AttentionClient(cls.server.address, timeout=30)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def test_self_steps_equal_causal_attend_on_the_prefix(self):
        tokens = np.random.default_rng(1).uniform(-1, 1, (1, 6, 16)).astype(np.float32)
        with self.client.session("mh_torch_small") as session:
            self.assertEqual(session.length, 0)
            self.assertEqual(session.model_version, 1)
            length = 0
            for n in (3, 1, 2):
                step = session.step(tokens[:, length:length + n])
                length += n
                self.assertEqual(step.length, length)
                self.assertIsNone(step.attention_weights)
                expected = self.client.attend(tokens[:, :length], model="mh_torch_small",
                                              causal=True).output[:, length - n:]
                np.testing.assert_allclose(step.output, expected, atol=1e-4)

    def test_cross_steps_equal_attend_with_the_memory(self):
        rng = np.random.default_rng(2)
        keys, values = rng.uniform(-1, 1, (1, 5, 5)), rng.uniform(-1, 1, (1, 5, 3))
        with self.client.session("additive_small", memory="cross", keys=keys, values=values,
                                 valid_lens=[4]) as session:
            self.assertEqual(session.length, 5)
            queries = rng.uniform(-1, 1, (1, 2, 6))
            step = session.step(queries, return_attention_weights=True)
            expected = self.client.attend(queries, keys, values, model="additive_small",
                                          valid_lens=[4], return_attention_weights=True)
            np.testing.assert_allclose(step.output, expected.output, atol=1e-4)
            np.testing.assert_allclose(step.attention_weights, expected.attention_weights,
                                       atol=1e-4)

    def test_refused_steps_raise_and_the_session_goes_on(self):
        rows = np.ones((1, 4, 16), dtype=np.float32)
        with self.client.session("mh_torch_small") as session:
            session.step(rows)
            with self.assertRaises(attention_client.AttendError) as wrong:
                session.step(np.ones((1, 1, 5)))
            self.assertEqual(wrong.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            with self.assertRaises(attention_client.AttendError) as too_long:
                session.step(rows)
            self.assertEqual(too_long.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("--max-session-length", too_long.exception.details())
            self.assertEqual(session.length, 4)
            self.assertEqual(session.step(rows[:, :2]).length, 6)
        with self.assertRaises(attention_client.AttendError) as unknown:
            self.client.session("no_such_model")
        self.assertEqual(unknown.exception.code(), grpc.StatusCode.NOT_FOUND)
        with self.assertRaises(ValueError):
            self.client.session("mh_torch_small", memory="both")


class ScriptedService:
    """AttentionService on 127.0.0.1 that follows the n-th script for its n-th
    AttendStream call (the last one repeats), and answers Attend with
    UNAVAILABLE first, then as a stream does.

    Scripts: "fail" (UNAVAILABLE before reading), "answer_one_then_fail",
    "answer_all", "answer_none", "answer_twice". A request whose model is
    "error:<code>" is answered with an AttendError of that code, any other with
    its queries as the output."""

    def __init__(self, *scripts):
        self.scripts = scripts
        self.stream_calls = 0
        self.attend_calls = 0
        self.lock = threading.Lock()
        pb2 = attention_client.pb2
        handlers = {
            "AttendStream": grpc.stream_stream_rpc_method_handler(
                self.attend_stream, request_deserializer=pb2.AttendRequest.FromString,
                response_serializer=pb2.AttendResponse.SerializeToString),
            "Attend": grpc.unary_unary_rpc_method_handler(
                self.attend, request_deserializer=pb2.AttendRequest.FromString,
                response_serializer=pb2.AttendResponse.SerializeToString),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("attention.v1.AttentionService", handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self):
        self.server.stop(grace=None)

    @staticmethod
    def answer(request):
        response = attention_client.pb2.AttendResponse(request_id=request.request_id)
        if not request.model.startswith("error:"):
            response.output.CopyFrom(request.queries)
        else:
            response.error.code = int(request.model[len("error:"):])
            response.error.message = "scripted error"
        return response

    def attend(self, request, context):
        with self.lock:
            self.attend_calls += 1
            first = self.attend_calls == 1
        if first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "scripted failure")
        return self.answer(request)

    def attend_stream(self, requests, context):
        with self.lock:
            script = self.scripts[min(self.stream_calls, len(self.scripts) - 1)]
            self.stream_calls += 1
        if script == "fail":
            context.abort(grpc.StatusCode.UNAVAILABLE, "scripted failure")
        for request in requests:
            if script == "answer_none":
                continue
            yield self.answer(request)
            if script == "answer_one_then_fail":
                context.abort(grpc.StatusCode.UNAVAILABLE, "scripted failure")
            if script == "answer_twice":
                yield self.answer(request)


def id_requests(*models):
    return [dict(queries=np.ones((1, 1, 1)), model=model, request_id=f"r{i}")
            for i, model in enumerate(models)]


class ScriptedStreamTest(unittest.TestCase):
    def stream(self, *scripts, models=("m", "m", "m")):
        """The items of one stream to a service following `scripts`, or the
        error that ended it, and the service."""
        service = ScriptedService(*scripts)
        self.addCleanup(service.stop)
        with attention_client.AttentionClient(service.address, timeout=30) as client:
            items = []
            try:
                for item in client.attend_stream(id_requests(*models)):
                    items.append(item)
            except grpc.RpcError as error:
                return items, error, service
            return items, None, service

    def test_unavailable_before_any_answer_is_not_retried(self):
        items, error, service = self.stream("fail", "answer_all")
        self.assertIsNotNone(error)
        self.assertEqual(error.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(items, [])
        self.assertEqual(service.stream_calls, 1)

    def test_unavailable_after_an_answer_is_not_retried(self):
        items, error, service = self.stream("answer_one_then_fail", "answer_all")
        self.assertIsNotNone(error)
        self.assertEqual(error.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(len(items), 1)
        self.assertEqual(service.stream_calls, 1)

    def test_unary_calls_on_the_same_client_are_still_retried(self):
        # The stream's exemption must not switch retries off for Attend.
        service = ScriptedService("answer_all")
        self.addCleanup(service.stop)
        with attention_client.AttentionClient(service.address, timeout=30) as client:
            client.attend(np.ones((1, 1, 1)), model="m")
        self.assertEqual(service.attend_calls, 2)

    def test_answer_error_codes_become_errors(self):
        items, error, _ = self.stream("answer_all",
                                      models=("error:5", "m", "error:0", "error:99", "error:16"))
        self.assertIsNone(error)
        self.assertEqual(len(items), 5)
        self.assertEqual(items[0].code(), grpc.StatusCode.NOT_FOUND)
        self.assertEqual(items[0].details(), "scripted error")
        self.assertEqual(items[0].request_id, "r0")
        self.assertIsInstance(items[1], attention_client.AttendResult)
        # Not an error code: still an error, naming what came.
        for index, code in ((2, 0), (3, 99)):
            self.assertEqual(items[index].code(), grpc.StatusCode.UNKNOWN)
            self.assertIn(f"code {code}", items[index].details())
        self.assertEqual(items[4].code(), grpc.StatusCode.UNAUTHENTICATED)

    def test_answer_count_other_than_request_count_is_internal(self):
        items, error, _ = self.stream("answer_none")
        self.assertEqual(error.code(), grpc.StatusCode.INTERNAL)
        self.assertIn("answered 0 of 3", error.details())
        self.assertEqual(items, [])
        items, error, _ = self.stream("answer_twice")
        self.assertEqual(error.code(), grpc.StatusCode.INTERNAL)
        self.assertRegex(error.details(), r"sent answer \d+ with only \d+ requests sent")


class CutOffService:
    """Attend on 127.0.0.1 over a bare HTTP/2 connection (h2), for what no
    gRPC server does: its first `cut_offs` answers end after their message
    without the status trailers, as an edge's does when the replica behind
    it is killed mid-answer (gRPC reports UNKNOWN). Later ones are answered
    as ScriptedService.answer does."""

    def __init__(self, cut_offs):
        import h2.config
        import h2.connection
        import h2.events
        self.h2 = h2
        self.cut_offs = cut_offs
        self.calls = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self):
        self.listener.close()

    def _accept(self):
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, sock):
        h2 = self.h2
        connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        connection.initiate_connection()
        bodies = {}
        with sock:
            sock.sendall(connection.data_to_send())
            while data := sock.recv(65536):
                for event in connection.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        bodies[event.stream_id] = bodies.get(event.stream_id, b"") + event.data
                        connection.acknowledge_received_data(len(event.data), event.stream_id)
                    elif isinstance(event, h2.events.StreamEnded):
                        self._answer(connection, event.stream_id, bodies.pop(event.stream_id, b""))
                sock.sendall(connection.data_to_send())

    def _answer(self, connection, stream_id, body):
        with self.lock:
            self.calls += 1
            cut_off = self.calls <= self.cut_offs
        request = attention_client.pb2.AttendRequest.FromString(body[5:])
        message = ScriptedService.answer(request).SerializeToString()
        connection.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
        connection.send_data(stream_id, struct.pack(">BI", 0, len(message)) + message)
        if cut_off:
            connection.end_stream(stream_id)
        else:
            connection.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)


class CutOffAnswerTest(unittest.TestCase):
    """An answer cut off on its way is sent again (attend(), up to
    max_attempts tries); max_attempts=1 reports it as gRPC does."""

    def test_cut_off_answers_are_sent_again(self):
        service = CutOffService(cut_offs=2)
        self.addCleanup(service.stop)
        queries = np.arange(8, dtype=np.float32).reshape(1, 2, 4)
        with attention_client.AttentionClient(service.address, timeout=10) as client:
            answer = client.attend(queries, model="m")
        np.testing.assert_array_equal(answer.output, queries)
        self.assertEqual(service.calls, 3)

    def test_tries_stop_at_max_attempts(self):
        for max_attempts in (1, 3):
            service = CutOffService(cut_offs=10)
            self.addCleanup(service.stop)
            with attention_client.AttentionClient(service.address, timeout=10,
                                                  max_attempts=max_attempts) as client:
                with self.assertRaises(grpc.RpcError) as raised:
                    client.attend(np.ones((1, 1, 4), dtype=np.float32), model="m")
            self.assertEqual(raised.exception.code(), grpc.StatusCode.UNKNOWN)
            self.assertEqual(service.calls, max_attempts)


class BalancedPythonClientTest(unittest.TestCase):
    @staticmethod
    def answered(server):
        return server.metric("attention_requests_total", code="OK") or 0

    def test_comma_separated_targets_share_the_calls(self):
        servers = [Server(), Server()]
        try:
            target = ",".join(server.address for server in servers)
            calls = 20
            with attention_client.AttentionClient(target) as client:
                # Round-robin uses only connected servers; a slow start (the
                # sanitizer builds) sends the first calls all to one server.
                deadline = time.monotonic() + 60
                while not all(self.answered(server) for server in servers):
                    self.assertLess(time.monotonic(), deadline, "a server never got a call")
                    client.attend(np.full((1, 1, 2), 2.0))
                before = [self.answered(server) for server in servers]
                for _ in range(calls):
                    result = client.attend(np.full((1, 1, 2), 2.0))
                    np.testing.assert_allclose(result.output, np.full((1, 1, 2), 2.0))
                # Once both are connected, round-robin gives each server half
                # (half of that required: a counter may lag its answer).
                for index, server in enumerate(servers):
                    self.assertGreaterEqual(self.answered(server) - before[index],
                                            calls / len(servers) / 2,
                                            f"server {index} answered too few calls")
                servers[0].stop(signal.SIGKILL)
                # The calls go on on the server left (retried on UNAVAILABLE).
                for _ in range(10):
                    client.attend(np.full((1, 1, 2), 2.0))
        finally:
            for server in servers:
                if server.process.poll() is None:
                    server.stop()


class SecurePythonClientTest(unittest.TestCase):
    """The client's token and TLS options against a server that requires them.
    Certificates: tests/support/make_pki.sh, as for the C++ tests."""

    @classmethod
    def setUpClass(cls):
        cls.pki = tempfile.TemporaryDirectory()
        subprocess.run(["bash", os.path.join(SOURCE_DIR, "tests", "support", "make_pki.sh"),
                        cls.pki.name, "ca", "rogue", "--",
                        "server/ca/DNS:localhost,IP:127.0.0.1", "client/ca", "intruder/rogue"],
                       check=True)
        cls.tokens = os.path.join(cls.pki.name, "tokens")
        with open(cls.tokens, "w") as f:
            f.write("s3cret\n")

    @classmethod
    def tearDownClass(cls):
        cls.pki.cleanup()

    def pem(self, name):
        with open(os.path.join(self.pki.name, name), "rb") as f:
            return f.read()

    def code(self, server, **options):
        """The code of one attend with these client options; an answer must be right."""
        queries = np.array([[[1.0, -2.0], [0.5, 3.0]]], dtype=np.float32)
        try:
            with attention_client.AttentionClient(server.address, timeout=10, **options) as client:
                result = client.attend(queries)
        except grpc.RpcError as error:
            return error.code()
        # Self-attention over two keys: every output row is a convex mix of them.
        self.assertEqual(result.output.shape, (1, 2, 2))
        self.assertTrue(np.all(result.output >= queries.min(axis=1) - 1e-6))
        self.assertTrue(np.all(result.output <= queries.max(axis=1) + 1e-6))
        return grpc.StatusCode.OK

    def test_token_and_tls_with_a_private_ca(self):
        server = Server("--tls-cert", os.path.join(self.pki.name, "server.crt"),
                        "--tls-key", os.path.join(self.pki.name, "server.key"),
                        "--auth-token-file", self.tokens)
        try:
            ca = self.pem("ca.crt")
            self.assertEqual(self.code(server, root_certificates=ca, token="s3cret"),
                             grpc.StatusCode.OK)
            self.assertEqual(self.code(server, root_certificates=ca),
                             grpc.StatusCode.UNAUTHENTICATED)
            self.assertEqual(self.code(server, root_certificates=ca, token="wrong"),
                             grpc.StatusCode.UNAUTHENTICATED)
            self.assertEqual(self.code(server, root_certificates=self.pem("rogue.crt"),
                                       token="s3cret"), grpc.StatusCode.UNAVAILABLE)
            self.assertEqual(self.code(server, token="s3cret"), grpc.StatusCode.UNAVAILABLE)
        finally:
            server.stop()

    def test_mutual_tls_presents_the_client_certificate(self):
        server = Server("--tls-cert", os.path.join(self.pki.name, "server.crt"),
                        "--tls-key", os.path.join(self.pki.name, "server.key"),
                        "--tls-client-ca", os.path.join(self.pki.name, "ca.crt"))
        try:
            ca = self.pem("ca.crt")
            self.assertEqual(self.code(server, root_certificates=ca,
                                       certificate_chain=self.pem("client.crt"),
                                       private_key=self.pem("client.key")), grpc.StatusCode.OK)
            self.assertEqual(self.code(server, root_certificates=ca), grpc.StatusCode.UNAVAILABLE)
            self.assertEqual(self.code(server, root_certificates=ca,
                                       certificate_chain=self.pem("intruder.crt"),
                                       private_key=self.pem("intruder.key")),
                             grpc.StatusCode.UNAVAILABLE)
        finally:
            server.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
