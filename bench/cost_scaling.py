#!/usr/bin/python3
"""cost_scaling.py: how the engine's time grows with d, n_q, n_k and valid length.

The book's exercise on the cost of attention, measured: runs the `scaling/...`
benchmarks of attention-bench (dot_product and multi_head; each sweep changes
one of d, n_q, n_k, valid length from a base point), keeps the best repetition
of each, fits the log-log slope of time (CPU time per call, and wall-clock)
against the varied quantity, and writes everything as JSON. Expected slopes: dot_product costs B n_q L 4d, so
1 for each of d, n_q, n_k (= L) and valid length L; multi_head adds
projections 4 B (n_q + n_k) E^2, so its slopes lie between 1 and 2 for E and
below 1 for n_q, n_k and L.

  /usr/bin/python3 bench/cost_scaling.py --bench build/bench/attention-bench \\
      --out bench/results/engine_scaling.json
Then bench/plot_engine.py draws it.
"""
import argparse
import json
import math
import os
import re
import subprocess
import time

NAME = re.compile(r"scaling/(?P<kind>\w+)/vary:(?P<varied>\w+)/B:(?P<B>\d+)/n_q:(?P<n_q>\d+)"
                  r"/n_k:(?P<n_k>\d+)/d:(?P<d>\d+)/valid:(?P<valid>\d+)$")


def run_bench(bench, min_time, repetitions):
    command = [bench, "--benchmark_filter=^scaling/", "--benchmark_format=json",
               f"--benchmark_min_time={min_time}", f"--benchmark_repetitions={repetitions}",
               "--benchmark_report_aggregates_only=true"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return command, json.loads(out)


def slope(xs, ys):
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", default="build/bench/attention-bench")
    parser.add_argument("--out", default="bench/results/engine_scaling.json")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds per repetition")
    parser.add_argument("--repetitions", type=int, default=3, help="the best is kept")
    args = parser.parse_args()

    load_before = os.getloadavg()
    command, report = run_bench(args.bench, args.min_time, args.repetitions)
    # Every counter is aggregated on its own: real_time from _min (the least
    # disturbed repetition), GFLOPS_per_core from _max. CPU time per call is
    # the useful work over the best per-core rate; on a shared machine it is
    # far steadier than wall-clock time, which depends on how many cores the
    # call got.
    rows = {(b["run_name"], b.get("aggregate_name")): b for b in report["benchmarks"]}
    points = []
    for (run_name, aggregate), b in rows.items():
        m = NAME.match(run_name)
        if not m or aggregate != "min":
            continue
        best = rows[(run_name, "max")]
        point = {k: (v if k in ("kind", "varied") else int(v)) for k, v in m.groupdict().items()}
        point["ms"] = b["real_time"]
        point["GFLOPS_per_core"] = best["GFLOPS_per_core"]
        point["GFLOP_per_call"] = b["GFLOP_per_call"]
        point["cpu_ms"] = b["GFLOP_per_call"] / best["GFLOPS_per_core"] * 1e3
        points.append(point)

    slopes = {}
    for kind in sorted({p["kind"] for p in points}):
        for varied in ("d", "n_q", "n_k", "valid"):
            sweep = [p for p in points if p["kind"] == kind and p["varied"] == varied]
            if len(sweep) >= 2:
                xs = [p[varied] for p in sweep]
                slopes[f"{kind}/{varied}"] = {
                    "cpu_time": slope(xs, [p["cpu_ms"] for p in sweep]),
                    "wall_time": slope(xs, [p["ms"] for p in sweep]),
                    "useful_flops": slope(xs, [p["GFLOP_per_call"] for p in sweep]),
                }

    result = {
        "command": " ".join(command),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "context": report["context"],
        "points": points,
        "loglog_slopes": slopes,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for key, value in slopes.items():
        print(f"{key:<20} CPU time ~ x^{value['cpu_time']:.2f}, wall ~ x^{value['wall_time']:.2f}, "
              f"useful FLOPs ~ x^{value['useful_flops']:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
