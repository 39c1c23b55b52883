#!/usr/bin/python3
"""plot_service.py: figures of the service benchmark from its measured JSON.

Reads what bench/service_sweep.py wrote and draws, with matplotlib:

  bench/figures/service_sweep.png     throughput and p50/p99 latency against
      concurrency, batching off and on, one row per request (small, large,
      trivial); the trivial request's best throughput is drawn on every
      throughput panel as the transport ceiling.
  bench/figures/service_batching.png  issue 3: peak throughput of batching off
      and of each batched setting at the same concurrency, and the latency
      percentiles in open loop at 50% of each mode's peak.

Each figure names the machine, the load average during the run and the
command that measured it.

  /usr/bin/python3 bench/plot_service.py
"""
import argparse
import json
import os
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
FIGURES = os.path.join(REPO, "bench", "figures")
TITLES = {
    "small": "small: multi_head E=256 H=8, B=1, n=32",
    "large": "large: multi_head E=256 H=8, B=8, n=128",
    "trivial": "trivial: dot_product B=1, n=1, d=1",
}
COLORS = {"off": "tab:blue", "on": "tab:orange"}


def footer(figure, report):
    m = report["machine"]
    loads = [p["loadavg_before"][0] for p in report.get("points", report.get("closed_loop", []))]
    load = f"1-min load average {min(loads):.1f}..{max(loads):.1f} during the run" if loads else ""
    lines = [f"{m['cpu']}, {m['cpus']} CPUs ({m['hypervisor'] or 'bare metal'} guest); client and "
             f"server share them. {load}; commit {report['commit']}, {report['date']}."]
    lines += textwrap.wrap(f"Measured by: {report['command']}", 170, subsequent_indent="  ")
    lines.append("Drawn by: /usr/bin/python3 bench/plot_service.py")
    figure.text(0.01, 0.005, "\n".join(lines), fontsize=7, va="bottom", family="monospace")


def mode_of(point, report):
    return "off" if point["server_args"] == report["batching_off_args"] else "on"


def plot_sweep(report, path):
    workloads = [w for w in TITLES if any(p["workload"] == w for p in report["points"])]
    ceiling = max((p["throughput_rps"] for p in report["points"] if p["workload"] == "trivial"),
                  default=None)
    labels = {"off": "batching off (" + " ".join(report["batching_off_args"]) + ")",
              "on": "batching on (" + " ".join(report["batching_on_args"]) + ")"}
    figure, axes = plt.subplots(len(workloads), 2, figsize=(12, 3.6 * len(workloads) + 0.8),
                                squeeze=False)
    for row, workload in enumerate(workloads):
        throughput_axes, latency_axes = axes[row]
        for mode in ("off", "on"):
            points = sorted((p for p in report["points"]
                             if p["workload"] == workload and mode_of(p, report) == mode),
                            key=lambda p: p["concurrency"])
            x = [p["concurrency"] for p in points]
            throughput_axes.plot(x, [p["throughput_rps"] for p in points], "o-",
                                 color=COLORS[mode], label=labels[mode])
            latency_axes.plot(x, [p["latency_ms"]["p50"] for p in points], "o-",
                              color=COLORS[mode], label=f"p50, {mode}")
            latency_axes.plot(x, [p["latency_ms"]["p99"] for p in points], "s--",
                              color=COLORS[mode], label=f"p99, {mode}")
        if ceiling and workload != "trivial":
            throughput_axes.axhline(ceiling, color="gray", linestyle=":",
                                    label=f"transport ceiling ({ceiling:.0f}/s, trivial request)")
        throughput_axes.set_title(f"{TITLES[workload]}: throughput", fontsize=10)
        throughput_axes.set_ylabel("answers / s")
        throughput_axes.set_yscale("log" if ceiling and workload != "trivial" else "linear")
        latency_axes.set_title(f"{TITLES[workload]}: latency", fontsize=10)
        latency_axes.set_ylabel("ms")
        latency_axes.set_yscale("log")
        for a in (throughput_axes, latency_axes):
            a.set_xscale("log", base=2)
            a.set_xlabel("concurrency (calls in flight, closed loop)")
            a.grid(True, which="both", alpha=0.3)
            a.legend(fontsize=7)
    figure.suptitle("attention-server: throughput and latency against concurrency")
    figure.tight_layout(rect=(0, 0.05, 1, 0.97))
    footer(figure, report)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_batching(report, path):
    off = " ".join(report["closed_loop"][0]["server_args"])
    names = list(report["peak_rps"])
    figure, (peak_axes, latency_axes) = plt.subplots(1, 2, figsize=(12, 4.8))
    peaks = [report["peak_rps"][n] for n in names]
    colors = [COLORS["off"] if n == off else COLORS["on"] for n in names]
    peak_axes.bar(range(len(names)), peaks, color=colors)
    for i, name in enumerate(names):
        runs = [p["throughput_rps"] for p in report["closed_loop"] if " ".join(p["server_args"]) == name]
        peak_axes.plot([i] * len(runs), runs, "k.", label="each round" if i == 0 else None)
        peak_axes.text(i, peaks[i], f"{peaks[i] / report['peak_rps'][off]:.2f}x", ha="center",
                       va="bottom", fontsize=8)
    peak_axes.set_xticks(range(len(names)))
    peak_axes.set_xticklabels([n.replace("--max-batch-size ", "size ").replace(
        " --max-queue-delay-us ", "\ndelay ") + ("" if n != off else "\n(off)") for n in names],
        fontsize=7)
    peak_axes.set_ylabel("answers / s (best round)")
    peak_axes.set_title(f"small request, closed loop at concurrency {report['peak_concurrency']}: "
                        "peak throughput", fontsize=10)
    peak_axes.legend(fontsize=7)
    percentiles = ["p50", "p90", "p95", "p99", "max"]
    for point in report["open_loop_half_peak"]:
        mode = "off" if " ".join(point["server_args"]) == off else "on"
        latency_axes.plot(percentiles, [point["latency_ms"][q] for q in percentiles], "o-",
                          color=COLORS[mode],
                          label=f"{' '.join(point['server_args'])} at {point['rate_rps']:.0f}/s: "
                                f"p99/p50 = {point['latency_ms']['p99'] / point['latency_ms']['p50']:.1f}")
    latency_axes.set_yscale("log")
    latency_axes.set_ylabel("ms (from each call's scheduled start)")
    latency_axes.set_title("open loop at 50% of each mode's peak: latency", fontsize=10)
    latency_axes.grid(True, which="both", alpha=0.3)
    latency_axes.legend(fontsize=7)
    figure.suptitle("attention-server: dynamic batching of small multi-head requests (issue 3)")
    figure.tight_layout(rect=(0, 0.08, 1, 0.96))
    footer(figure, report)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=RESULTS, help="directory of service_*.json")
    parser.add_argument("--figures", default=FIGURES, help="directory the PNGs are written to")
    args = parser.parse_args()
    os.makedirs(args.figures, exist_ok=True)
    for name, plot in (("service_sweep", plot_sweep), ("service_batching", plot_batching)):
        source = os.path.join(args.results, f"{name}.json")
        if not os.path.exists(source):
            print(f"{source} missing: run bench/service_sweep.py first; skipped")
            continue
        with open(source) as f:
            report = json.load(f)
        target = os.path.join(args.figures, f"{name}.png")
        plot(report, target)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
