#!/usr/bin/python3
"""plot_report.py: the service figures of BENCHMARKS.md, from bench/results.

  bench/figures/service.png   what the service adds: closed-loop answers/s and
      CPU per answer (server and client) of the trivial call against the bare
      gRPC server, and of the token and small requests with batching off and
      on (bench/results/service_targets.json, bench/service_targets.py).
  bench/figures/sessions.png  decoding tokens/s of 1 and 64 sessions, the
      engine alone and through the server, and the CPU per token
      (bench/results/sessions.json, bench/session_scaling.py).
  bench/figures/edge.png      calls/s and CPU per call bare, through the edge
      and through the edge in front of three replicas
      (bench/results/edge.json, bench/edge_overhead.sh --json).

Each figure names its host, its date and the command that measured it. A
results file that is missing is skipped.

  /usr/bin/python3 bench/plot_report.py
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_engine import footer, plt  # noqa: E402  (matplotlib on its file backend)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
FIGURES = os.path.join(REPO, "bench", "figures")


def load(name):
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def stacked_cpu(ax, labels, parts, colors):
    bottom = [0.0] * len(labels)
    for (name, values), color in zip(parts, colors):
        ax.bar(range(len(labels)), values, 0.6, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, total in enumerate(bottom):
        ax.text(x, total, f"{total:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)


def plot_service(r, path):
    cases = [("trivial", "bare"), ("trivial", "off"), ("trivial", "on"),
             ("token", "off"), ("token", "on"), ("small", "off"), ("small", "on")]
    names = {"bare": "bare gRPC", "off": "batching off", "on": "batching on"}
    rows = []
    for workload, mode in cases:
        runs = [x for x in r["closed"] if x["workload"] == workload and x["mode"] == mode]
        if runs:
            rows.append((f"{workload}\n{names[mode]}",
                         statistics.median(x["throughput_rps"] for x in runs),
                         statistics.median(x["server_cpu_us"] for x in runs),
                         statistics.median(x["client_cpu_us"] for x in runs)))
    figure, (rate, cpu) = plt.subplots(1, 2, figsize=(14, 5.8))
    colors = ["tab:gray" if "bare" in label else "tab:blue" for label, *_ in rows]
    rate.bar(range(len(rows)), [row[1] for row in rows], 0.6, color=colors)
    for x, row in enumerate(rows):
        rate.text(x, row[1], f"{row[1]:,.0f}", ha="center", va="bottom", fontsize=7)
    rate.set_xticks(range(len(rows)))
    rate.set_xticklabels([row[0] for row in rows], fontsize=7)
    rate.set_ylabel("answers/s (closed loop, concurrency 64), median of rounds")
    rate.set_title("Throughput; grey: the bare gRPC callback server", fontsize=10)
    stacked_cpu(cpu, [row[0] for row in rows],
                [("server CPU per answer", [row[2] for row in rows]),
                 ("client CPU per answer (same 2 CPUs)", [row[3] for row in rows])],
                ["tab:blue", "tab:orange"])
    cpu.set_ylabel("µs of CPU per answer")
    cpu.legend(fontsize=7)
    cpu.set_title("CPU per answer: the server's, then the client's on top", fontsize=10)
    figure.suptitle("What the service adds: attention-server against a bare gRPC server "
                    "(trivial call), and batching off / on")
    isa = r.get("build_info", {}).get("on", {}).get("isa", "?")
    loads = [float(x["load_average"]) for x in r["closed"]]
    footer(figure, [f"{r['cpu']}, {r['cpus']} CPUs, kernel path {isa}; {r['started']}; 1-min load "
                    f"average {min(loads):.1f}-{max(loads):.1f}; client and servers share the CPUs.",
                    "Measured by: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE /usr/bin/python3 "
                    "bench/service_targets.py --json bench/results/service_targets.json",
                    "Drawn by: /usr/bin/python3 bench/plot_report.py"])
    figure.subplots_adjust(bottom=0.2, top=0.88, wspace=0.25)
    figure.savefig(path, dpi=100)


def plot_sessions(r, path):
    summary = r["summary"]
    sessions = sorted(summary, key=int)
    figure, (rate, cpu) = plt.subplots(1, 2, figsize=(13, 5.6))
    xs = range(len(sessions))
    engine = [statistics.median(summary[s]["engine_tokens_per_s"]) for s in sessions]
    served = [statistics.median(summary[s]["server_tokens_per_s"]) for s in sessions]
    rate.bar([x - 0.18 for x in xs], engine, 0.36, label="engine alone (attention-bench)",
             color="tab:gray")
    rate.bar([x + 0.18 for x in xs], served, 0.36, label="through attention-server "
             "(AttendSession, attention-client bench)", color="tab:blue")
    for x, (a, b) in enumerate(zip(engine, served)):
        rate.text(x - 0.18, a, f"{a:,.0f}", ha="center", va="bottom", fontsize=7)
        rate.text(x + 0.18, b, f"{b:,.0f}", ha="center", va="bottom", fontsize=7)
    rate.set_xticks(list(xs))
    rate.set_xticklabels([f"{s} session{'s' if int(s) > 1 else ''}" for s in sessions])
    rate.set_ylabel("tokens/s (one-token steps), median of rounds")
    rate.set_ylim(0, max(engine + served) * 1.3)
    rate.set_title("Decoding throughput", fontsize=10)
    rate.legend(fontsize=7, loc="upper left")
    stacked_cpu(cpu, [f"{s} session{'s' if int(s) > 1 else ''}\n{kind}" for s in sessions
                      for kind in ("engine", "server")],
                [("engine or server CPU per token",
                  [summary[s][k] for s in sessions
                   for k in ("engine_cpu_us_per_token", "server_cpu_us_per_token")]),
                 ("client CPU per token",
                  [v for s in sessions for v in (0.0, summary[s]["client_cpu_us_per_token"])])],
                ["tab:blue", "tab:orange"])
    cpu.set_ylabel("µs of CPU per token")
    cpu.legend(fontsize=7)
    cpu.set_title("CPU per token", fontsize=10)
    figure.suptitle("Decoding sessions: nn.MultiheadAttention(1024, 16), fp32, one-token steps")
    loads = r["load_averages"]
    footer(figure, [f"{r['machine']}; {r['started']}; {r['rounds']} rounds; 1-min load average "
                    f"{min(loads):.1f}-{max(loads):.1f}; client and server share the CPUs.",
                    "Measured by: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE " + r["command"],
                    "Drawn by: /usr/bin/python3 bench/plot_report.py"])
    figure.subplots_adjust(bottom=0.2, top=0.88, wspace=0.25)
    figure.savefig(path, dpi=100)


def plot_edge(r, path):
    sides = [("bare", "bare server"), ("edge", "through the edge\n(1 replica)"),
             ("edge3", "through the edge\n(3 replicas)")]
    m = r["median"]
    figure, (rate, cpu) = plt.subplots(1, 2, figsize=(13, 5.6))
    values = [m[s]["calls_per_s"] for s, _ in sides]
    rate.bar(range(3), values, 0.6, color=["tab:gray", "tab:blue", "tab:cyan"])
    for x, (v, (s, _)) in enumerate(zip(values, sides)):
        rate.text(x, v, f"{v:,.0f}/s\np99 {m[s]['p99_ms']:.1f} ms", ha="center", va="bottom",
                  fontsize=7)
    rate.set_xticks(range(3))
    rate.set_xticklabels([label for _, label in sides], fontsize=8)
    rate.set_ylabel("calls/s, median of rounds")
    rate.set_ylim(0, max(values) * 1.25)
    rate.set_title(f"Throughput ({r['load']})", fontsize=10)
    stacked_cpu(cpu, [label for _, label in sides],
                [(f"{part} CPU per call", [m[s]["cpu_us_per_call"][part] for s, _ in sides])
                 for part in ("client", "server", "edge")],
                ["tab:orange", "tab:blue", "tab:green"])
    cpu.set_ylabel("µs of CPU per call")
    cpu.legend(fontsize=7)
    cpu.set_title("CPU per call: client, server(s), HAProxy", fontsize=10)
    figure.suptitle("The edge (HAProxy 2.6, deploy/edge/run.sh): dot_product B=1 n=8 d=64")
    footer(figure, [r["host"] + "; client, servers and edge share the CPUs.",
                    "Measured by: env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE "
                    f"bench/edge_overhead.sh --json bench/results/edge.json {r['arguments']}",
                    "Drawn by: /usr/bin/python3 bench/plot_report.py"])
    figure.subplots_adjust(bottom=0.2, top=0.88, wspace=0.25)
    figure.savefig(path, dpi=100)


def main():
    os.makedirs(FIGURES, exist_ok=True)
    for name, plot, figure in (("service_targets.json", plot_service, "service.png"),
                               ("sessions.json", plot_sessions, "sessions.png"),
                               ("edge.json", plot_edge, "edge.png")):
        result = load(name)
        if result:
            plot(result, os.path.join(FIGURES, figure))
            print(f"bench/figures/{figure}")


if __name__ == "__main__":
    main()
