"""workload: what the replica-set tests (run_sh_test.py, netns_test.py) send
through the edge, and how they read the replicas' and the edge's metrics.

  Load(address, threads=8, timeout=10)   closed-loop small Attend calls from
                                          threads sharing one client (one
                                          connection), every call recorded
  triton_sequences(address, ...)          Triton-style sequences of unary
                                          ModelInfer steps, with or without
                                          the attention-sequence-id header
  paced_sequences(address, ...)           the same, paced, with their outputs
                                          and a hook before each step
  SequenceLoad(address, ...)              threads opening sequences of a few
                                          seconds back to back, each recorded
  session_decodes(address, ...)           AttendSession decodes, step by step
  metrics(address) / edge_servers(address)  Prometheus text, parsed

The Python client is the package client/python (the python_client fixture's
environment); the Open Inference Protocol stubs are those
tests/server/inference_python_test.py generates.
"""

import os
import re
import sys
import threading
import time
import urllib.request
from typing import NamedTuple

import grpc
import numpy as np
from attention_client import AttentionClient

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQUENCE_HEADER = "attention-sequence-id"
# The Open Inference Protocol stubs, generated as that suite does at import.
sys.path.insert(0, os.path.join(TESTS, "server"))
from inference_python_test import pb, pb_grpc  # noqa: E402


# --- metrics --------------------------------------------------------------

def metrics(address, timeout=5):
    """{(name, frozenset(labels)): value} of a Prometheus endpoint."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if match:
            labels = frozenset(re.findall(r'([a-zA-Z_]+)="([^"]*)"', match.group(2) or ""))
            samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def metric_sum(samples, name, **labels):
    return sum(v for (n, ls), v in samples.items()
               if n == name and all((k, str(w)) in ls for k, w in labels.items()))


def served_calls(metrics_address):
    """Attend calls a replica answered OK (its own counter), or None if it
    cannot be read (gone, frozen)."""
    try:
        return metric_sum(metrics(metrics_address, timeout=2), "attention_requests_total", code="OK")
    except OSError:
        return None


def edge_servers(edge_metrics_address, proxy="attention_http"):
    """{server name: state} as the edge sees its replicas (UP, DOWN, ...)."""
    states = {}
    for (name, labels), value in metrics(edge_metrics_address).items():
        labels = dict(labels)
        if name == "haproxy_server_status" and labels.get("proxy") == proxy and value == 1:
            states[labels["server"]] = labels["state"]
    return states


def wait_until(predicate, seconds, what, step=0.05):
    """The time predicate() first held; raises after `seconds`."""
    give_up = time.monotonic() + seconds
    while True:
        try:
            if predicate():
                return time.monotonic()
        except OSError:
            pass
        if time.monotonic() > give_up:
            raise TimeoutError(f"{what}: not within {seconds} s")
        time.sleep(step)


# --- closed-loop Attend load ----------------------------------------------

class Call(NamedTuple):
    thread: int
    start: float  # time.monotonic()
    end: float
    code: str     # "OK" or the status code's name
    details: str = ""  # a failure's details, for the report


class ClosedLoop:
    """`threads` worker threads running `_run(t)` until stopped, as a context
    manager; `_close()` then frees the load's connection. Subclasses set
    threads, _stop (an Event) and _workers (a list) in their __init__."""

    def __enter__(self):
        for t in range(self.threads):
            worker = threading.Thread(target=self._run, args=(t,), daemon=True)
            worker.start()
            self._workers.append(worker)
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self._stop.set()
        for worker in self._workers:
            worker.join(timeout=60)
        self._workers = []
        self._close()


class Load(ClosedLoop):
    """`threads` threads calling Attend (dot_product, B=1, n=4, d=16) in a
    closed loop through one AttentionClient, hence one HTTP/2 connection to
    the edge, with the client's default retry policy and `timeout` seconds
    per call."""

    def __init__(self, address, threads=8, timeout=10.0):
        self.client = AttentionClient(address, timeout=timeout)
        self.threads = threads
        self.calls = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers = []

    def _close(self):
        self.client.close()

    def _run(self, t):
        queries = np.random.default_rng(t).standard_normal((1, 4, 16), dtype=np.float32)
        while not self._stop.is_set():
            start = time.monotonic()
            details = ""
            try:
                self.client.attend(queries, model="dot_product")
                code = "OK"
            except grpc.RpcError as error:
                code, details = error.code().name, error.details()
            with self._lock:
                self.calls.append(Call(t, start, time.monotonic(), code, details))

    def between(self, t0, t1):
        with self._lock:
            return [c for c in self.calls if t0 <= c.start < t1]

    def count(self):
        with self._lock:
            return len(self.calls)


def failures_report(calls, fault_start):
    """Failed calls of a window: how many, per thread, their codes, the
    details of a few, and how late into the fault the last failed one
    began."""
    failed = [c for c in calls if c.code != "OK"]
    per_thread = {}
    for c in failed:
        per_thread[c.thread] = per_thread.get(c.thread, 0) + 1
    codes = {}
    for c in failed:
        codes[c.code] = codes.get(c.code, 0) + 1
    latest = max((c.start - fault_start for c in failed), default=None)
    details = sorted({f"{c.code}: {c.details}" for c in failed})[:3]
    return {"calls": len(calls), "failed": len(failed), "per_thread": per_thread,
            "codes": codes, "details": details, "latest_start_s": latest}


# --- Triton-style sequences over unary ModelInfer ---------------------------

def triton_sequences(address, count=8, steps=48, header=str, first_id=None, d=16):
    """`count` sequences of `steps` unary ModelInfer steps each (dot_product,
    self memory, one row a step, sequence_id as uint64), one thread per
    sequence over one channel. header(sequence_id) is the value of the
    attention-sequence-id header, or header=None for none. Returns the
    refused steps as (sequence id, step, code, message)."""
    first_id = first_id or int.from_bytes(os.urandom(6), "little") + 1
    refused = []
    lock = threading.Lock()
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    def run(sequence_id):
        rows = np.random.default_rng(sequence_id % (1 << 32)).standard_normal(
            (steps, 1, 1, d), dtype=np.float32)
        metadata = [(SEQUENCE_HEADER, header(sequence_id))] if header else []
        for step in range(steps):
            request = pb.ModelInferRequest(model_name="dot_product")
            request.inputs.add(name="queries", datatype="FP32", shape=[1, 1, d])
            request.raw_input_contents.append(rows[step].tobytes())
            request.parameters["sequence_id"].uint64_param = sequence_id
            if step == 0:
                request.parameters["sequence_start"].bool_param = True
            if step == steps - 1:
                request.parameters["sequence_end"].bool_param = True
            try:
                stub.ModelInfer(request, metadata=metadata, timeout=10)
            except grpc.RpcError as error:
                with lock:
                    refused.append((sequence_id, step, error.code().name, error.details()))

    workers = [threading.Thread(target=run, args=(first_id + i,)) for i in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    channel.close()
    return refused


class SequenceRun(NamedTuple):
    refused: list         # (sequence id, step, code, message, time.monotonic())
    outputs: np.ndarray   # (count, steps, d): each step's output row; NaN where refused
    first_step: float     # time.monotonic() of the first step sent
    last_step: float      # ... and of the last answered


def _sequence_request(sequence_id, row, step, steps):
    request = pb.ModelInferRequest(model_name="dot_product")
    request.inputs.add(name="queries", datatype="FP32", shape=list(row.shape))
    request.raw_input_contents.append(row.tobytes())
    request.parameters["sequence_id"].uint64_param = sequence_id
    if step == 0:
        request.parameters["sequence_start"].bool_param = True
    if step == steps - 1:
        request.parameters["sequence_end"].bool_param = True
    return request


def paced_sequences(address, count=8, steps=48, step_seconds=0.0, seed=1, first_id=None,
                    before_step=None, d=16):
    """`count` sequences of `steps` unary ModelInfer steps (dot_product, self
    memory, one row a step), each with the attention-sequence-id header, one
    thread per sequence over one channel, `step_seconds` apart.
    Sequence i's rows come from `seed` + i (not from its id), so two runs
    with one seed compute the same outputs. before_step(i, step) runs in
    sequence i's thread before each step (a fault, a barrier)."""
    first_id = first_id or int.from_bytes(os.urandom(6), "little") + 1
    refused = []
    outputs = np.full((count, steps, d), np.nan, dtype=np.float32)
    times = []
    lock = threading.Lock()
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.GRPCInferenceServiceStub(channel)

    def run(i):
        sequence_id = first_id + i
        rows = np.random.default_rng(seed + i).standard_normal((steps, 1, 1, d), dtype=np.float32)
        metadata = [(SEQUENCE_HEADER, str(sequence_id))]
        for step in range(steps):
            if before_step:
                before_step(i, step)
            sent = time.monotonic()
            with lock:
                times.append(sent)
            try:
                reply = stub.ModelInfer(_sequence_request(sequence_id, rows[step], step, steps),
                                        metadata=metadata, timeout=10)
                outputs[i, step] = np.frombuffer(reply.raw_output_contents[0],
                                                 dtype=np.float32).reshape(-1)[-d:]
            except grpc.RpcError as error:
                with lock:
                    refused.append((sequence_id, step, error.code().name, error.details(),
                                    time.monotonic()))
            time.sleep(max(0.0, sent + step_seconds - time.monotonic()))

    workers = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    channel.close()
    return SequenceRun(refused, outputs, min(times), time.monotonic())


class Sequence(NamedTuple):
    thread: int
    sequence_id: int
    start: float          # time.monotonic() of its first step
    end: float
    refused: list         # (step, code, message)


class SequenceLoad(ClosedLoop):
    """`threads` threads each opening a Triton sequence of `steps` unary
    ModelInfer steps `step_seconds` apart (with the header), then the next,
    back to back, over one channel, until stopped; every sequence recorded."""

    def __init__(self, address, threads=6, steps=20, step_seconds=0.1, d=16):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.threads, self.steps, self.step_seconds, self.d = threads, steps, step_seconds, d
        self.sequences = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers = []
        self._next_id = int.from_bytes(os.urandom(6), "little") + 1

    def _close(self):
        self.channel.close()

    def _run(self, t):
        rng = np.random.default_rng(t)
        while not self._stop.is_set():
            with self._lock:
                sequence_id = self._next_id
                self._next_id += 1
            metadata = [(SEQUENCE_HEADER, str(sequence_id))]
            refused = []
            start = time.monotonic()
            for step in range(self.steps):
                sent = time.monotonic()
                row = rng.standard_normal((1, 1, self.d), dtype=np.float32)
                try:
                    self.stub.ModelInfer(_sequence_request(sequence_id, row, step, self.steps),
                                         metadata=metadata, timeout=10)
                except grpc.RpcError as error:
                    refused.append((step, error.code().name, error.details()))
                time.sleep(max(0.0, sent + self.step_seconds - time.monotonic()))
            with self._lock:
                self.sequences.append(Sequence(t, sequence_id, start, time.monotonic(), refused))


# --- AttendSession decodes --------------------------------------------------

def session_decodes(address, count=6, steps=96, d=16, seed=7, at_step=None):
    """`count` self-memory dot_product sessions, each given `steps` rows one
    step at a time, in lockstep; at_step(step) runs before each step (a
    fault). Returns (outputs (count, steps, d), errors {session: repr},
    replays [Session.replays or None])."""
    rows = np.random.default_rng(seed).standard_normal((count, steps, 1, 1, d), dtype=np.float32)
    outputs = np.full((count, steps, d), np.nan, dtype=np.float32)
    errors = {}
    with AttentionClient(address, timeout=30) as client:
        sessions = [client.session("dot_product") for _ in range(count)]
        for step in range(steps):
            if at_step:
                at_step(step)
            for s, session in enumerate(sessions):
                if s in errors:
                    continue
                try:
                    outputs[s, step] = session.step(rows[s, step]).output[0, -1]
                except grpc.RpcError as error:
                    errors[s] = f"step {step}: {error.code().name} {error.details()}"
        replays = [getattr(session, "replays", None) for session in sessions]
        for session in sessions:
            session.close()
    return outputs, errors, replays
