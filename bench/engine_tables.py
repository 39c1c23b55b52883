#!/usr/bin/python3
"""engine_tables.py: the Markdown tables of BENCHMARKS.md from a results file.

Reads bench/results/<file> (written by plot_engine.py --measure) and prints,
headed by the CPU, the kernel path that ran and the BLAS core: multi_head
against nn.MultiheadAttention and, when the run measured it, ONNX Runtime
(the faster of its two graphs, bench/compare_ort.py), the dot-product core against the d2l-style
PyTorch code, masked against unmasked, and the GEMM peak of the same run.

  /usr/bin/python3 bench/engine_tables.py engine.json
"""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_engine import ort_best  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ["B:8/n:128/E:256/H:8", "B:4/n:512/E:512/H:8", "B:1/n:2048/E:512/H:8", "B:32/n:32/E:256/H:8"]


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "engine.json"
    with open(os.path.join(REPO, "bench", "results", name)) as f:
        r = json.load(f)
    e, t, d2l = r["engine"], r["torch"], r["torch_d2l_dot_product"]
    ctx = r.get("engine_context", {})
    env = ", ".join(f"{k}={v}" for k, v in r.get("environment", {}).items() if k != "OMP_WAIT_POLICY")
    loads = [l[0] for l in r["load_averages"]]
    print(f"CPU: {r['machine']}  ")
    print(f"Kernel path: **{ctx.get('isa')}** (CPU supports {ctx.get('cpu_isa')}); "
          f"OpenBLAS core: **{ctx.get('blas_core')}**; environment: "
          f"{env or 'nothing set'}  ")
    print(f"{r['date_utc']} UTC, {r['rounds']} rounds, 1-min load average "
          f"{min(loads):.1f}-{max(loads):.1f}\n")
    gemm2 = e["gemm/M:2048/N:2048/K:2048/threads:2"]
    gemm1 = e["gemm/M:2048/N:2048/K:2048/threads:1"]
    o = ort_best(r.get("ort"))
    print("| shape | masked | ours ms | PyTorch ms | ONNX Runtime ms (graph) | PyTorch / ours | "
          "ONNX Runtime / ours | ours GFLOP/s | % of SGEMM (2 threads) |")
    print("|---|:-:|---:|---:|---:|---:|---:|---:|---:|")
    for s in SHAPES:
        for m in (0, 1):
            k = f"multi_head/{s}/masked:{m}"
            a, b = e[k], t[k]
            ort_ms = f"{o[k]['ms']:.2f} ({o[k]['graph']})" if o else "-"
            ort_ratio = f"{o[k]['ms'] / a['ms']:.2f}x" if o else "-"
            print(f"| {s} | {m} | {a['ms']:.2f} | {b['ms']:.2f} | {ort_ms} | "
                  f"{b['ms'] / a['ms']:.2f}x | {ort_ratio} | "
                  f"{a['GFLOPS']:.0f} | {100 * a['GFLOPS'] / gemm2['GFLOPS']:.0f}% |")
    print()
    print("| shape | masked | allowed | engine ms | d2l ms | engine/d2l (wall) | engine/d2l (CPU time) | "
          "masked speed-up (CPU time) | ideal (1/allowed) | % of ideal | CPU ns per allowed score | "
          "of it beyond the GEMM rate |")
    print("|---|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in SHAPES:
        base = e[f"dot_product/{s}/masked:0"]
        for m in (0, 1):
            k = f"dot_product/{s}/masked:{m}"
            a, b = e[k], d2l[k]
            allowed = a.get("allowed") or 1.0
            # GFLOP_per_call = 4 d * allowed scores; CPU seconds = GFLOP / GFLOPS_per_core.
            width = int(s.split("E:")[1].split("/")[0])
            d = width // int(s.split("H:")[1])
            scores = a["GFLOP_per_call"] * 1e9 / (4 * d)
            cpu_ns = a["GFLOP_per_call"] / a["GFLOPS_per_core"] * 1e9 / scores
            # The same 4d FLOPs per score at the 1-thread SGEMM's per-core rate.
            gemm_ns = 4 * d / gemm1["GFLOPS_per_core"]
            # CPU time per call, which the machine's other load disturbs less than wall time.
            def cpu(row):
                return row["GFLOP_per_call"] / row["GFLOPS_per_core"]
            speedup = cpu(base) / cpu(a)
            ideal = 1 / allowed
            print(f"| {s} | {m} | {allowed:.2f} | {a['ms']:.2f} | {b['ms']:.2f} | "
                  f"{b['ms'] / a['ms']:.1f}x | {a['GFLOPS_per_core'] / b['GFLOPS_per_core']:.1f}x | "
                  f"{speedup:.2f}x | {ideal:.2f}x | "
                  f"{100 * speedup / ideal:.0f}% | "
                  f"{cpu_ns:.2f} | {cpu_ns - gemm_ns:.2f} |")
    print()
    print("| GEMM 2048^3 (OpenBLAS via Eigen) | ms | GFLOP/s | GFLOP/s per core |")
    print("|---|---:|---:|---:|")
    for label, g in (("1 thread", gemm1), ("2 threads", gemm2)):
        print(f"| {label} | {g['ms']:.1f} | {g['GFLOPS']:.0f} | {g['GFLOPS_per_core']:.0f} |")
    per_round_tables(r)


def per_round_tables(r):
    """Ratios taken within each round (engine and PyTorch measured minutes
    apart, under the same load), with their median over the rounds."""
    rounds = r.get("per_round")
    if not rounds:
        return
    def cpu(row):
        return row["GFLOP_per_call"] / row["GFLOPS_per_core"]
    def cell(values, spec):
        return f"{', '.join(format(v, spec) for v in values)} | **{format(statistics.median(values), spec)}**"
    print()
    print(f"Per round ({len(rounds)} rounds; each round's best repetition), median in bold:")
    print()
    has_ort = all(x.get("ort") for x in rounds)
    print("| shape | masked | PyTorch / ours (wall) per round | median | ONNX Runtime / ours (wall) "
          "per round | median | % of SGEMM (2 threads, wall) per round | median |")
    print("|---|:-:|---|---:|---|---:|---|---:|")
    for s in SHAPES:
        for m in (0, 1):
            k = f"multi_head/{s}/masked:{m}"
            wall = [x["torch"][k]["ms"] / x["engine"][k]["ms"] for x in rounds]
            ort = ([ort_best(x["ort"])[k]["ms"] / x["engine"][k]["ms"] for x in rounds]
                   if has_ort else None)
            peak = [100 * x["engine"][k]["GFLOPS"] /
                    x["engine"]["gemm/M:2048/N:2048/K:2048/threads:2"]["GFLOPS"] for x in rounds]
            print(f"| {s} | {m} | {cell(wall, '.2f')} | {cell(ort, '.2f') if ort else '- | -'} | "
                  f"{cell(peak, '.0f')} |")
    print()
    print("| shape | ideal (1/allowed) | masked speed-up (CPU time) per round | median | "
          "% of ideal, median | masked speed-up (wall) per round | median |")
    print("|---|---:|---|---:|---:|---|---:|")
    for s in SHAPES:
        k0, k1 = f"dot_product/{s}/masked:0", f"dot_product/{s}/masked:1"
        allowed = rounds[0]["engine"][k1].get("allowed") or 1.0
        by_cpu = [cpu(x["engine"][k0]) / cpu(x["engine"][k1]) for x in rounds]
        by_wall = [x["engine"][k0]["ms"] / x["engine"][k1]["ms"] for x in rounds]
        print(f"| {s} | {1 / allowed:.2f}x | {cell(by_cpu, '.2f')} | "
              f"{100 * statistics.median(by_cpu) * allowed:.0f}% | {cell(by_wall, '.2f')} |")


if __name__ == "__main__":
    main()
