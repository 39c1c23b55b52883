"""warmup_first_call: what the warm-up (docs/api.md 6.9) saves the first call.

Starts attention-server afresh for each run, with --warmup true and false
alternately, waits until it serves, then sends one model's first calls: a
burst of --concurrency concurrent Attend calls (what a replica meets when
traffic arrives), then the same burst again. Prints, per mode, the median
over runs of the first burst's slowest call and of the second burst's, and
the warm-up time the server logged.

    ATTENTION_SERVER_BIN=build/server/attention-server \\
        build/tests/python-client-venv/bin/python bench/warmup_first_call.py \\
        [--runs 5] [--model mh_torch_e256_h8] [--n 128] [--concurrency 8]
"""

import argparse
import concurrent.futures
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time

import grpc
import numpy as np
from attention_client import pb2, pb2_grpc

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(warmup, threads):
    work = tempfile.TemporaryDirectory()
    ports = os.path.join(work.name, "ports")
    log = open(os.path.join(work.name, "log"), "wb")
    process = subprocess.Popen(
        [os.environ["ATTENTION_SERVER_BIN"], "--address", "127.0.0.1:0", "--metrics-address", "",
         "--http-address", "", "--port-file", ports, "--threads", str(threads),
         "--model-repository", os.path.join(SOURCE_DIR, "models"), "--warmup", warmup],
        stdout=log, stderr=subprocess.STDOUT)
    while not os.path.exists(ports):
        if process.poll() is not None:
            raise RuntimeError("attention-server exited")
        time.sleep(0.02)
    with open(ports) as f:
        address = dict(line.split() for line in f.read().splitlines())["grpc"]
    return work, log, process, address


def burst(stub, request, concurrency):
    """The slowest of `concurrency` concurrent calls, in milliseconds."""
    def call(_):
        begin = time.perf_counter()
        stub.Attend(request, timeout=60)
        return (time.perf_counter() - begin) * 1000

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return max(pool.map(call, range(concurrency)))


def run(warmup, args, request):
    work, log, process, address = start(warmup, args.threads)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb2_grpc.AttentionServiceStub(channel)
            stub.ListModels(pb2.ListModelsRequest(), timeout=10)  # connection up, not a model call
            first = burst(stub, request, args.concurrency)
            second = burst(stub, request, args.concurrency)
        with open(os.path.join(work.name, "log")) as f:
            took = re.search(r"warm-up: \d+ model versions in ([0-9.]+) ms", f.read())
        return first, second, float(took.group(1)) if took else 0.0
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        log.close()
        work.cleanup()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", default="mh_torch_e256_h8")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    data = rng.standard_normal(args.n * args.dim).astype(np.float32)
    request = pb2.AttendRequest(model=args.model, queries=pb2.Tensor(
        shape=[1, args.n, args.dim], data=data.tolist()))
    results = {"true": [], "false": []}
    for _ in range(args.runs):
        for warmup in ("false", "true"):
            results[warmup].append(run(warmup, args, request))
    print(f"model {args.model} [1, {args.n}, {args.dim}], {args.concurrency} concurrent calls, "
          f"--threads {args.threads}, {args.runs} runs (median)")
    for warmup, rows in results.items():
        first, second, took = (statistics.median(column) for column in zip(*rows))
        print(f"--warmup {warmup:5}: first burst {first:7.1f} ms, second burst {second:7.1f} ms, "
              f"warm-up {took:6.1f} ms")


if __name__ == "__main__":
    main()
