#!/usr/bin/python3
"""session_scaling.py: decoding tokens/s of 1 and 64 sessions, the engine alone
and through attention-server, alternating in one run.

The model is bench/make_service_model.py's nn.MultiheadAttention(1024, 16)
(torch layout, fp32). Per round:

  engine   attention-bench decode/sessions:S/E:1024/H:16/prompt:16/steps:64:
           S sessions after a 16-token prompt, then 64 rounds of one
           Engine::RunSteps over a one-token step of every session (the
           engine's continuous batching, no service around it);
  server   `attention-client bench --sessions S --steps-per-session 64`
           against one attention-server (defaults) on 127.0.0.1: S
           AttendSession streams of one-token steps, the server batching the
           steps of all sessions; client and server share the machine's CPUs.

for S in 1 and 64, after two unmeasured server passes of 64 sessions that
warm the fresh server's memory. Reported per S: tokens/s (median over
rounds, and each round's), the server's CPU per token (/proc), the
client's, and the step latency p50 / p99; the server's tokens/s over the
engine's, taken within each round, and its median. --json writes everything; bench/plot_report.py
draws bench/figures/sessions.png from it.

  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 bench/session_scaling.py \\
      [--build build] [--rounds 3] [--json bench/results/sessions.json]

Needs a Release build of attention-bench, attention-server and
attention-client, and python3-torch for the model file.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import bench_server

REPO = pathlib.Path(__file__).resolve().parent.parent
MODEL = "mh_torch_e1024_h16"
SESSIONS = (1, 64)


def machine():
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return (f"{fields.get('Model name', '?')} (family {fields.get('CPU family', '?')} model "
            f"{fields.get('Model', '?')}), {fields.get('CPU(s)', '?')} CPUs")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_round(bench):
    out = subprocess.run(
        [str(bench), "--benchmark_filter=^decode/sessions:(1|64)/E:1024/H:16/prompt:16/",
         "--benchmark_format=json"], check=True, capture_output=True, text=True).stdout
    rows = {}
    for b in json.loads(out)["benchmarks"]:
        sessions = int(b["name"].split("sessions:")[1].split("/")[0])
        rows[sessions] = {"tokens_per_s": b["tokens_per_s"],
                          "cpu_us_per_token": 1e3 * b["cpu_ms_per_request"]}
    return rows


def server_round(client, target, pid, sessions):
    before = cpu_seconds(pid)
    out = subprocess.run([str(client), "--target", target, "bench", "--sessions", str(sessions),
                          "--model", MODEL, "--steps-per-session", "64", "--json"],
                         check=True, capture_output=True, text=True).stdout
    r = json.loads(out)
    r["server_cpu_us_per_token"] = (cpu_seconds(pid) - before) * 1e6 / max(1, r["steps"])
    return r


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=pathlib.Path, default=REPO / "build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    bench = args.build / "bench" / "attention-bench"
    client = args.build / "client" / "attention-client"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    loads = [os.getloadavg()[0]]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as work:
        models = pathlib.Path(work) / "models"
        models.mkdir()
        subprocess.run(["/usr/bin/python3", str(REPO / "bench" / "make_service_model.py"),
                        str(models)], check=True, capture_output=True)
        server, addresses = bench_server.start(
            str(args.build / "server" / "attention-server"), str(models),
            ["--metrics-address", "", "--http-address", ""], env=env, timeout=60)
        try:
            target = addresses["grpc"]
            time.sleep(1)
            # Two passes that are not measured: a fresh server touches some
            # 70 MB of memory for the first time over its first two passes
            # of 64 sessions (about 9,000 page faults each, a fifth of their
            # server CPU on a virtual machine), which steady decoding never
            # pays again.
            for _ in range(2):
                server_round(client, target, server.pid, max(SESSIONS))
            rounds = []
            for index in range(args.rounds):
                engine = engine_round(bench)
                loads.append(os.getloadavg()[0])
                served = {s: server_round(client, target, server.pid, s) for s in SESSIONS}
                loads.append(os.getloadavg()[0])
                rounds.append({"engine": engine, "server": served})
                print(f"round {index + 1}: " + "; ".join(
                    f"{s} sessions: engine {engine[s]['tokens_per_s']:.0f}, server "
                    f"{served[s]['tokens_per_s']:.0f} tokens/s" for s in SESSIONS),
                    file=sys.stderr, flush=True)
        finally:
            bench_server.stop(server)
    summary = {}
    for s in SESSIONS:
        engine = [r["engine"][s]["tokens_per_s"] for r in rounds]
        served = [r["server"][s]["tokens_per_s"] for r in rounds]
        summary[s] = {
            "engine_tokens_per_s": engine,
            "server_tokens_per_s": served,
            "server_over_engine": [b / a for a, b in zip(engine, served)],
            "engine_cpu_us_per_token": statistics.median(r["engine"][s]["cpu_us_per_token"]
                                                         for r in rounds),
            "server_cpu_us_per_token": statistics.median(
                r["server"][s]["server_cpu_us_per_token"] for r in rounds),
            "client_cpu_us_per_token": statistics.median(
                r["server"][s]["client_cpu_us_per_token"] for r in rounds),
            "p50_ms": statistics.median(r["server"][s]["step_latency_ms"]["p50"] for r in rounds),
            "p99_ms": statistics.median(r["server"][s]["step_latency_ms"]["p99"] for r in rounds),
            "errors": sum(r["server"][s]["errors"] for r in rounds),
        }
    result = {"machine": machine(), "started": started, "rounds": args.rounds,
              "load_averages": loads, "model": MODEL,
              "command": "/usr/bin/python3 bench/session_scaling.py " + " ".join(sys.argv[1:]),
              "summary": summary, "per_round": rounds}
    print(f"{result['machine']}; {started}; 1-min load average {min(loads):.1f}-{max(loads):.1f}")
    print("| sessions | engine tokens/s | server tokens/s | server / engine (median of rounds) | "
          "CPU us per token: engine / server / client | step p50 / p99 ms |")
    print("|---:|---:|---:|---:|---|---|")
    for s, r in summary.items():
        print(f"| {s} | {statistics.median(r['engine_tokens_per_s']):,.0f} | "
              f"{statistics.median(r['server_tokens_per_s']):,.0f} | "
              f"{statistics.median(r['server_over_engine']):.2f} | "
              f"{r['engine_cpu_us_per_token']:.0f} / {r['server_cpu_us_per_token']:.0f} / "
              f"{r['client_cpu_us_per_token']:.0f} | {r['p50_ms']:.2f} / {r['p99_ms']:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
