#!/usr/bin/python3
"""plot_service.py: figures of the service benchmark from its measured JSON.

Reads what bench/service_sweep.py wrote and draws, with matplotlib:

  bench/figures/service_sweep.png     throughput, p50/p99 latency and the CPU
      time per answer (server and client) against concurrency, batching off
      and on, one row per request (small, large, trivial); the trivial
      request's best throughput is drawn on every throughput panel as the
      transport ceiling. CPU per answer barely depends on the machine's other
      load, so it shows the cost of each mode even where throughput is noisy.
  bench/figures/service_batching.png  peak throughput of batching off
      and of each batched setting at the same concurrency, and the latency
      percentiles in open loop at 50% of each mode's peak.

Each figure names the machine, the load average during the run and the
command that measured it. --markdown prints the tables of BENCHMARKS.md's
"Service" section from the same JSON instead.

  /usr/bin/python3 bench/plot_service.py
  /usr/bin/python3 bench/plot_service.py --markdown
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


def save(figure, report, title, path, bottom):
    """Title, footer (`bottom`: the figure's fraction kept for it), PNG."""
    figure.suptitle(title)
    figure.tight_layout(rect=(0, bottom, 1, 0.96))
    footer(figure, report)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def mode_of(point, report):
    return "off" if point["server_args"] == report["batching_off_args"] else "on"


def plot_sweep(report, path):
    workloads = [w for w in TITLES if any(p["workload"] == w for p in report["points"])]
    ceiling = max((p["throughput_rps"] for p in report["points"] if p["workload"] == "trivial"),
                  default=None)
    labels = {"off": "batching off (" + " ".join(report["batching_off_args"]) + ")",
              "on": "batching on (" + " ".join(report["batching_on_args"]) + ")"}
    figure, axes = plt.subplots(len(workloads), 3, figsize=(17, 3.6 * len(workloads) + 0.8),
                                squeeze=False)
    for row, workload in enumerate(workloads):
        throughput_axes, latency_axes, cpu_axes = axes[row]
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
            cpu_axes.plot(x, [p["server_cpu_us_per_request"] for p in points], "o-",
                          color=COLORS[mode], label=f"server, {mode}")
            cpu_axes.plot(x, [p["client_cpu_us_per_request"] for p in points], "^:",
                          color=COLORS[mode], label=f"client, {mode}")
        if ceiling and workload != "trivial":
            throughput_axes.axhline(ceiling, color="gray", linestyle=":",
                                    label=f"transport ceiling ({ceiling:.0f}/s, trivial request)")
        throughput_axes.set_title(f"{TITLES[workload]}: throughput", fontsize=10)
        throughput_axes.set_ylabel("answers / s")
        throughput_axes.set_yscale("log" if ceiling and workload != "trivial" else "linear")
        latency_axes.set_title(f"{TITLES[workload]}: latency", fontsize=10)
        latency_axes.set_ylabel("ms")
        latency_axes.set_yscale("log")
        cpu_axes.set_title(f"{TITLES[workload]}: CPU per answer", fontsize=10)
        cpu_axes.set_ylabel("CPU us per answer (all threads)")
        cpu_axes.set_yscale("log")
        for a in (throughput_axes, latency_axes, cpu_axes):
            a.set_xscale("log", base=2)
            a.set_xlabel("concurrency (calls in flight, closed loop)")
            a.grid(True, which="both", alpha=0.3)
            a.legend(fontsize=7)
    save(figure, report, "attention-server: throughput, latency and CPU per answer against concurrency",
         path, bottom=0.05)


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
    peak_axes.set_ylabel("answers / s (median round)")
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
    save(figure, report, "attention-server: dynamic batching of small multi-head requests",
         path, bottom=0.08)


def us(value):
    return "" if value is None else f"{value:.0f}"


def sweep_tables(report):
    """Per request: both modes side by side at each concurrency."""
    lines = []
    for workload in TITLES:
        points = [p for p in report["points"] if p["workload"] == workload]
        if not points:
            continue
        lines += [f"{TITLES[workload]}:", "",
                  "| concurrency | off: answers/s | p50 ms | p99 ms | on: answers/s | p50 ms | p99 ms "
                  "| mean batch | on/off | server CPU us/answer off / on | client CPU us/answer off / on |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for concurrency in sorted({p["concurrency"] for p in points}):
            off, on = (next(p for p in points if p["concurrency"] == concurrency
                            and mode_of(p, report) == mode) for mode in ("off", "on"))
            lines.append(
                f"| {concurrency} | {off['throughput_rps']:.0f} | {off['latency_ms']['p50']:.2f} | "
                f"{off['latency_ms']['p99']:.2f} | {on['throughput_rps']:.0f} | "
                f"{on['latency_ms']['p50']:.2f} | {on['latency_ms']['p99']:.2f} | "
                f"{on['mean_batch_size']:.1f} | {on['throughput_rps'] / off['throughput_rps']:.2f}x | "
                f"{us(off['server_cpu_us_per_request'])} / {us(on['server_cpu_us_per_request'])} | "
                f"{us(off['client_cpu_us_per_request'])} / {us(on['client_cpu_us_per_request'])} |")
        lines.append("")
    return lines


def batching_tables(report):
    lines = [f"Closed loop, concurrency {report['peak_concurrency']}, small request:", "",
             "| server flags | answers/s per round | median | vs off | mean batch | server CPU us/answer "
             "(of it gRPC threads) | client CPU us/answer |",
             "|---|---|---:|---:|---:|---:|---:|"]
    off = report["peak_rps"][" ".join(report["closed_loop"][0]["server_args"])]
    for name, peak in report["peak_rps"].items():
        runs = [p for p in report["closed_loop"] if " ".join(p["server_args"]) == name]

        def mean(key):
            return sum(p[key] for p in runs) / len(runs)

        rounds = ", ".join(f"{p['throughput_rps']:.0f}" for p in runs)
        lines.append(
            f"| `{name}` | {rounds} | {peak:.0f} | "
            f"{peak / off:.2f}x | {mean('mean_batch_size'):.1f} | "
            f"{mean('server_cpu_us_per_request'):.0f} ({mean('server_grpc_threads_cpu_us_per_request'):.0f}) | "
            f"{mean('client_cpu_us_per_request'):.0f} |")
    lines += ["", "Open loop at 50% of each mode's peak:", "",
              "| server flags | rate/s | answers/s | p50 ms | p90 ms | p99 ms | max ms | p99/p50 | mean batch |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in report["open_loop_half_peak"]:
        l = p["latency_ms"]
        lines.append(f"| `{' '.join(p['server_args'])}` | {p['rate_rps']:.0f} | {p['throughput_rps']:.0f} | "
                     f"{l['p50']:.2f} | {l['p90']:.2f} | {l['p99']:.2f} | {l['max']:.2f} | "
                     f"{l['p99'] / l['p50']:.1f} | {p['mean_batch_size']:.1f} |")
    return lines + [""]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", default=RESULTS, help="directory of service_*.json")
    parser.add_argument("--figures", default=FIGURES, help="directory the PNGs are written to")
    parser.add_argument("--markdown", action="store_true",
                        help="print the tables for BENCHMARKS.md instead of drawing")
    args = parser.parse_args()
    os.makedirs(args.figures, exist_ok=True)
    for name, plot, tables in (("service_sweep", plot_sweep, sweep_tables),
                               ("service_batching", plot_batching, batching_tables)):
        source = os.path.join(args.results, f"{name}.json")
        if not os.path.exists(source):
            print(f"{source} missing: run bench/service_sweep.py first; skipped")
            continue
        with open(source) as f:
            report = json.load(f)
        if args.markdown:
            loads = [p["loadavg_before"][0] for p in report.get("points", report.get("closed_loop"))]
            print(f"`{report['command']}` ({report['date']}, commit {report['commit']}, "
                  f"1-min load average {min(loads):.1f}-{max(loads):.1f})\n")
            print("\n".join(tables(report)))
            continue
        target = os.path.join(args.figures, f"{name}.png")
        plot(report, target)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
