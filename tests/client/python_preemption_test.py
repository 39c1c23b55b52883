"""python_preemption_test: more decoding sessions than the session memory
holds, through the Python client (docs/api.md sections 11.4 and 11.6).
A real attention-server whose --session-memory-bytes fits POOL_SESSIONS
dot_product sessions of a PROMPT-token prompt and STEPS single-token steps;
SESSIONS of them decode at once, one thread each. The server preempts
sessions to make room and their clients replay them: every step succeeds,
every decode step's output equals causal attention over the session's rows
(float64 numpy) within 1e-4, and preemptions are counted in
attention_sessions_ended_total{reason="preempted"} and in the sessions'
`replays`.

    ATTENTION_SERVER_BIN=build/server/attention-server \
        build/tests/python-client-venv/bin/python tests/client/python_preemption_test.py

The sizes come from the environment, so the same scenario runs at full size:
PREEMPTION_SESSIONS=24 PREEMPTION_PROMPT=4096 PREEMPTION_WIDTH=1024
PREEMPTION_STEPS=128 PREEMPTION_POOL_SESSIONS=8 (it prints its time and
figures).
"""

import math
import os
import threading
import time
import unittest

import attention_client
import numpy as np

from python_test import Server

SESSIONS = int(os.environ.get("PREEMPTION_SESSIONS", "24"))
PROMPT = int(os.environ.get("PREEMPTION_PROMPT", "512"))
WIDTH = int(os.environ.get("PREEMPTION_WIDTH", "64"))
STEPS = int(os.environ.get("PREEMPTION_STEPS", "32"))
POOL_SESSIONS = int(os.environ.get("PREEMPTION_POOL_SESSIONS", "8"))
BLOCK_ROWS = 64  # core/sessions/session.h's kKvBlockRows


def session_bytes():
    """What one whole session holds: a dot_product session's rows are its
    keys and values, held once, in blocks of BLOCK_ROWS rows."""
    return math.ceil((PROMPT + STEPS) / BLOCK_ROWS) * BLOCK_ROWS * WIDTH * 4


def expected_output(tokens, t):
    """Causal dot_product attention of row t over rows 0..t, in float64."""
    keys = tokens[: t + 1].astype(np.float64)
    scores = keys @ keys[t] / math.sqrt(WIDTH)
    weights = np.exp(scores - scores.max())
    return (weights / weights.sum()) @ keys


class PythonPreemptionTest(unittest.TestCase):
    def test_more_sessions_than_the_pool_holds_all_decode_exactly(self):
        server = Server("--session-memory-bytes", str(POOL_SESSIONS * session_bytes()))
        self.addCleanup(server.stop)
        client = attention_client.AttentionClient(server.address)
        self.addCleanup(client.close)
        rows = [np.random.default_rng(seed).uniform(-1, 1, (PROMPT + STEPS, WIDTH))
                .astype(np.float32) for seed in range(SESSIONS)]
        outputs = [None] * SESSIONS
        replays = [0] * SESSIONS
        errors = []

        def decode(i):
            try:
                with client.session("dot_product") as session:
                    session.step(rows[i][None, :PROMPT])
                    outputs[i] = [np.array(session.step(rows[i][None, t: t + 1]).output)[0, 0]
                                  for t in range(PROMPT, PROMPT + STEPS)]
                    replays[i] = session.replays
            except Exception as error:  # every failure is reported, not only the first
                errors.append(f"session {i}: {error!r}")

        start = time.monotonic()
        threads = [threading.Thread(target=decode, args=(i,)) for i in range(SESSIONS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - start
        self.assertEqual(errors, [])

        worst = 0.0
        for i in range(SESSIONS):
            for step, t in enumerate(range(PROMPT, PROMPT + STEPS)):
                difference = np.max(np.abs(outputs[i][step] - expected_output(rows[i], t)))
                worst = max(worst, float(difference))
                self.assertLessEqual(difference, 1e-4, f"session {i}, step {step}")
        preempted = server.metric("attention_sessions_ended_total", reason="preempted") or 0
        print(f"{SESSIONS} sessions of a {PROMPT}-token prompt, E={WIDTH}, {STEPS} steps each, "
              f"a pool for {POOL_SESSIONS}: {elapsed:.1f} s, {preempted:.0f} preempted, "
              f"{sum(replays)} replays, max |diff| {worst:.2e}", flush=True)
        self.assertGreater(preempted, 0)
        self.assertGreater(sum(replays), 0)
        self.assertLessEqual(sum(replays), preempted)


if __name__ == "__main__":
    unittest.main()
