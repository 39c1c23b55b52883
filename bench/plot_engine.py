#!/usr/bin/python3
"""plot_engine.py: measure the engine next to PyTorch and the GEMM peak, and draw it.

--measure runs, in rounds that alternate ours, PyTorch's and ONNX Runtime's
so all see the same load, attention-bench (multi_head, dot_product, gemm;
JSON), bench/compare_torch.py, bench/compare_ort.py (with --ort: the same
layers exported to ONNX and run on onnxruntime-node; graphs exported once,
before the first round) and the d2l-style dot-product attention in PyTorch
(measure_d2l), keeps the best of all repetitions of every benchmark
(min time, max GFLOP/s) and writes bench/results/engine.json with the load
average around every run, and each round's own best (per_round) so that
ratios can also be taken within one round and their median reported. Without --measure it only draws, from that file and
from bench/results/engine_scaling.json (bench/cost_scaling.py):

  bench/figures/engine_gflops.png   GFLOP/s per shape, unmasked and masked:
      multi_head engine vs nn.MultiheadAttention, the dot-product core vs the
      d2l-style PyTorch code, against the GEMM peak of the same run.
  bench/figures/engine_masked.png   speedup of masked over unmasked calls
      (CPU time and wall-clock) against the ideal (useful FLOPs ratio).
  bench/figures/engine_scaling.png  CPU and wall-clock time per call against
      d, n_q, n_k, valid length, next to the useful FLOPs.

Each figure names the machine, the load average and the commands.

  /usr/bin/python3 bench/plot_engine.py --measure --bench build/bench/attention-bench
  /usr/bin/python3 bench/plot_engine.py
"""
import argparse
import json
import os
import re
import subprocess
import shutil
import sys
import tempfile
import textwrap
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.ticker import NullFormatter  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results")
FIGURES = os.path.join(REPO, "bench", "figures")


def machine():
    """lscpu's model name, family/model, CPU count and vector flags."""
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("Flags", "").split())
    vector = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                          "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile") if f in flags]
    return (f"{fields.get('Model name', '?')} (family {fields.get('CPU family', '?')} model "
            f"{fields.get('Model', '?')}), {fields.get('CPU(s)', '?')} CPUs; {' '.join(vector)}")

# What the caller set for the engine (and, with ATEN_CPU_CAPABILITY,
# DNNL_MAX_CPU_ISA and OPENBLAS_CORETYPE, for PyTorch too: an AVX2-only host
# is imitated on an AVX-512 one by forcing both sides), before compare_torch
# sets OpenMP's wait policy for PyTorch in this process.
CALLER_ENVIRONMENT = {k: v for k, v in os.environ.items()
                      if k.startswith(("OPENBLAS_", "ATTENTION_", "ATEN_", "DNNL_"))}
TORCH_LINE = re.compile(r"^torch_(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")
ORT_LINE = re.compile(r"^ort_(onnx_export|fused)/(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def keep_best(best, name, ms, gflops, per_core, extra=None):
    row = best.setdefault(name, {"ms": ms, "GFLOPS": gflops, "GFLOPS_per_core": per_core})
    row["ms"] = min(row["ms"], ms)
    row["GFLOPS"] = max(row["GFLOPS"], gflops)
    row["GFLOPS_per_core"] = max(row["GFLOPS_per_core"], per_core)
    row.update(extra or {})


def measure_d2l(table, args):
    """The dot-product core the d2l way in PyTorch (bmm, masked softmax that
    writes -1e6 into masked scores, bmm) on the slices of attention-bench's
    dot_product/... shapes: B*H slices of head size E/H, keys = values =
    queries, each slice with its example's valid length."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import compare_torch  # sets the OpenMP wait policy before importing torch
    torch = compare_torch.torch
    torch.set_num_threads(2)
    torch.manual_seed(compare_torch.SEED)
    for batch, length, width, heads in compare_torch.SHAPES:
        x = torch.rand(batch * heads, length, width // heads) * 2 - 1
        for masked in (0, 1):
            lens = compare_torch.valid_lengths(batch, length) if masked else [length] * batch
            slice_lens = torch.tensor(lens).repeat_interleave(heads)
            keep = torch.arange(length)[None, :] < slice_lens[:, None]  # (slices, n_k)
            flops = sum(length * l * 4 * width for l in lens)
            scale = (width // heads) ** -0.5

            def call():
                with torch.inference_mode():
                    scores = torch.bmm(x, x.transpose(1, 2)) * scale
                    if masked:
                        scores.masked_fill_(~keep[:, None, :], -1e6)
                    torch.bmm(torch.softmax(scores, dim=-1), x)

            wall, cpu = compare_torch.time_call(call, args.min_time, args.repetitions)
            name = f"dot_product/B:{batch}/n:{length}/E:{width}/H:{heads}/masked:{masked}"
            keep_best(table, name, wall * 1e3, flops / wall * 1e-9, flops / cpu * 1e-9)


def measure(args):
    bench_cmd = [args.bench, "--benchmark_filter=^(multi_head|dot_product|gemm)/",
                 "--benchmark_format=json", f"--benchmark_min_time={args.min_time}",
                 f"--benchmark_repetitions={args.repetitions}"]
    torch_cmd = ["/usr/bin/python3", os.path.join(REPO, "bench", "compare_torch.py"),
                 f"--min-time={args.min_time}", f"--repetitions={args.repetitions}"]
    engine, torch, d2l, loads, context = {}, {}, {}, [], {}
    ort = {"onnx_export": {}, "fused": {}}
    ort_cmd = None
    if args.ort:
        # Graphs exported once, then run by the Node runner in every round.
        models = tempfile.mkdtemp(prefix="ort-models-")
        subprocess.run(["/usr/bin/python3", os.path.join(REPO, "bench", "compare_ort.py"),
                        "--ort", args.ort, "--models", models, "--min-time", "0.01",
                        "--repetitions", "1"], check=True, capture_output=True)
        manifest_path = os.path.join(models, "manifest.json")
        with open(manifest_path) as f:
            manifest = json.load(f)
        manifest.update(min_time=args.min_time, repetitions=args.repetitions)
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)
        ort_cmd = ["node", os.path.join(REPO, "bench", "ort_bench.js"), manifest_path]
        ort_env = dict(os.environ, NODE_PATH=os.path.abspath(args.ort))
    start = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    per_round = []  # each round's own best, for ratios taken within one round
    for round_index in range(args.rounds):
        round_engine, round_torch, round_d2l = {}, {}, {}
        round_ort = {"onnx_export": {}, "fused": {}}
        loads.append(os.getloadavg())
        report = json.loads(subprocess.run(bench_cmd, check=True, capture_output=True,
                                           text=True).stdout)
        context = {k: report["context"].get(k) for k in ("isa", "cpu_isa", "blas_core")}
        for b in report["benchmarks"]:
            if b.get("run_type") != "iteration" or "GFLOPS" not in b:
                continue
            for table in (engine, round_engine):
                keep_best(table, b["run_name"], b["real_time"], b["GFLOPS"], b["GFLOPS_per_core"],
                          {"allowed": b.get("allowed"), "GFLOP_per_call": b.get("GFLOP_per_call")})
        loads.append(os.getloadavg())
        out = subprocess.run(torch_cmd, check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            m = TORCH_LINE.match(line.strip())
            if m:
                for table in (torch, round_torch):
                    keep_best(table, m.group(1), float(m.group(2)), float(m.group(3)),
                              float(m.group(4)))
        if ort_cmd:
            loads.append(os.getloadavg())
            out = subprocess.run(ort_cmd, check=True, capture_output=True, text=True,
                                 env=ort_env).stdout
            for line in out.splitlines():
                m = ORT_LINE.match(line.strip())
                if m:
                    for table in (ort, round_ort):
                        keep_best(table[m.group(1)], m.group(2), float(m.group(3)),
                                  float(m.group(4)), float(m.group(5)))
        loads.append(os.getloadavg())
        measure_d2l(round_d2l, args)
        for name, row in round_d2l.items():
            keep_best(d2l, name, row["ms"], row["GFLOPS"], row["GFLOPS_per_core"])
        per_round.append({"engine": round_engine, "torch": round_torch,
                          "torch_d2l_dot_product": round_d2l, "ort": round_ort})
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    loads.append(os.getloadavg())
    if ort_cmd:
        shutil.rmtree(models, ignore_errors=True)
    result = {
        "commands": [" ".join(bench_cmd), " ".join(torch_cmd).replace(REPO + "/", "")]
                    + ([" ".join(ort_cmd[:2]).replace(REPO + "/", "")
                        + " <the graphs bench/compare_ort.py exports>"] if ort_cmd else [])
                    + ["d2l-style bmm + masked softmax + bmm in plot_engine.py (measure_d2l)"],
        "command": "/usr/bin/python3 bench/plot_engine.py " + " ".join(sys.argv[1:]),
        "rounds": args.rounds,
        "date_utc": f"{start} to {time.strftime('%H:%M', time.gmtime())}",
        "load_averages": loads,
        "machine": machine(),
        "engine_context": context,
        "environment": CALLER_ENVIRONMENT,
        "engine": engine,
        "torch": torch,
        "torch_d2l_dot_product": d2l,
        "ort": ort if ort_cmd else None,
        "per_round": per_round,
    }
    with open(os.path.join(RESULTS, args.output), "w") as f:
        json.dump(result, f, indent=1)


def footer(figure, lines):
    text = []
    for line in lines:
        text += textwrap.wrap(line, 160, subsequent_indent="  ")
    figure.text(0.01, 0.005, "\n".join(text), fontsize=7, va="bottom", family="monospace")


def load_text(loads):
    ones = [l[0] for l in loads]
    return f"1-min load average {min(ones):.1f}..{max(ones):.1f} (machine shared)"


def shapes(result):
    return [n[len("multi_head/"):-len("/masked:0")] for n in result["engine"]
            if n.startswith("multi_head/") and n.endswith("masked:0")]


def ort_best(ort):
    """Per multi_head shape, the faster of ORT's two graphs (torch.onnx's
    export, the fused com.microsoft.Attention one), with its name."""
    if not ort:
        return None
    best = {}
    for graph, table in ort.items():
        for name, row in table.items():
            if name not in best or row["ms"] < best[name]["ms"]:
                best[name] = dict(row, graph=graph)
    return best


def bars(ax, names, series, counter):
    width = 0.8 / len(series)
    for i, (label, table, kind, masked, color) in enumerate(series):
        values = [table[f"{kind}/{s}/masked:{masked}"][counter] for s in names]
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(names))], values, width,
               label=label, color=color)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([s.replace("/", "\n") for s in names], fontsize=8)


def plot_gflops(result, path):
    names = shapes(result)
    engine, torch = result["engine"], result["torch"]
    d2l = result.get("torch_d2l_dot_product")
    ort = ort_best(result.get("ort"))
    gemm = {t: engine[f"gemm/M:2048/N:2048/K:2048/threads:{t}"] for t in (1, 2)}
    panels = [("GFLOPS_per_core", "multi_head, GFLOP/s per core (over CPU time)"),
              ("GFLOPS", "multi_head, GFLOP/s (over wall-clock time, 2 threads)")]
    figure, axes = plt.subplots(1, 3 if d2l else 2, figsize=(20 if d2l else 14, 6.6))
    multi_head = [("engine, unmasked", engine, "multi_head", 0, "tab:blue"),
                  ("engine, masked", engine, "multi_head", 1, "tab:cyan"),
                  ("nn.MultiheadAttention, unmasked", torch, "multi_head", 0, "tab:red"),
                  ("nn.MultiheadAttention, masked", torch, "multi_head", 1, "salmon")]
    if ort:
        multi_head += [("ONNX Runtime (faster graph), unmasked", ort, "multi_head", 0, "tab:green"),
                       ("ONNX Runtime (faster graph), masked", ort, "multi_head", 1, "lightgreen")]
    for ax, (counter, title) in zip(axes, panels):
        bars(ax, names, multi_head, counter)
        threads = 1 if counter == "GFLOPS_per_core" else 2
        ax.axhline(gemm[threads][counter], color="k", ls="--",
                   label=f"GEMM 2048^3 (OpenBLAS), {threads} thread(s), same run: "
                         f"{gemm[threads][counter]:.0f}")
        ax.set_ylabel(counter)
        ax.set_title(title, fontsize=10)
    if d2l:
        ax = axes[2]
        bars(ax, names, [("engine dot_product, unmasked", engine, "dot_product", 0, "tab:blue"),
                         ("engine dot_product, masked", engine, "dot_product", 1, "tab:cyan"),
                         ("PyTorch d2l-style, unmasked", d2l, "dot_product", 0, "tab:red"),
                         ("PyTorch d2l-style, masked", d2l, "dot_product", 1, "salmon")],
             "GFLOPS_per_core")
        ax.axhline(gemm[1]["GFLOPS_per_core"], color="k", ls="--", label="GEMM, 1 thread")
        ax.set_ylabel("GFLOPS_per_core")
        ax.set_title("dot_product core (B*H slices of d = E/H), GFLOP/s per core", fontsize=10)
    for ax in axes:
        ax.set_ylim(0, ax.get_ylim()[1] * 1.4)
        ax.legend(fontsize=6, loc="upper left", ncol=2)
    figure.suptitle("Engine (attention-bench) vs PyTorch 1.13"
                    + (" vs ONNX Runtime 1.30" if ort else "")
                    + " vs GEMM peak, best of all repetitions of one interleaved run")
    footer(figure, [f"{result['machine']}. {load_text(result['load_averages'])}; "
                    f"{result['rounds']} rounds, {result['date_utc']} UTC.",
                    "Measured by: " + result.get("command", "/usr/bin/python3 bench/plot_engine.py "
                                                 "--measure") + ", which runs: "
                    + " ; ".join(result["commands"]),
                    "Drawn by: /usr/bin/python3 bench/plot_engine.py"])
    figure.subplots_adjust(bottom=0.25, top=0.88, wspace=0.25)
    figure.savefig(path, dpi=100)


def masked_speedups(result, table, kind):
    """(shape, CPU-time speedup, wall-clock speedup, ideal) of masked over unmasked."""
    rows = []
    for s in shapes(result):
        u, m = table[f"{kind}/{s}/masked:0"], table[f"{kind}/{s}/masked:1"]
        cpu = (u["GFLOP_per_call"] / u["GFLOPS_per_core"]) / (m["GFLOP_per_call"] / m["GFLOPS_per_core"])
        rows.append((s, cpu, u["ms"] / m["ms"], u["GFLOP_per_call"] / m["GFLOP_per_call"]))
    return rows


def plot_masked(result, path):
    figure, axes = plt.subplots(1, 2, figsize=(14, 6.2))
    for ax, kind in zip(axes, ("dot_product", "multi_head")):
        rows = masked_speedups(result, result["engine"], kind)
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], 0.2, label="CPU time", color="tab:blue")
        ax.bar(list(xs), [r[2] for r in rows], 0.2, label="wall-clock time", color="tab:cyan")
        ax.bar([x + 0.2 for x in xs], [r[3] for r in rows], 0.2,
               label="ideal: useful FLOPs unmasked / masked", color="lightgray", edgecolor="k")
        ax.axhline(1.5, color="tab:red", ls="--", label="target 1.5x")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r[0]}\nallowed "
                            f"{result['engine'][f'{kind}/{r[0]}/masked:1']['allowed']:.2f}".replace("/", "\n")
                            for r in rows], fontsize=7)
        ax.set_ylabel("speedup of masked over unmasked")
        ax.set_title(f"{kind}: valid lengths uniform in [n/4, n]")
        ax.set_ylim(0, max(2.0, ax.get_ylim()[1] * 1.25))
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    figure.suptitle("Masked vs unmasked calls of the engine (attention-bench masked:1 vs masked:0)")
    footer(figure, [f"{result['machine']}. {load_text(result['load_averages'])}; {result['date_utc']} UTC.",
                    "Measured by: " + result["commands"][0],
                    "Drawn by: /usr/bin/python3 bench/plot_engine.py"])
    figure.subplots_adjust(bottom=0.27, top=0.9)
    figure.savefig(path, dpi=110)


def plot_scaling(scaling, path):
    labels = {"d": "d (head size; E for multi_head)", "n_q": "n_q (queries)",
              "n_k": "n_k (keys = valid length)", "valid": "valid length (n_k fixed)"}
    kinds = ("dot_product", "multi_head")
    figure, axes = plt.subplots(2, 4, figsize=(16, 8.5))
    for row, kind in enumerate(kinds):
        for col, varied in enumerate(labels):
            ax = axes[row][col]
            sweep = sorted((p for p in scaling["points"] if p["kind"] == kind and p["varied"] == varied),
                           key=lambda p: p[varied])
            if not sweep:
                continue
            xs = [p[varied] for p in sweep]
            cpu, wall = [p["cpu_ms"] for p in sweep], [p["ms"] for p in sweep]
            flops = [p["GFLOP_per_call"] for p in sweep]
            ax.loglog(xs, cpu, "o-", color="tab:blue", label="CPU time per call (all threads)")
            ax.loglog(xs, wall, "s--", color="tab:cyan", ms=4, label="wall-clock time (2 threads)")
            ax.loglog(xs, [cpu[-1] * f / flops[-1] for f in flops], "k:",
                      label="proportional to useful FLOPs")
            slope = scaling["loglog_slopes"][f"{kind}/{varied}"]
            ax.set_title(f"{kind}: vs {varied}; slope CPU {slope['cpu_time']:.2f}, "
                         f"FLOPs {slope['useful_flops']:.2f}", fontsize=9)
            base = sweep[0]
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs], fontsize=7)
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(labels[varied], fontsize=8)
            ax.set_ylabel("ms", fontsize=8)
            fixed = ", ".join(f"{k}={base[k]}" for k in ("B", "n_q", "n_k", "d", "valid") if k != varied
                              and not (varied == "n_k" and k == "valid"))
            ax.text(0.03, 0.97, fixed + (", H=8" if kind == "multi_head" else ""),
                    transform=ax.transAxes, fontsize=7, va="top")
            ax.legend(fontsize=6, loc="lower right")
    figure.suptitle("Cost scaling of Engine::Attend (no weights requested; keys and values are "
                    "their own tensor)")
    loads = [scaling["load_average_before"], scaling["load_average_after"]]
    footer(figure, [f"{scaling.get('machine', machine())}. {load_text(loads)}; {scaling['date_utc']} UTC.",
                    "Measured by: /usr/bin/python3 bench/cost_scaling.py, which runs: "
                    + scaling["command"],
                    "Drawn by: /usr/bin/python3 bench/plot_engine.py"])
    figure.subplots_adjust(bottom=0.14, top=0.91, hspace=0.35, wspace=0.3)
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", action="store_true", help="run the benchmarks first")
    parser.add_argument("--bench", default=os.path.join(REPO, "build", "bench", "attention-bench"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--min-time", type=float, default=0.5)
    parser.add_argument("--output", default="engine.json",
                        help="results file in bench/results (the figures use engine.json)")
    parser.add_argument("--no-plot", action="store_true", help="measure only")
    parser.add_argument("--ort", help="node_modules folder holding onnxruntime-node: measure "
                                      "ONNX Runtime too (bench/compare_ort.py)")
    args = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    os.makedirs(FIGURES, exist_ok=True)
    if args.measure:
        measure(args)
    if args.no_plot:
        return
    with open(os.path.join(RESULTS, "engine.json")) as f:
        result = json.load(f)
    plot_gflops(result, os.path.join(FIGURES, "engine_gflops.png"))
    plot_masked(result, os.path.join(FIGURES, "engine_masked.png"))
    scaling_path = os.path.join(RESULTS, "engine_scaling.json")
    if os.path.exists(scaling_path):
        with open(scaling_path) as f:
            plot_scaling(json.load(f), os.path.join(FIGURES, "engine_scaling.png"))


if __name__ == "__main__":
    main()
