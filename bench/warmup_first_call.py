"""warmup_first_call: what the warm-up (docs/api.md 6.9) saves the first call.

Starts attention-server afresh for each run, with --warmup true and false
alternately, waits until it serves, then sends one model's first calls: a
burst of --concurrency concurrent Attend calls (what a replica meets when
traffic arrives), then the same burst again, then --steady bursts more.
Per mode it prints the median over runs of the first burst's slowest call
and of the second burst's, the warm-up time the server logged, and what
the server itself spent, read around each burst: its compute
(attention_compute_duration_seconds, the mean over the burst's requests),
its CPU time (user + sys of the process) and its page faults. The first
burst's ratio to the steady state (the median of the bursts after the
second) is printed per run, then its median: the first-call penalty that
compute time and CPU time show, with less noise than a client's clock on a
loaded host.

    ATTENTION_SERVER_BIN=build/server/attention-server \\
        build/tests/python-client-venv/bin/python bench/warmup_first_call.py \\
        [--runs 5] [--model mh_torch_e256_h8] [--batch 16] [--n 128] [--concurrency 1]
"""

import argparse
import concurrent.futures
import os
import re
import statistics
import subprocess
import tempfile
import time
import urllib.request

import grpc
import numpy as np
from attention_client import pb2, pb2_grpc

import bench_server

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def start(warmup, threads, extra):
    work = tempfile.TemporaryDirectory()
    log = open(os.path.join(work.name, "log"), "wb")
    process, addresses = bench_server.start(
        os.environ["ATTENTION_SERVER_BIN"], os.path.join(SOURCE_DIR, "models"),
        ["--metrics-address", "127.0.0.1:0", "--http-address", "", "--threads", str(threads),
         "--warmup", warmup, *extra], stdout=log, stderr=subprocess.STDOUT)
    return work, log, process, addresses


class ServerCounters:
    """The server's compute histogram for one model, CPU time and page faults."""

    def __init__(self, pid, metrics_address, model):
        self.pid = pid
        self.url = f"http://{metrics_address}/metrics"
        self.model = model

    def batcher_faults(self):
        """Minor faults of the batcher threads ("batch:<model>"), where requests compute."""
        faults = 0
        for task in os.listdir(f"/proc/{self.pid}/task"):
            try:
                with open(f"/proc/{self.pid}/task/{task}/stat") as f:
                    name, fields = f.read().split("(", 1)[1].rsplit(")", 1)
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
            if name.startswith("batch:"):
                faults += int(fields.split()[7])
        return faults

    def read(self):
        """(compute seconds summed, requests computed, CPU seconds, minor faults,
        the batcher threads' minor faults)."""
        with urllib.request.urlopen(self.url, timeout=10) as answer:
            text = answer.read().decode()
        label = f'model="{self.model}"'
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith("attention_compute_duration_seconds_sum") and label in line:
                total = float(line.split()[-1])
            elif line.startswith("attention_compute_duration_seconds_count") and label in line:
                count = float(line.split()[-1])
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # After the command: minflt is field 10, utime 14 and stime 15 (1-based).
        minflt, utime, stime = int(fields[7]), int(fields[11]), int(fields[12])
        return total, count, (utime + stime) / CLOCK_TICKS, minflt, self.batcher_faults()


def burst(stub, request, concurrency, counters):
    """The slowest of `concurrency` concurrent calls (ms), and the server's
    mean compute per request (ms), CPU time (ms), page faults and its batcher
    threads' page faults over them."""
    def call(_):
        begin = time.perf_counter()
        stub.Attend(request, timeout=60)
        return (time.perf_counter() - begin) * 1000

    before = counters.read()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        slowest = max(pool.map(call, range(concurrency)))
    after = counters.read()
    computed = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1000
    return (slowest, computed, (after[2] - before[2]) * 1000, after[3] - before[3],
            after[4] - before[4])


def run(warmup, args, request):
    work, log, process, addresses = start(warmup, args.threads, args.server_flag)
    try:
        counters = ServerCounters(process.pid, addresses["metrics"], args.model)
        with grpc.insecure_channel(addresses["grpc"]) as channel:
            stub = pb2_grpc.AttentionServiceStub(channel)
            stub.ListModels(pb2.ListModelsRequest(), timeout=10)  # connection up, not a model call
            bursts = [burst(stub, request, args.concurrency, counters)
                      for _ in range(2 + args.steady)]
        with open(os.path.join(work.name, "log")) as f:
            took = re.search(r"warm-up: \d+ model versions in ([0-9.]+) ms", f.read())
        steady = [statistics.median(column) for column in zip(*bursts[2:])]
        return {"first": bursts[0][0], "second": bursts[1][0],
                "took": float(took.group(1)) if took else 0.0,
                "compute": bursts[0][1], "steady_compute": steady[1],
                "compute_ratio": bursts[0][1] / steady[1],
                "cpu_ratio": bursts[0][2] / steady[2] if steady[2] > 0 else float("nan"),
                "faults": bursts[0][3], "steady_faults": steady[3],
                "batcher_faults": bursts[0][4], "steady_batcher_faults": steady[4]}
    finally:
        bench_server.stop(process, timeout=60)
        log.close()
        work.cleanup()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", default="mh_torch_e256_h8")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steady", type=int, default=8,
                        help="bursts after the second whose medians are the steady state")
    parser.add_argument("--modes", default="false,true", help="--warmup values to alternate")
    parser.add_argument("--server-flag", action="append", default=[],
                        help="one more argument for attention-server (repeat for more)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    data = rng.standard_normal(args.batch * args.n * args.dim).astype(np.float32)
    request = pb2.AttendRequest(model=args.model, queries=pb2.Tensor(
        shape=[args.batch, args.n, args.dim], data=data.tolist()))
    modes = args.modes.split(",")
    results = {warmup: [] for warmup in modes}
    for round_index in range(args.runs):
        for warmup in modes:
            r = run(warmup, args, request)
            results[warmup].append(r)
            print(f"run {round_index + 1} --warmup {warmup:5}: first call's compute "
                  f"{r['compute']:6.1f} ms, steady {r['steady_compute']:6.1f} ms, "
                  f"ratio {r['compute_ratio']:4.2f}; server CPU ratio {r['cpu_ratio']:4.2f}; "
                  f"page faults {r['faults']:6d} against {r['steady_faults']:6.0f} "
                  f"(batcher thread {r['batcher_faults']:5d} against "
                  f"{r['steady_batcher_faults']:4.0f})", flush=True)
    print(f"model {args.model} [{args.batch}, {args.n}, {args.dim}], {args.concurrency} "
          f"concurrent calls, --threads {args.threads}, {args.runs} runs (median), "
          f"load average {os.getloadavg()[0]:.1f}")
    for warmup, rows in results.items():
        median = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        ratios = ", ".join(f"{row['compute_ratio']:.2f}" for row in rows)
        print(f"--warmup {warmup:5}: first burst {median['first']:7.1f} ms, second burst "
              f"{median['second']:7.1f} ms, warm-up {median['took']:6.1f} ms; first call's "
              f"compute / steady {median['compute_ratio']:4.2f} "
              f"({ratios}), "
              f"server CPU / steady {median['cpu_ratio']:4.2f}, page faults "
              f"{median['faults']:.0f} against {median['steady_faults']:.0f} (batcher thread "
              f"{median['batcher_faults']:.0f} against {median['steady_batcher_faults']:.0f})")


if __name__ == "__main__":
    main()
