"""client_python_test: the Python client (client/python) against a real
attention-server: conformance cases through the numpy-in, numpy-out call,
errors as grpc.RpcError with the server's code, and the heatmap example
writing a valid PNG.

    ATTENTION_SERVER_BIN=build/server/attention-server /usr/bin/python3 tests/client_python_test.py
"""

import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import grpc
import numpy as np

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFORMANCE = os.path.join(SOURCE_DIR, "tests", "conformance")
sys.path.insert(0, os.path.join(SOURCE_DIR, "client", "python"))
import attention_client  # noqa: E402


class Server:
    """attention-server on 127.0.0.1, ports picked by the system."""

    def __init__(self, *flags):
        self.dir = tempfile.TemporaryDirectory()
        ports = os.path.join(self.dir.name, "ports")
        self.log = open(os.path.join(self.dir.name, "log"), "wb")
        self.process = subprocess.Popen(
            [os.environ["ATTENTION_SERVER_BIN"], "--address", "127.0.0.1:0",
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
        case = json.loads(read_text(os.path.join(CONFORMANCE, "cases", name + ".json")))
        request = case["request"]
        optional = {key: tensor(request[key]) for key in ("keys", "values") if key in request}
        result = self.client.attend(
            tensor(request["queries"]), optional.get("keys"), optional.get("values"),
            model=request["model"], valid_lens=request.get("valid_lens"),
            causal=request.get("causal", False), scale=request.get("scale"),
            return_attention_weights=True, request_id=request.get("request_id", ""))
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
        with self.assertRaisesRegex(ValueError, r"queries must have 3 dimensions .* \(2, 2\)"):
            self.client.attend(np.ones((2, 2)))

    def test_heatmap_example_writes_a_png(self):
        with tempfile.TemporaryDirectory() as out:
            png = os.path.join(out, "heatmaps.png")
            run = subprocess.run(
                [sys.executable, os.path.join(SOURCE_DIR, "client", "python", "heatmap_example.py"),
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


class BalancedPythonClientTest(unittest.TestCase):
    def test_comma_separated_targets_share_the_calls(self):
        servers = [Server(), Server()]
        try:
            target = ",".join(server.address for server in servers)
            with attention_client.AttentionClient(target) as client:
                for _ in range(10):
                    result = client.attend(np.full((1, 1, 2), 2.0))
                    np.testing.assert_allclose(result.output, np.full((1, 1, 2), 2.0))
                servers[0].stop(signal.SIGKILL)
                # The calls go on on the server left (retried on UNAVAILABLE).
                for _ in range(10):
                    client.attend(np.full((1, 1, 2), 2.0))
        finally:
            for server in servers:
                if server.process.poll() is None:
                    server.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
