"""server_warmup_python_test: the warm-up before SERVING (docs/api.md 6.9).

Against real attention-server processes on 127.0.0.1 (port 0):
- with --test-gate-warmup, the warm-up of the test gate's model waits for a
  byte of the gate FIFO, so the test sees the server while it warms up:
  grpc.health.v1 answers NOT_SERVING (the server and each service) and
  ServerReady false, REST GET /v2/health/ready 503 (live 200), no port
  file yet; after the byte, SERVING and ready (REST 200), and the log says
  what each model computed (a batch, then one large request), on how many
  engine threads, the scratch the engine keeps, and how long each model and
  the whole warm-up took; with --max-batch-size 1, one large request;
- --warmup false and ATTENTION_WARMUP=false: the server serves without
  that byte and logs no warm-up;
- a version the repository poller loads later is warmed up before it is
  swapped in (its warm-up line comes before its "loaded" line).

    ATTENTION_SERVER_BIN=build/server/attention-server /usr/bin/python3 tests/server/warmup_python_test.py
"""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import unittest
import urllib.error
import urllib.request

import grpc

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(SOURCE_DIR, "models", "bilinear_d64.safetensors")
SERVICES = ("", "attention.v1.AttentionService", "inference.GRPCInferenceService")
# grpc.health.v1.HealthCheckResponse.status: SERVING = 1, NOT_SERVING = 2.
SERVING, NOT_SERVING = 1, 2


def health_request(service):
    """HealthCheckRequest{service}: field 1, a string (short names only)."""
    name = service.encode()
    return b"" if not name else bytes([0x0A, len(name)]) + name


def varint_field_1(message):
    """The value of field 1 (a varint) of a serialized message; 0 when absent."""
    if not message:
        return 0
    if message[0] != 0x08:
        raise AssertionError(f"unexpected message {message!r}")
    return message[1]


class Server:
    """attention-server whose log the test reads while it starts."""

    def __init__(self, flags, env=None):
        self.dir = tempfile.mkdtemp()
        self.ports = os.path.join(self.dir, "ports")
        self.log_path = os.path.join(self.dir, "log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [os.environ["ATTENTION_SERVER_BIN"], "--address", "127.0.0.1:0",
                 "--metrics-address", "", "--http-address", "127.0.0.1:0", "--port-file",
                 self.ports, "--threads", "1", *flags],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})))
        self.channel = None

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_for(self, predicate, what, seconds=60):
        give_up = time.monotonic() + seconds
        while time.monotonic() < give_up:
            found = predicate()
            if found:
                return found
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited while waiting for {what}:\n{self.log()}")
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log()}")

    def connect(self, address):
        self.channel = grpc.insecure_channel(address)

    def health(self, service):
        check = self.channel.unary_unary("/grpc.health.v1.Health/Check")
        return varint_field_1(check(health_request(service), timeout=10))

    def server_ready(self):
        ready = self.channel.unary_unary("/inference.GRPCInferenceService/ServerReady")
        return bool(varint_field_1(ready(b"", timeout=10)))

    def rest_status(self, http_address, path):
        try:
            with urllib.request.urlopen(f"http://{http_address}{path}", timeout=10) as answer:
                return answer.status
        except urllib.error.HTTPError as error:
            return error.code

    def stop(self):
        if self.channel is not None:
            self.channel.close()
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        shutil.rmtree(self.dir)
        return code


class WarmupTest(unittest.TestCase):
    def setUp(self):
        self.work = tempfile.mkdtemp()
        self.fifo = os.path.join(self.work, "gate")
        os.mkfifo(self.fifo)

    def tearDown(self):
        shutil.rmtree(self.work)

    def start(self, flags, env=None):
        server = Server(["--test-gate-fifo", self.fifo, "--test-gate-warmup", "true", *flags], env)
        self.addCleanup(lambda: server.process.poll() is None and server.stop())
        return server

    def release_gate(self):
        fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b".")
        os.close(fd)

    def released(self):
        """Releases the gate once the server reads it: False before."""
        try:
            self.release_gate()
            return True
        except OSError:
            return False

    def test_not_ready_until_warmed_up(self):
        server = self.start([])
        address, http_address = server.wait_for(
            lambda: re.search(r"warm-up before serving on (\S+) and http://(\S+):", server.log()),
            "the warm-up to start").groups()
        server.connect(address)
        for service in SERVICES:
            self.assertEqual(server.health(service), NOT_SERVING, f"health of '{service}'")
        self.assertFalse(server.server_ready())
        self.assertEqual(server.rest_status(http_address, "/v2/health/ready"), 503)
        self.assertEqual(server.rest_status(http_address, "/v2/health/live"), 200)
        self.assertFalse(os.path.exists(server.ports), "port file written before serving")

        self.release_gate()
        server.wait_for(lambda: server.health("") == SERVING, "SERVING")
        for service in SERVICES:
            self.assertEqual(server.health(service), SERVING, f"health of '{service}'")
        self.assertTrue(server.server_ready())
        self.assertEqual(server.rest_status(http_address, "/v2/health/ready"), 200)
        server.wait_for(lambda: os.path.exists(server.ports), "the port file")
        log = server.log()
        self.assertRegex(log, r"warm-up: model gate version 1: \d+ requests of \d+ queries")
        self.assertRegex(log, r"warm-up: model dot_product version 1: 32 requests of \d+ queries "
                              r"and keys, then 1 request of \d+ queries and keys in [0-9.]+ ms "
                              r"on 1 engine threads; engine scratch kept [0-9.]+ MiB")
        self.assertRegex(log, r"warm-up: \d+ model versions in [0-9.]+ ms")
        self.assertEqual(server.stop(), 0)

    def test_without_batching_one_large_request(self):
        server = self.start(["--max-batch-size", "1"])
        server.wait_for(self.released, "the gate's warm-up to open the gate")
        server.wait_for(lambda: os.path.exists(server.ports), "the port file")
        self.assertRegex(server.log(), r"warm-up: model dot_product version 1: 1 request of \d+ "
                                       r"queries and keys in [0-9.]+ ms")
        self.assertNotIn("then", server.log())
        self.assertEqual(server.stop(), 0)

    def check_serves_without_warmup(self, flags, env=None):
        server = self.start(flags, env)
        # The gate is never released: only a server that skips the warm-up
        # gets to write its port file.
        server.wait_for(lambda: os.path.exists(server.ports), "the port file")
        with open(server.ports) as f:
            server.connect(dict(line.split() for line in f.read().splitlines())["grpc"])
        self.assertEqual(server.health(""), SERVING)
        self.assertTrue(server.server_ready())
        self.assertNotIn("warm-up", server.log())
        self.assertEqual(server.stop(), 0)

    def test_flag_turns_it_off(self):
        self.check_serves_without_warmup(["--warmup", "false"])

    def test_environment_turns_it_off(self):
        self.check_serves_without_warmup([], {"ATTENTION_WARMUP": "false"})

    def test_new_version_warmed_up_before_swap(self):
        repository = os.path.join(self.work, "models")
        os.makedirs(os.path.join(repository, "m"))
        shutil.copyfile(MODEL, os.path.join(repository, "m", "1.safetensors"))
        server = self.start(["--model-repository", repository, "--repository-poll-seconds", "0.2"])
        server.wait_for(self.released, "the gate's warm-up to open the gate")
        server.wait_for(lambda: os.path.exists(server.ports), "the port file")
        self.assertIn("warm-up: model m version 1:", server.log())

        staged = os.path.join(repository, "m", "2.safetensors.tmp")
        shutil.copyfile(MODEL, staged)
        os.rename(staged, os.path.join(repository, "m", "2.safetensors"))
        log = server.wait_for(lambda: "loaded m version 2" in server.log() and server.log(),
                              "version 2 to load")
        warmed = log.find("warm-up: model m version 2:")
        self.assertGreaterEqual(warmed, 0, log)
        self.assertLess(warmed, log.find("loaded m version 2"), log)
        self.assertEqual(server.stop(), 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
