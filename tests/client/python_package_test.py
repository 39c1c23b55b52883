"""python_package_test: the installed attention-client package, used the way
a user outside the repository would (python_package_test.sh runs it from a
temporary directory with only the virtual environment on PATH, so no protoc).
Against a real attention-server: every conformance case through attend and
through one attend_stream, answers checked against the expected values;
every errors.json request a numpy caller can express gets its status code
(unary) and its error in place (stream); `python -m attention_client`'s
health, models and attend on .npy files. Also: the package is the installed
one, at the server's version.

    python_package_test.sh VENV_DIR SERVER_BINARY
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import attention_client
import grpc
import numpy as np

# python_test.py, beside this file: the server process and conformance readers.
from python_test import CONFORMANCE, SOURCE_DIR, Server, case_arguments, read_text, tensor

CASES = sorted(glob.glob(os.path.join(CONFORMANCE, "cases", "*.json")))
# errors.json requests whose data does not fill their shape: a numpy array
# cannot hold them, so only a hand-built message can send them.
NOT_ARRAYS = {"data_length_mismatch", "absurd_shape"}


def read_json(path):
    with open(path) as f:
        return json.load(f)


def error_arguments(request):
    """An errors.json request as attend's arguments (NaN and Infinity come
    as strings, which numpy reads); ValueError when the data does not fill
    the shape."""
    arguments = {key: np.asarray(request[key]["data"], dtype=np.float64)
                 .reshape(request[key]["shape"])
                 for key in ("queries", "keys", "values") if key in request}
    arguments.update(model=request["model"], valid_lens=request.get("valid_lens"),
                     return_attention_weights=True, request_id=request["request_id"])
    return arguments


class InstalledPackageTest(unittest.TestCase):
    def test_runs_from_the_installed_package_without_protoc(self):
        self.assertTrue(attention_client.__file__.startswith(sys.prefix + os.sep),
                        f"{attention_client.__file__} is not under {sys.prefix}")
        self.assertFalse(os.getcwd().startswith(SOURCE_DIR + os.sep))
        for tool in ("protoc", "grpc_python_plugin"):
            self.assertIsNone(shutil.which(tool), f"{tool} is on PATH")

    def test_version_is_the_servers(self):
        cmake = read_text(os.path.join(SOURCE_DIR, "CMakeLists.txt"))
        version = re.search(r"project\(\w+ VERSION ([0-9.]+)", cmake).group(1)
        self.assertEqual(attention_client.__version__, version)


class ConformanceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server("--model-repository", os.path.join(CONFORMANCE, "models"))
        cls.client = attention_client.AttentionClient(cls.server.address, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def assert_case(self, case, result):
        self.assertIsInstance(result, attention_client.AttendResult, case["name"])
        for key in ("output", "attention_weights"):
            actual, expected = getattr(result, key), tensor(case["expected"][key])
            what = f"{case['name']}: {key}"
            self.assertIsInstance(actual, np.ndarray, what)
            self.assertEqual(actual.dtype, np.float32, what)
            self.assertEqual(actual.shape, expected.shape, what)
            np.testing.assert_allclose(actual, expected, atol=case["atol"], rtol=case["rtol"],
                                       err_msg=what)

    def test_every_case_unary(self):
        self.assertGreater(len(CASES), 20)
        for path in CASES:
            case = read_json(path)
            with self.subTest(case=case["name"]):
                self.assert_case(case, self.client.attend(**case_arguments(case["request"])))

    def test_every_case_in_one_stream(self):
        cases = [read_json(path) for path in CASES]
        items = list(self.client.attend_stream(case_arguments(case["request"])
                                               for case in cases))
        self.assertEqual(len(items), len(cases))
        for case, item in zip(cases, items):
            with self.subTest(case=case["name"]):
                self.assert_case(case, item)

    def test_every_expressible_error_unary_and_in_a_stream(self):
        entries = read_json(os.path.join(CONFORMANCE, "errors.json"))
        sendable, unsendable = [], set()
        for entry in entries:
            try:
                sendable.append((entry, error_arguments(entry["request"])))
            except ValueError:
                unsendable.add(entry["name"])
        self.assertEqual(unsendable, NOT_ARRAYS)
        good = case_arguments(read_json(CASES[0])["request"])
        stream = []
        for entry, arguments in sendable:
            expected = grpc.StatusCode[entry["expected_code"]]
            with self.subTest(error=entry["name"]):
                # Arrays of any rank are sent (4-D rows are grouped heads):
                # the server names a wrong rank.
                with self.assertRaises(grpc.RpcError) as raised:
                    self.client.attend(**arguments)
                self.assertEqual(raised.exception.code(), expected)
                stream += [(entry, arguments), (None, good)]
        items = list(self.client.attend_stream(arguments for _, arguments in stream))
        self.assertEqual(len(items), len(stream))
        for (entry, _), item in zip(stream, items):
            if entry is None:
                self.assertIsInstance(item, attention_client.AttendResult)
                continue
            with self.subTest(stream_error=entry["name"]):
                self.assertIsInstance(item, attention_client.AttendError)
                self.assertEqual(item.code(), grpc.StatusCode[entry["expected_code"]])
                self.assertEqual(item.request_id, entry["request"]["request_id"])

    def cli(self, *args):
        return subprocess.run([sys.executable, "-m", "attention_client", "--target",
                               self.server.address, *args],
                              capture_output=True, text=True, timeout=60)

    def test_command_line(self):
        run = self.cli("--help")
        self.assertEqual(run.returncode, 0, run.stderr)
        for command in ("health", "models", "attend"):
            self.assertIn(command, run.stdout)
        run = self.cli("health")
        self.assertEqual((run.returncode, run.stdout), (0, "SERVING\n"), run.stderr)
        run = self.cli("models")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertRegex(run.stdout, r"additive_toy +additive ")
        run = self.cli("attend", "/nonexistent.npy")
        self.assertEqual(run.returncode, 2)
        self.assertIn("/nonexistent.npy", run.stderr)

        case = read_json(os.path.join(CONFORMANCE, "cases", "additive_d2l_toy.json"))
        request = case["request"]
        with tempfile.TemporaryDirectory() as out:
            files = []
            for key in ("queries", "keys", "values"):
                np.save(os.path.join(out, key), tensor(request[key]))
                files.append(os.path.join(out, key + ".npy"))
            result = os.path.join(out, "result.npz")
            run = self.cli("attend", files[0], "--keys", files[1], "--values", files[2],
                           "--model", request["model"], "--weights", "--output", result,
                           "--valid-lens", ",".join(map(str, request["valid_lens"])))
            self.assertEqual(run.returncode, 0, run.stderr)
            with np.load(result) as arrays:
                self.assert_case(case, attention_client.AttendResult(
                    arrays["output"], arrays["attention_weights"]))
            run = self.cli("attend", files[0], "--model", "no_such_model")
            self.assertEqual(run.returncode, 1)
            self.assertIn("NOT_FOUND", run.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
