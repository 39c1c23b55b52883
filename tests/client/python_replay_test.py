"""python_replay_test: Python sessions that survive losing their server
(docs/api.md section 11.6). Against real attention-servers: a session's
server is killed (kill -9, then a new one on the same port) or stopped
(SIGTERM, its grace run out, the other server of the target list left)
halfway through a decode; every step still succeeds, the outputs equal an
uninterrupted decode's on another server within 1e-4, and `replays` is 1.
With replay off the break is an error; with rows past replay_limit_bytes a
SessionLost that says so.

    ATTENTION_SERVER_BIN=build/server/attention-server \
        build/tests/python-client-venv/bin/python tests/client/python_replay_test.py
"""

import os
import signal
import unittest

import attention_client
import grpc
import numpy as np

from python_test import CONFORMANCE, Server

MODELS = os.path.join(CONFORMANCE, "models")
MODEL = "mh_torch_small"  # multi_head, E = 16: self memory
STEPS = 8                 # a 3-row prompt, then one token a step
BREAK_AT = STEPS // 2


def rows(batch, seed):
    """The decode's steps: a prompt of 3 rows, then single tokens."""
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (batch, 3 if i == 0 else 1, 16)).astype(np.float32)
            for i in range(STEPS)]


def decode(session, steps, before_break=None):
    """The outputs of every step; before_break() runs before step BREAK_AT."""
    outputs = []
    for i, step in enumerate(steps):
        if i == BREAK_AT and before_break is not None:
            before_break()
        outputs.append(np.array(session.step(step).output))
    return outputs


class PythonReplayTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.reference_server = Server("--model-repository", MODELS)
        cls.reference = attention_client.AttentionClient(cls.reference_server.address)

    @classmethod
    def tearDownClass(cls):
        cls.reference.close()
        cls.reference_server.stop()

    def server(self, *flags, address="127.0.0.1:0"):
        server = Server("--model-repository", MODELS, *flags, address=address)
        self.addCleanup(lambda: server.process.poll() is not None or server.stop())
        return server

    def uninterrupted(self, steps, **options):
        with self.reference.session(MODEL, **options) as session:
            return decode(session, steps)

    def assert_same_decode(self, outputs, expected):
        self.assertEqual(len(outputs), len(expected))
        for i, (output, want) in enumerate(zip(outputs, expected)):
            np.testing.assert_allclose(output, want, atol=1e-4, err_msg=f"step {i}")

    def kill_and_restart(self, server):
        """kill -9 `server`, then a new one on its port (self.restarted): the
        same target."""
        def restart():
            server.stop(signal.SIGKILL)
            self.restarted = self.server(address=server.address)
        return restart

    def test_kill_9_mid_decode_replays_once_on_the_restarted_server(self):
        steps = rows(batch=2, seed=1)  # B = 2: the kept rows are sliced per example
        server = self.server()
        with attention_client.AttentionClient(server.address) as client:
            with client.session(MODEL, batch=2) as session:
                outputs = decode(session, steps, self.kill_and_restart(server))
                self.assertEqual(session.replays, 1)
                self.assertEqual(session.length, 3 + STEPS - 1)
                self.assertEqual(self.restarted.metric("attention_sessions_open"), 1)
        self.assert_same_decode(outputs, self.uninterrupted(steps, batch=2))

    def test_sigterm_moves_the_session_to_the_other_server_of_the_target(self):
        steps = rows(batch=1, seed=2)
        servers = [self.server("--shutdown-grace-seconds", "1") for _ in range(2)]
        target = ",".join(server.address for server in servers)
        with attention_client.AttentionClient(target) as client:
            with client.session(MODEL) as session:
                holder = [s for s in servers if s.metric("attention_sessions_open") == 1]
                self.assertEqual(len(holder), 1)
                # The stopped server ends the session with UNAVAILABLE once its
                # grace runs out (section 11.5) and exits; then the step.
                outputs = decode(session, steps, lambda: holder[0].stop(signal.SIGTERM))
                self.assertEqual(session.replays, 1)
        other = [s for s in servers if s is not holder[0]][0]
        self.assertEqual(other.metric("attention_sessions_opened_total"), 1)
        self.assert_same_decode(outputs, self.uninterrupted(steps))

    def test_cross_memory_is_replayed_from_its_opening(self):
        rng = np.random.default_rng(3)
        keys, values = rng.uniform(-1, 1, (1, 5, 5)), rng.uniform(-1, 1, (1, 5, 3))
        steps = [rng.uniform(-1, 1, (1, 1, 6)).astype(np.float32) for _ in range(STEPS)]
        memory = dict(memory="cross", keys=keys, values=values, valid_lens=[4])
        server = self.server()
        with attention_client.AttentionClient(server.address) as client:
            with client.session("additive_small", **memory) as session:
                outputs = decode(session, steps, self.kill_and_restart(server))
                self.assertEqual(session.replays, 1)
                self.assertEqual(session.length, 5)
        with self.reference.session("additive_small", **memory) as session:
            self.assert_same_decode(outputs, decode(session, steps))

    def test_without_replay_the_break_is_the_streams_error(self):
        server = self.server()
        with attention_client.AttentionClient(server.address) as client:
            with client.session(MODEL, replay=False) as session:
                with self.assertRaises(grpc.RpcError) as broke:
                    decode(session, rows(batch=1, seed=4), self.kill_and_restart(server))
                self.assertNotIsInstance(broke.exception, attention_client.SessionLost)
                self.assertEqual(broke.exception.code(), grpc.StatusCode.UNAVAILABLE)
                self.assertEqual(session.replays, 0)

    def test_rows_past_the_limit_make_the_break_fail_saying_why(self):
        steps = rows(batch=1, seed=5)
        # The prompt (192 bytes) fits; the opening and two more tokens do not.
        limit = 300
        server = self.server()
        with attention_client.AttentionClient(server.address) as client:
            with client.session(MODEL, replay_limit_bytes=limit) as session:
                with self.assertRaises(attention_client.SessionLost) as lost:
                    decode(session, steps, self.kill_and_restart(server))
                self.assertEqual(lost.exception.code(), grpc.StatusCode.UNAVAILABLE)
                self.assertIn(f"replay_limit_bytes={limit}", lost.exception.details())
                self.assertEqual(session.replays, 0)
                with self.assertRaises(ValueError):  # the session is over
                    session.step(steps[-1])


if __name__ == "__main__":
    unittest.main(verbosity=2)
