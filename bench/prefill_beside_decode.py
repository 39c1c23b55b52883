#!/usr/bin/python3
"""prefill_beside_decode: decoders' latency beside a long prompt (chunked prefill), in one run.

16 sessions decode one token a step (AttendSession, E=1024, 16 heads, the
torch-layout model of bench/make_service_model.py) while another session
sends a 4,096-token prompt in one step beside them. Prints, per round and as
medians over the rounds:

  - the decode steps' p99 latency in a steady window before the prompt, and
    over the steps that began while it was prefilled, and their ratio
    (target: <= 2x);
  - the prompt's time beside the decoders against its time alone, with no
    other session (target: within 1.3x).

Each decode session opens with a short prompt of its own (--context tokens)
and reopens every round, so rounds see the same lengths. Uses raw stubs
generated from proto/attention/v1/attention.proto with Debian's protoc, so
it runs on Debian's python3 (no virtual environment):

    env -u OPENBLAS_CORETYPE /usr/bin/python3 bench/prefill_beside_decode.py \\
      --server build/server/attention-server [--rounds 3] [-- --chunk-work N]

Arguments after `--` go to the server.
"""
import argparse
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_server  # noqa: E402
from session_decode import start_server  # noqa: E402

E, HEADS = 1024, 16
MODEL = f"mh_torch_e{E}_h{HEADS}"


def attention_pb(directory):
    """attention.v1's messages and stubs, generated into `directory` by Debian's
    protoc and grpc_python_plugin (grpc_tools' older protoc refuses proto3
    `optional`)."""
    subprocess.run(["protoc", "-I", os.path.join(ROOT, "proto"), f"--python_out={directory}",
                    f"--grpc_python_out={directory}",
                    "--plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin",
                    "attention/v1/attention.proto"], check=True)
    sys.path.insert(0, directory)
    from attention.v1 import attention_pb2, attention_pb2_grpc
    return attention_pb2, attention_pb2_grpc


class Session:
    """One AttendSession stream: open, then one step at a time."""

    def __init__(self, pb, stub, timeout=600):
        self.pb = pb
        self.requests = queue.Queue()
        self.responses = stub.AttendSession(iter(self.requests.get, None), timeout=timeout)
        self.send(pb.SessionRequest(open=pb.SessionOpen(model=MODEL)))

    def send(self, request):
        self.requests.put(request)
        response = next(self.responses)
        if response.HasField("error"):
            raise RuntimeError(f"session error {response.error.code}: {response.error.message}")
        return response

    def step(self, rows):
        tensor = self.pb.Tensor(shape=list(rows.shape), data=rows.ravel())
        return self.send(self.pb.SessionRequest(step=self.pb.SessionStep(queries=tensor)))

    def close(self):
        self.requests.put(None)
        for _ in self.responses:
            pass


def rows(rng, n):
    return rng.uniform(-1, 1, (1, n, E)).astype(np.float32)


def prefill_child(address, directory, n, pipe):
    """The prompt's client, in a process of its own so that building and
    reading its 16 MB messages never holds the decoders' interpreter lock:
    for each count received on `pipe`, a new session's step of that many
    prompt tokens, answered with its (begin, end) on the monotonic clock
    every process shares."""
    import grpc
    sys.path.insert(0, directory)
    from attention.v1 import attention_pb2, attention_pb2_grpc
    channel = grpc.insecure_channel(address, [("grpc.max_receive_message_length", -1),
                                              ("grpc.max_send_message_length", -1)])
    stub = attention_pb2_grpc.AttentionServiceStub(channel)
    prompt = rows(np.random.default_rng(34), n)
    while (count := pipe.recv()) is not None:
        session = Session(attention_pb2, stub)
        begin = time.perf_counter()
        session.step(prompt[:, :count])
        end = time.perf_counter()
        session.close()
        pipe.send((begin, end))


def prefill(pipe, count):
    """(begin, end) of one prompt step of `count` tokens, by prefill_child."""
    pipe.send(count)
    return pipe.recv()


def decoder(pb, stub, context, stop, steps, ready):
    """Decodes until `stop`, appending (begin, end) of every step to `steps`."""
    rng = np.random.default_rng(threading.get_ident() % 2**32)
    session = Session(pb, stub)
    session.step(rows(rng, context))
    ready.release()
    token = rows(rng, 1)
    while not stop.is_set():
        begin = time.perf_counter()
        session.step(token)
        steps.append((begin, time.perf_counter()))
    session.close()


def p99(latencies):
    return float(np.percentile(latencies, 99)) if latencies else float("nan")


def one_round(pb, stub, args, pipe):
    """Steady p99, p99 while the prompt is prefilled, and the prefill's time."""
    stop, ready = threading.Event(), threading.Semaphore(0)
    steps = [[] for _ in range(args.sessions)]
    threads = [threading.Thread(target=decoder, args=(pb, stub, args.context, stop, steps[s], ready))
               for s in range(args.sessions)]
    for thread in threads:
        thread.start()
    for _ in threads:
        ready.acquire()
    time.sleep(args.warmup)
    steady_begin = time.perf_counter()
    time.sleep(args.steady)
    steady_end = time.perf_counter()
    prefill_begin, prefill_end = prefill(pipe, args.prompt)
    time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join()
    everything = [s for per in steps for s in per]
    steady = [e - b for b, e in everything if b >= steady_begin and e <= steady_end]
    during = [e - b for b, e in everything if prefill_begin <= b < prefill_end]
    return p99(steady), p99(during), prefill_end - prefill_begin, len(steady), len(during)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.path.join(ROOT, "build/server/attention-server"))
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--steady", type=float, default=3.0)
    args, server_flags = parser.parse_known_args()
    server_flags = [f for f in server_flags if f != "--"]
    import grpc
    with tempfile.TemporaryDirectory() as directory:
        pb, pb_grpc = attention_pb(directory)
        process, address = start_server(args.server, directory, server_flags, E, HEADS)
        try:
            channel = grpc.insecure_channel(address, [("grpc.max_receive_message_length", -1),
                                                      ("grpc.max_send_message_length", -1)])
            stub = pb_grpc.AttentionServiceStub(channel)
            spawn = multiprocessing.get_context("spawn")
            pipe, child_pipe = spawn.Pipe()
            child = spawn.Process(target=prefill_child,
                                  args=(address, directory, args.prompt, child_pipe))
            child.start()
            try:
                report(pb, stub, args, server_flags, pipe)
            finally:
                pipe.send(None)
                child.join()
        finally:
            bench_server.stop(process)


def report(pb, stub, args, server_flags, pipe):
    print(f"server flags {' '.join(server_flags) or '(defaults)'}; {args.sessions} sessions "
          f"decoding (context {args.context}) beside a {args.prompt}-token prompt, {MODEL}; "
          f"load {open('/proc/loadavg').read().split()[0]} at start", flush=True)
    prefill(pipe, 256)  # first-call costs
    results = []
    for r in range(args.rounds):
        begin, end = prefill(pipe, args.prompt)
        alone = end - begin
        steady, during, beside, n_steady, n_during = one_round(pb, stub, args, pipe)
        results.append((steady, during, alone, beside))
        print(f"round {r + 1}: decode p99 steady {steady * 1e3:7.1f} ms ({n_steady} steps), "
              f"during prefill {during * 1e3:7.1f} ms ({n_during} steps): {during / steady:5.2f}x;"
              f"  prefill alone {alone:6.3f} s, beside {beside:6.3f} s: {beside / alone:5.2f}x;"
              f"  load {open('/proc/loadavg').read().split()[0]}", flush=True)
    med = [statistics.median(x[i] for x in results) for i in range(4)]
    ratios = [statistics.median(x[1] / x[0] for x in results),
              statistics.median(x[3] / x[2] for x in results)]
    print(f"median: decode p99 steady {med[0] * 1e3:.1f} ms, during prefill {med[1] * 1e3:.1f} ms "
          f"({ratios[0]:.2f}x, target <= 2x); prefill alone {med[2]:.3f} s, beside {med[3]:.3f} s "
          f"({ratios[1]:.2f}x, target <= 1.3x)")


if __name__ == "__main__":
    main()
