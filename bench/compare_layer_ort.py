#!/usr/bin/python3
"""compare_layer_ort.py: a Llama-3-8B-shaped attention layer, our engine beside ONNX Runtime and PyTorch.

The layer of attention-bench's `layer/llama3_8b/prefill/n:N` (hidden 4096,
32 query heads over 8 kv heads of 128, rope_theta 500000 with llama3 scaling,
causal, B=1), a prompt of N = 512 and 2,048 tokens, computed three ways:

  ours     attention-bench --benchmark_filter for the layer prefill cases, fp32
           and bf16 (the packed bf16 projections on an AVX512_BF16 host), and
           `gemm/M:2048/N:2048/K:2048/threads:2`, the host's SGEMM peak;
  ORT      onnxruntime-node (bench/ort_bench.js: 2 intra-op threads, 1
           inter-op, every graph optimisation) on a graph written with
           onnx.helper: MatMul q (4096x4096), k and v (4096x1024), then one
           com.microsoft.GroupQueryAttention (num_heads 32, kv_num_heads 8,
           do_rotary 1 with cos/sin caches from the same llama3-scaled
           inv_freq, rotate-half order; a causal prompt: seqlens_k = N-1,
           total_sequence_length = N, no past), then MatMul o_proj;
  PyTorch  eager float32 on 2 threads, the same math: the projections,
           rotate-half rotary, repeat_interleave of the kv heads, QK^T with a
           causal mask, softmax, PV, o_proj.

ORT's and PyTorch's answers are checked against a float64 reference of the
layer (max abs difference printed; over 1e-3 fails the run). The weights are
random at PyTorch's Linear init scale (attention-bench draws its own: the
work does not depend on them). The three run in alternating rounds in one
run; each figure is the best of the rounds (the least disturbed on a shared
machine), with every round kept in the JSON. Before each timing the script
waits until the other processes of the host use less than --busy-limit CPUs.

FLOPs are attention-bench's LayerPrefillFlops: 2 N hidden (2 q_width +
2 kv_width) for the projections plus 4 (N (N+1) / 2) q_width for QK^T and PV
over the allowed half.

  /usr/bin/python3 bench/compare_layer_ort.py --ort /tmp/ort/node_modules \
      [--bench build/bench/attention-bench] [--rounds 3]

Writes bench/results/layer_ort.json and bench/figures/layer_ort.png. Needs
node with onnxruntime-node 1.30 (npm install --prefix /tmp/ort
--ignore-scripts onnxruntime-node@1.30.0), Debian's python3-torch,
python3-onnx and python3-matplotlib.
"""
import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

# Idle OpenMP workers sleep instead of spinning, so that PyTorch's threads
# do not take CPU from the engine and ORT between its own timings.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(REPO, "bench", "ort_bench.js")
TOLERANCE = 1e-3
SEED = 42

# The layer (attention-bench's kLlama3Config).
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128
ROPE_THETA = 500000.0
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
LENGTHS = (512, 2048)
GEMM = "gemm/M:2048/N:2048/K:2048/threads:2"


def inv_freq():
    """Hugging Face's llama3 rope (_compute_llama3_parameters), in float64."""
    base = 1.0 / ROPE_THETA ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    factor, low, high = LLAMA3["factor"], LLAMA3["low_freq_factor"], LLAMA3["high_freq_factor"]
    old = LLAMA3["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / base
    scaled = np.where(wavelen > low_wavelen, base / factor, base)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def rotary_tables(length):
    """cos and sin of position * inv_freq, (length, HEAD_DIM / 2), float64."""
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq()[None, :]
    return np.cos(angles), np.sin(angles)


def layer_flops(n):
    q_width, kv_width = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    return 2.0 * n * HIDDEN * (2 * q_width + 2 * kv_width) + 4.0 * (n * (n + 1) / 2) * q_width


def rotate(x, cos, sin):
    """Rotate-half rotary on (heads, n, HEAD_DIM) with (n, HEAD_DIM / 2) tables."""
    half = HEAD_DIM // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def layer(x, w, cos, sin):
    """The layer on x (n, HIDDEN) in x's dtype: w holds q, k, v, o as
    nn.Linear weights (out, in); cos, sin (n, HEAD_DIM / 2)."""
    n = x.shape[0]
    q = torch.nn.functional.linear(x, w["q"]).view(n, HEADS, HEAD_DIM).transpose(0, 1)
    k = torch.nn.functional.linear(x, w["k"]).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
    v = torch.nn.functional.linear(x, w["v"]).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=0)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * HEAD_DIM ** -0.5
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    scores.masked_fill_(future, float("-inf"))
    heads = torch.matmul(torch.softmax(scores, dim=-1), v)
    return torch.nn.functional.linear(heads.transpose(0, 1).reshape(n, HEADS * HEAD_DIM), w["o"])


def export_graph(w, path):
    """MatMul q, k, v; GroupQueryAttention with rotary; MatMul o_proj."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    cos, sin = rotary_tables(max(LENGTHS))
    initializers = [numpy_helper.from_array(w[p].numpy().T.copy(), f"w_{p}") for p in "qkvo"]
    initializers += [numpy_helper.from_array(cos.astype(np.float32), "cos_cache"),
                     numpy_helper.from_array(sin.astype(np.float32), "sin_cache")]
    nodes = [helper.make_node("MatMul", ["x", f"w_{p}"], [p]) for p in "qkv"]
    nodes.append(helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "", "", "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"],
        ["heads", "present_key", "present_value"], domain="com.microsoft",
        num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1, rotary_interleaved=0))
    nodes.append(helper.make_node("MatMul", ["heads", "w_o"], ["y"]))
    graph = helper.make_graph(
        nodes, "llama3_8b_attention_layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n", HIDDEN]),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
         helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "n", HIDDEN])],
        initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.checker.check_model(model)
    onnx.save(model, path)


def write(directory, name, array):
    path = os.path.join(directory, name)
    np.ascontiguousarray(array).tofile(path)
    return path


def prepare(directory):
    """Weights, the ORT graph, inputs and float64 references. Returns the
    ORT manifest's cases and, per n, (x, reference) for PyTorch's check."""
    torch.manual_seed(SEED)
    bound = HIDDEN ** -0.5
    shapes = {"q": (HEADS * HEAD_DIM, HIDDEN), "k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "v": (KV_HEADS * HEAD_DIM, HIDDEN), "o": (HIDDEN, HEADS * HEAD_DIM)}
    w = {p: (torch.rand(*shape) * 2 - 1) * bound for p, shape in shapes.items()}
    model = os.path.join(directory, "llama3_8b_layer_gqa.onnx")
    export_graph(w, model)
    w64 = {p: t.double() for p, t in w.items()}
    cases, inputs = [], {}
    for n in LENGTHS:
        x = torch.rand(n, HIDDEN) * 2 - 1
        cos, sin = (torch.from_numpy(t) for t in rotary_tables(n))
        with torch.inference_mode():
            reference = layer(x.double(), w64, cos, sin).numpy()
        inputs[n] = (x, reference)
        stem = f"n{n}"
        cases.append({
            "name": f"ort_gqa/layer/llama3_8b/prefill/n:{n}", "model": model,
            "flops": layer_flops(n), "expected": write(directory, stem + "_y.bin",
                                                       reference.astype(np.float32)),
            "inputs": {
                "x": {"file": write(directory, stem + "_x.bin", x.numpy()), "type": "float32",
                      "dims": [1, n, HIDDEN]},
                "seqlens_k": {"file": write(directory, stem + "_seqlens.bin",
                                            np.array([n - 1], dtype=np.int32)),
                              "type": "int32", "dims": [1]},
                "total_sequence_length": {"file": write(directory, stem + "_total.bin",
                                                        np.array([n], dtype=np.int32)),
                                          "type": "int32", "dims": []}}})
    return cases, inputs, w


def busy_cpus(seconds=2.0):
    """CPUs in use on the host over `seconds` (from /proc/stat)."""
    def sample():
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields[:8]), idle
    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(1, total1 - total0))


def wait_quiet(limit, patience):
    """Waits until other processes use fewer than `limit` CPUs (or `patience`
    seconds pass); returns (busy CPUs seen last, seconds waited)."""
    start = time.time()
    while True:
        busy = busy_cpus()
        if busy < limit or time.time() - start > patience:
            return busy, time.time() - start
        print(f"  host busy ({busy:.2f} CPUs, load {os.getloadavg()[0]:.2f}); waiting", flush=True)
        time.sleep(10)


def run_ours(bench, min_time):
    """attention-bench's layer prefill cases and the SGEMM peak: {name: row}, context."""
    names = [GEMM] + [f"layer/llama3_8b{p}/prefill/n:{n}" for n in LENGTHS for p in ("", "_bf16")]
    pattern = "^(" + "|".join(re.escape(name) for name in names) + ")$"
    command = [bench, f"--benchmark_filter={pattern}", "--benchmark_format=json",
               f"--benchmark_min_time={min_time}", "--benchmark_min_warmup_time=0.1"]
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    to_ms = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
    rows = {b["name"]: {"ms": b["real_time"] * to_ms[b["time_unit"]], "GFLOPS": b["GFLOPS"],
                        "GFLOPS_per_core": b["GFLOPS_per_core"], "iterations": b["iterations"]}
            for b in result["benchmarks"]}
    return rows, result["context"], command


def run_ort(manifest_path, ort_modules):
    """One pass of bench/ort_bench.js over the cases: {name: row}."""
    env = dict(os.environ, NODE_PATH=os.path.abspath(ort_modules))
    done = subprocess.run(["node", RUNNER, manifest_path], env=env, capture_output=True, text=True)
    sys.stdout.write("".join("  " + line + "\n" for line in done.stdout.splitlines()))
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        sys.exit(f"ort_bench.js failed (exit {done.returncode})")
    rows, version = {}, None
    for line in done.stdout.splitlines():
        match = re.match(r"onnxruntime-node (\S+),", line)
        if match:
            version = match.group(1)
        fields = line.split()
        if len(fields) == 6 and fields[4] == "max_abs_diff":
            rows[fields[0]] = {"ms": float(fields[1]), "GFLOPS": float(fields[2]),
                               "GFLOPS_per_core": float(fields[3]),
                               "max_abs_diff": float(fields[5])}
    return rows, version


def time_call(fn, min_time):
    """(wall, cpu) seconds per call: a warm-up, then at least 3 calls and
    `min_time` seconds (ort_bench.js's loop, one repetition)."""
    fn()
    iterations, elapsed = 0, 0.0
    start, cpu_start = time.perf_counter(), time.process_time()
    while elapsed < min_time or iterations < 3:
        fn()
        iterations += 1
        elapsed = time.perf_counter() - start
    return elapsed / iterations, (time.process_time() - cpu_start) / iterations


def run_torch(w, inputs, min_time):
    rows = {}
    for n in LENGTHS:
        x = inputs[n][0]
        cos, sin = (torch.from_numpy(t).float() for t in rotary_tables(n))
        with torch.inference_mode():
            wall, cpu = time_call(lambda: layer(x, w, cos, sin), min_time)
        flops = layer_flops(n)
        rows[f"torch/layer/llama3_8b/prefill/n:{n}"] = {
            "ms": wall * 1e3, "GFLOPS": flops / wall * 1e-9, "GFLOPS_per_core": flops / cpu * 1e-9}
    return rows


def machine():
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = fields.get("Flags", "").split()
    vector = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (f"{fields.get('Model name', '?')} (family {fields.get('CPU family', '?')}, "
            f"model {fields.get('Model', '?')}), {fields.get('CPU(s)', '?')} CPUs, "
            + " ".join(vector))


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    series = [("ours fp32", "ours_fp32_ms", "#1f77b4"), ("ours bf16", "ours_bf16_ms", "#17becf"),
              ("ONNX Runtime 1.30 (GQA)", "ort_ms", "#d62728"),
              ("PyTorch 1.13 eager", "torch_ms", "#7f7f7f")]
    rows = result["table"]
    figure, axis = plt.subplots(figsize=(8, 4.8))
    width = 0.2
    for i, (label, key, colour) in enumerate(series):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        values = [row[key] for row in rows]
        bars = axis.bar(xs, values, width, label=label, color=colour)
        for bar, value in zip(bars, values):
            axis.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value),
                          ha="center", va="bottom", fontsize=7)
    axis.set_xticks(range(len(rows)))
    axis.set_xticklabels([f"prefill n={row['n']}\n(ours fp32 at {row['ours_fp32_of_peak']:.0%} "
                          f"of SGEMM peak)" for row in rows])
    axis.set_yscale("log")
    axis.set_ylabel("ms per prompt (log scale; lower is better)")
    axis.set_title("Llama-3-8B attention layer (32 q / 8 kv heads of 128, llama3 rotary, causal), "
                   "B=1, 2 threads", fontsize=9)
    axis.legend(fontsize=8)
    figure.text(0.01, 0.01, f"{result['machine']}; engine isa {result['isa']}; best of "
                f"{result['rounds']} alternating rounds ({result['timings_on_a_busy_host']} timings on a busy "
                f"host); load {result['load_before'][0]:.2f} before; {result['date_utc']} UTC", fontsize=6)
    if result.get("best_figures_under_threads"):
        figure.text(0.01, 0.035, "Best figures under 0.9 threads' worth of CPU (other load, or an "
                    "idle thread): " + "; ".join(result["best_figures_under_threads"]),
                    fontsize=5, color="#d62728")
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=120)


def annotate(result, threads):
    """CPUs each figure's process used (CPU seconds per wall second, from
    GFLOPS / GFLOPS_per_core) and the picks of the table that used fewer than
    0.9 threads' worth: another process took CPU during them (the host check
    runs only before a timing), or the code left a thread idle."""
    low = 0.9 * threads
    disturbed = []
    for entry in result["per_round"]:
        for engine in ("ours", "ort", "torch"):
            for row in entry[engine].values():
                row["cpus"] = round(row["GFLOPS"] / row["GFLOPS_per_core"], 2)
    keys = {"ours_fp32": ("ours", "layer/llama3_8b/prefill/n:{}"),
            "ours_bf16": ("ours", "layer/llama3_8b_bf16/prefill/n:{}"),
            "ort": ("ort", "ort_gqa/layer/llama3_8b/prefill/n:{}"),
            "torch": ("torch", "torch/layer/llama3_8b/prefill/n:{}")}
    for row in result["table"]:
        row["cpus_of_best"] = {}
        for key, (engine, name) in keys.items():
            picked = min((entry[engine][name.format(row["n"])] for entry in result["per_round"]),
                         key=lambda r: r["ms"])
            row["cpus_of_best"][key] = picked["cpus"]
            if picked["cpus"] < low:
                disturbed.append(f"{key} n={row['n']}: {picked['cpus']:.2f} CPUs")
    gemm = max((entry["ours"][GEMM] for entry in result["per_round"]), key=lambda r: r["GFLOPS"])
    result["sgemm_peak_cpus"] = gemm["cpus"]
    result["best_figures_under_threads"] = disturbed
    return disturbed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ort", required=True, help="node_modules folder holding onnxruntime-node")
    parser.add_argument("--bench", default=os.path.join(REPO, "build", "bench", "attention-bench"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--min-time", type=float, default=2.0, help="seconds per timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--busy-limit", type=float, default=0.3,
                        help="CPUs other processes may use before a timing starts")
    parser.add_argument("--patience", type=float, default=900, help="seconds to wait for that")
    parser.add_argument("--models", help="folder for the graph and inputs (default: temporary)")
    parser.add_argument("--json", default=os.path.join(REPO, "bench", "results", "layer_ort.json"))
    parser.add_argument("--png", default=os.path.join(REPO, "bench", "figures", "layer_ort.png"))
    parser.add_argument("--annotate", action="store_true",
                        help="only add the CPU figures to --json's results and redraw --png")
    args = parser.parse_args()
    if args.annotate:
        with open(args.json) as f:
            result = json.load(f)
        print("\n".join(annotate(result, result["threads"])) or "every best figure used its threads")
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        plot(result, args.png)
        return
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)

    def report():
        """The table of the rounds so far, printed and written (after every round)."""
        def best(engine, name, key="ms"):
            values = [entry[engine][name][key] for entry in rounds]
            return min(values) if key == "ms" else max(values)

        def median(engine, name):
            return float(np.median([entry[engine][name]["ms"] for entry in rounds]))

        peak = best("ours", GEMM, "GFLOPS")
        table = []
        for n in LENGTHS:
            fp32 = best("ours", f"layer/llama3_8b/prefill/n:{n}")
            bf16 = best("ours", f"layer/llama3_8b_bf16/prefill/n:{n}")
            ort_name = f"ort_gqa/layer/llama3_8b/prefill/n:{n}"
            ort = best("ort", ort_name)
            pt = best("torch", f"torch/layer/llama3_8b/prefill/n:{n}")
            flops = layer_flops(n)
            table.append({
                "n": n, "flops": flops, "ours_fp32_ms": fp32, "ours_bf16_ms": bf16, "ort_ms": ort,
                "torch_ms": pt, "ort_over_ours_fp32": ort / fp32, "ort_over_ours_bf16": ort / bf16,
                "torch_over_ours_fp32": pt / fp32,
                "ours_fp32_GFLOPS": flops / fp32 * 1e-6, "ours_bf16_GFLOPS": flops / bf16 * 1e-6,
                "ours_fp32_of_peak": flops / fp32 * 1e-6 / peak,
                "ours_bf16_of_peak": flops / bf16 * 1e-6 / peak,
                "ort_of_peak": flops / ort * 1e-6 / peak,
                "ort_max_abs_diff": max(entry["ort"][ort_name]["max_abs_diff"] for entry in rounds),
                "torch_max_abs_diff": torch_diffs[n], **sensitivity[n],
                "median_ms": {"ours_fp32": median("ours", f"layer/llama3_8b/prefill/n:{n}"),
                              "ours_bf16": median("ours", f"layer/llama3_8b_bf16/prefill/n:{n}"),
                              "ort": median("ort", ort_name),
                              "torch": median("torch", f"torch/layer/llama3_8b/prefill/n:{n}")}})
        result = {
            "date_utc": started.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
            "isa": context.get("isa"), "cpu_isa": context.get("cpu_isa"),
            "blas_core": context.get("blas_core"), "load_before": load_before,
            "load_after": os.getloadavg(), "command": " ".join(shlex.quote(a) for a in sys.argv),
            "attention_bench_command": " ".join(shlex.quote(a) for a in command),
            "onnxruntime_node": ort_version, "torch": torch.__version__, "threads": args.threads,
            "rounds": len(rounds), "rounds_planned": args.rounds,
            "timings_on_a_busy_host": sum(entry[e + "_host"]["busy_cpus_before"] >= args.busy_limit
                                          for entry in rounds for e in ("ours", "ort", "torch")),
            "busy_limit_cpus": args.busy_limit, "min_time_s": args.min_time, "sgemm_peak_GFLOPS": peak,
            "tolerance": TOLERANCE, "table": table, "per_round": rounds}
        disturbed = annotate(result, args.threads)

        print(f"\n{result['machine']}; attention-bench isa {result['isa']}; SGEMM peak "
              f"({GEMM}) {peak:.1f} GFLOPS; load {load_before[0]:.2f} before, "
              f"{result['load_after'][0]:.2f} after; best of {len(rounds)} rounds, "
              f"{result['timings_on_a_busy_host']} timings on a busy host")
        header = (f"{'shape':<34} {'ours fp32':>10} {'ours bf16':>10} {'ORT':>9} {'PyTorch':>9} "
                  f"{'ORT/ours':>9} {'ORT/bf16':>9} {'fp32/peak':>10} {'bf16/peak':>10} {'ORT diff':>9}")
        print(header)
        for row in table:
            print(f"{'layer/llama3_8b/prefill/n:' + str(row['n']):<34} {row['ours_fp32_ms']:10.1f} "
                  f"{row['ours_bf16_ms']:10.1f} {row['ort_ms']:9.1f} {row['torch_ms']:9.1f} "
                  f"{row['ort_over_ours_fp32']:9.2f} {row['ort_over_ours_bf16']:9.2f} "
                  f"{row['ours_fp32_of_peak']:10.1%} {row['ours_bf16_of_peak']:10.1%} "
                  f"{row['ort_max_abs_diff']:9.1e}")
        if disturbed:
            print("best figures whose process used under 0.9 threads' worth of CPU: "
                  + "; ".join(disturbed))
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        os.makedirs(os.path.dirname(args.png), exist_ok=True)
        plot(result, args.png)
        print(f"wrote {args.json} and {args.png}")

    with tempfile.TemporaryDirectory() as scratch:
        directory = args.models or scratch
        os.makedirs(directory, exist_ok=True)
        print("preparing the graph, inputs and float64 references", flush=True)
        cases, inputs, w = prepare(directory)
        manifest = {"cases": cases, "min_time": args.min_time, "repetitions": 1,
                    "threads": args.threads, "tolerance": TOLERANCE}
        manifest_path = os.path.join(directory, "manifest.json")
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)

        torch_diffs, sensitivity = {}, {}
        for n in LENGTHS:
            x, reference = inputs[n]
            cos, sin = (torch.from_numpy(t).float() for t in rotary_tables(n))
            with torch.inference_mode():
                got = layer(x, w, cos, sin).numpy()
            torch_diffs[n] = float(np.abs(got - reference).max())
            print(f"PyTorch n={n}: max abs diff from float64 {torch_diffs[n]:.1e}")
            if not torch_diffs[n] <= TOLERANCE:
                sys.exit(f"PyTorch's answer differs from the float64 reference by {torch_diffs[n]}")
            # How far the answer moves without llama3's scaling of inv_freq
            # (plain rope of theta 500000), and without rotary: what a
            # difference of the checks above can tell apart.
            plain = np.arange(n)[:, None] / ROPE_THETA ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
            with torch.inference_mode():
                unscaled = layer(x, w, torch.from_numpy(np.cos(plain)).float(),
                                 torch.from_numpy(np.sin(plain)).float()).numpy()
                unrotated = layer(x, w, torch.ones(n, HEAD_DIM // 2),
                                  torch.zeros(n, HEAD_DIM // 2)).numpy()
            sensitivity[n] = {"reference_max_abs": float(np.abs(reference).max()),
                              "without_llama3_scaling": float(np.abs(unscaled - reference).max()),
                              "without_rotary": float(np.abs(unrotated - reference).max())}
            print(f"  the reference's largest |y| {sensitivity[n]['reference_max_abs']:.3f}; "
                  f"it moves by {sensitivity[n]['without_llama3_scaling']:.1e} without llama3 "
                  f"scaling, {sensitivity[n]['without_rotary']:.1e} without rotary")

        rounds, context, command, ort_version = [], None, None, None
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            entry = {}
            for engine in ("ours", "ort", "torch"):
                busy, waited = wait_quiet(args.busy_limit, args.patience)
                entry[engine + "_host"] = {"busy_cpus_before": round(busy, 3),
                                           "waited_s": round(waited, 1),
                                           "load_avg": os.getloadavg()}
                if engine == "ours":
                    rows, context, command = run_ours(args.bench, args.min_time)
                elif engine == "ort":
                    rows, ort_version = run_ort(manifest_path, args.ort)
                else:
                    rows = run_torch(w, inputs, args.min_time)
                for name, row in rows.items() if engine != "ort" else ():  # ort_bench.js printed
                    print(f"  {name:<52} {row['ms']:10.2f} ms {row['GFLOPS']:8.2f} GFLOPS", flush=True)
                entry[engine] = rows
            rounds.append(entry)
            report()




if __name__ == "__main__":
    main()
