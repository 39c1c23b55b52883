#!/usr/bin/python3
"""service_sweep.py: attention-server throughput and latency, batching off and on.

Starts attention-server twice on 127.0.0.1 free ports (port 0 + --port-file),
once with --max-batch-size 1 (batching off) and once batched, drives each with
`attention-client bench`, and writes every measured point with its setup to a
JSON file that bench/plot_service.py draws. Both servers live for the whole run
and are measured alternately, point by point, so a change in the machine's load
hits both modes alike and their ratio stays fair.

Two parts:

  sweep     closed loop at concurrency 1, 2, ..., 128 for three requests:
            small (multi_head E=256 H=8, B=1, n=32), large (same model,
            B=8, n=128) and trivial (dot_product B=1, n=1, d=1: the gRPC
            transport ceiling).
  batching  the small request at concurrency 64: batching off against a few
            batched settings (--max-batch-size, --max-queue-delay-us), in
            rounds; a setting's peak is its median round. Then batching off
            and the best batched setting in open loop at 50% of their peaks.

Next to the client's throughput and latency, each point records, from the
server's /metrics and the kernel: the mean batch size, the mean time a request
waited in the batching queue, and the CPU time per answered request of the
server and of the client (they share this machine's cores).

  /usr/bin/python3 bench/service_sweep.py --build build sweep
  /usr/bin/python3 bench/service_sweep.py --build build batching
"""
import argparse
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request

import bench_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")

WORKLOADS = {
    "small": {"model": "mh_torch_e256_h8", "batch": 1, "n": 32, "dim": 256},
    "large": {"model": "mh_torch_e256_h8", "batch": 8, "n": 128, "dim": 256},
    "trivial": {"model": "dot_product", "batch": 1, "n": 1, "dim": 1},
}
OFF = ["--max-batch-size", "1"]


def batched(max_batch_size, delay_us):
    return ["--max-batch-size", str(max_batch_size), "--max-queue-delay-us", str(delay_us)]


def machine():
    """The CPU model and core count, as lscpu reports them."""
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return {
        "cpu": fields.get("Model name", platform.processor()),
        "cpus": int(fields.get("CPU(s)", os.cpu_count())),
        "hypervisor": fields.get("Hypervisor vendor", ""),
        "kernel": platform.release(),
    }


def git_commit():
    result = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True)
    return result.stdout.strip()


def loadavg():
    return [round(x, 2) for x in os.getloadavg()]


class Server:
    """One attention-server on 127.0.0.1 free ports, stopped with SIGTERM."""

    def __init__(self, binary, args):
        self.args = args
        self._process, addresses = bench_server.start(
            binary, os.path.join(REPO, "models"),
            ["--http-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0",
             "--log-level", "warn", *args], stdout=None, stderr=None, timeout=30)
        self.target = addresses["grpc"]
        self.metrics_url = f"http://{addresses['metrics']}/metrics"

    def cpu_seconds(self):
        """CPU time so far: of the whole process, and of its gRPC threads.

        The threads named after the binary (the main thread, the batchers,
        which compute and answer, and the engine's pool) live as long as the
        server; the rest are gRPC's, which come and go, so their time is the
        process's (which keeps the time of ended threads) less the former.
        """
        def seconds(stat_path):
            with open(stat_path) as f:
                # After the parenthesised name, utime and stime are fields 14 and 15.
                name, fields = f.read().split("(", 1)[1].rsplit(")", 1)
            fields = fields.split()
            return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        _, total = seconds(f"/proc/{self._process.pid}/stat")
        ours = 0.0
        tasks = f"/proc/{self._process.pid}/task"
        for tid in os.listdir(tasks):
            try:
                name, thread = seconds(f"{tasks}/{tid}/stat")
            except FileNotFoundError:  # a gRPC thread that just ended
                continue
            if name.startswith("attention-serv"):
                ours += thread
        return total, total - ours

    def metrics(self):
        """Sums and counts of the histograms, and the answered requests, per metric name."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        values = {}
        for line in text.splitlines():
            match = re.match(r"^(attention_\w+?(?:_sum|_count|_total))(\{[^}]*\})? (\S+)$", line)
            if match:
                name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
                model = re.search(r'model="([^"]*)"', labels)
                key = (name, model.group(1) if model else "")
                values[key] = values.get(key, 0.0) + value
        return values

    def stop(self):
        bench_server.stop(self._process, timeout=30)


def client_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench(client, server, workload, duration, warmup, concurrency=None, rate=None):
    """One `attention-client bench` run, with the server-side view of it."""
    shape = WORKLOADS[workload]
    load = ["--concurrency", str(concurrency)] if rate is None else ["--rate", f"{rate:.1f}"]
    command = [client, "--target", server.target, "bench", "--model", shape["model"],
               "--batch", str(shape["batch"]), "--n", str(shape["n"]), "--dim", str(shape["dim"]),
               *load, "--duration", str(duration), "--warmup", str(warmup), "--json"]
    before, server_cpu, client_cpu = server.metrics(), server.cpu_seconds(), client_cpu_seconds()
    load_before = loadavg()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited with {result.returncode}: {result.stderr}")
    point = json.loads(result.stdout)
    server_cpu, grpc_cpu = (after - before for after, before in zip(server.cpu_seconds(), server_cpu))
    client_cpu = client_cpu_seconds() - client_cpu
    after = server.metrics()

    def delta(name):
        key = (name, shape["model"])
        return after.get(key, 0.0) - before.get(key, 0.0)

    # Over warm-up and measurement alike: the server cannot tell them apart.
    answered = delta("attention_request_duration_seconds_count")
    batches = delta("attention_batch_size_count")
    point.update({
        "workload": workload,
        "server_args": server.args,
        "loadavg_before": load_before,
        "server_answered": int(answered),
        "mean_batch_size": delta("attention_batch_size_sum") / batches if batches else None,
        "mean_queue_ms": 1e3 * delta("attention_queue_duration_seconds_sum") / answered if answered else None,
        "mean_compute_ms": 1e3 * delta("attention_compute_duration_seconds_sum") / answered if answered else None,
        "server_cpu_us_per_request": 1e6 * server_cpu / answered if answered else None,
        "server_grpc_threads_cpu_us_per_request": 1e6 * grpc_cpu / answered if answered else None,
        "client_cpu_us_per_request": 1e6 * client_cpu / answered if answered else None,
    })
    return point


def describe(point):
    mode = "off" if point["server_args"] == OFF else " ".join(point["server_args"])
    load = f"c={point['concurrency']}" if "concurrency" in point else f"rate={point['rate_rps']:.0f}"
    batch = point["mean_batch_size"]
    return (f"{point['workload']:8} {load:10} {mode:45} {point['throughput_rps']:9.1f} rps  "
            f"p50 {point['latency_ms']['p50']:8.3f} ms  p99 {point['latency_ms']['p99']:8.3f} ms  "
            f"batch {batch if batch is None else round(batch, 1)}  "
            f"cpu/req server {point['server_cpu_us_per_request'] or 0:.0f} us "
            f"(gRPC threads {point['server_grpc_threads_cpu_us_per_request'] or 0:.0f} us) "
            f"client {point['client_cpu_us_per_request'] or 0:.0f} us  "
            f"errors {point['errors']}  load {point['loadavg_before'][0]}")


def run_sweep(args, client, servers):
    off, on = servers
    points = []
    for workload in args.workloads:
        for i, concurrency in enumerate(args.concurrency):
            # Alternate which mode goes first, so neither always follows the other.
            for server in (off, on) if i % 2 == 0 else (on, off):
                point = bench(client, server, workload, args.duration, args.warmup,
                              concurrency=concurrency)
                print(describe(point), flush=True)
                points.append(point)
    return {"points": points}


def run_batching(args, client, server_binary):
    """The batched peak against the unbatched one, then open loop at 50%."""
    candidates = [OFF] + [batched(size, delay) for size, delay in args.candidates]
    servers = [Server(server_binary, c) for c in candidates]
    try:
        closed = []
        for round_ in range(args.rounds):
            order = servers if round_ % 2 == 0 else list(reversed(servers))
            for server in order:
                point = bench(client, server, "small", args.duration, args.warmup,
                              concurrency=args.peak_concurrency)
                point["round"] = round_
                print(describe(point), flush=True)
                closed.append(point)

        # The median round: the best one can be a moment when the machine's
        # other load paused, and half of it then overloads the server.
        def peak(server):
            return statistics.median(p["throughput_rps"] for p in closed
                                     if p["server_args"] == server.args)

        best = max(servers[1:], key=peak)
        open_loop = []
        for server in (servers[0], best):
            rate = 0.5 * peak(server)
            point = bench(client, server, "small", args.open_duration, args.warmup, rate=rate)
            print(describe(point), flush=True)
            open_loop.append(point)
        return {
            "peak_concurrency": args.peak_concurrency,
            "closed_loop": closed,
            "peak_rps": {" ".join(s.args): peak(s) for s in servers},
            "best_batched_args": best.args,
            "speedup": peak(best) / peak(servers[0]),
            "open_loop_half_peak": open_loop,
        }
    finally:
        for server in servers:
            server.stop()


def pairs(text):
    return [tuple(int(x) for x in item.split(":")) for item in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(REPO, "build"),
                        help="build directory holding server/attention-server and client/attention-client")
    parser.add_argument("--duration", type=float, default=3, help="seconds measured per point")
    parser.add_argument("--warmup", type=float, default=1, help="seconds of warm-up per point")
    parser.add_argument("--output", help="JSON file written (default bench/results/service_<part>.json)")
    parts = parser.add_subparsers(dest="part", required=True)
    sweep = parts.add_parser("sweep", help="concurrency sweep, batching off and on")
    sweep.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                       default=[1, 2, 4, 8, 16, 32, 64, 128])
    sweep.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS))
    sweep.add_argument("--batched", type=lambda s: pairs(s)[0], default=(64, 1000),
                       metavar="SIZE:DELAY_US", help="batched server's settings (default 64:1000)")
    batching = parts.add_parser("batching", help="batched peak and latency at 50%% of it")
    batching.add_argument("--candidates", type=pairs, default=pairs("32:500,64:0,64:1000,64:4000"),
                          metavar="SIZE:DELAY_US,...", help="batched settings compared with batching off")
    batching.add_argument("--peak-concurrency", type=int, default=64)
    batching.add_argument("--rounds", type=int, default=3)
    batching.add_argument("--open-duration", type=float, default=5,
                          help="seconds measured in open loop (more answers for the p99)")
    args = parser.parse_args()

    server_binary = os.path.join(args.build, "server", "attention-server")
    client = os.path.join(args.build, "client", "attention-client")
    for binary in (server_binary, client):
        if not os.access(binary, os.X_OK):
            sys.exit(f"{binary} not found: build attention-server and attention-client first")

    report = {
        "command": shlex.join(["/usr/bin/python3", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "machine": machine(),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "workloads": WORKLOADS,
        "loadavg_start": loadavg(),
    }
    print(f"load average at start: {report['loadavg_start']}", flush=True)
    if args.part == "sweep":
        on_args = batched(*args.batched)
        servers = [Server(server_binary, OFF), Server(server_binary, on_args)]
        try:
            report.update({"batching_off_args": OFF, "batching_on_args": on_args})
            report.update(run_sweep(args, client, servers))
        finally:
            for server in servers:
                server.stop()
    else:
        report.update(run_batching(args, client, server_binary))
        print(f"speedup {report['speedup']:.2f}x with {' '.join(report['best_batched_args'])}")
    report["loadavg_end"] = loadavg()
    output = args.output or os.path.join(RESULTS, f"service_{args.part}.json")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(f"load average at end: {report['loadavg_end']}; wrote {output}")


if __name__ == "__main__":
    main()
