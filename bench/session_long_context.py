"""session_long_context: one-token decode steps of one session over a long
context, through the real attention-server, against the host's read
bandwidth measured in the same run.

The session is a `dot_product` self session of B examples of d-wide rows
(defaults: 8 x 128, one layer's 8 kv heads of 128): its rows serve as keys
and values, held once, so a step at a context of n tokens reads
n * B * d * 4 bytes. The context is sent as prefill steps of --chunk rows,
then --steps one-token steps are timed one at a time from the Python client.
The figure is bytes held / median step time, against attention-bench's
`bandwidth/read/threads:0` probe (a sum over 1 GiB on every thread) run just
before. The last step's output is checked against float64 softmax attention
over the whole context.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
      build/tests/python-client-venv/bin/python bench/session_long_context.py \\
      --build build [--context 32768] [--steps 64]
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import tempfile
import time

import numpy as np

import attention_client
import bench_server

ROOT = pathlib.Path(__file__).resolve().parent.parent


def probe_gbps(bench):
    out = subprocess.run([str(bench), "--benchmark_filter=^bandwidth/read/threads:0",
                          "--benchmark_format=json"], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["benchmarks"][0]["GBps"]


def reference_last(rows, query):
    """float64 softmax attention of `query` (B, d) over rows (B, n, d)."""
    rows = rows.astype(np.float64)
    scores = np.einsum("bnd,bd->bn", rows, query.astype(np.float64)) / np.sqrt(rows.shape[2])
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    return np.einsum("bn,bnd->bd", weights, rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", type=pathlib.Path, default=ROOT / "build")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=2048)
    args = parser.parse_args()

    probe = probe_gbps(args.build / "bench" / "attention-bench")
    rng = np.random.default_rng(7)
    total = args.context + args.steps
    rows = rng.standard_normal((args.batch, total, args.dim), dtype=np.float32)
    held_bytes = total * args.batch * args.dim * 4
    with tempfile.TemporaryDirectory() as directory:
        server, addresses = bench_server.start(
            str(args.build / "server" / "attention-server"), directory,
            ["--metrics-address", "127.0.0.1:0", "--http-address", "",
             "--session-memory-bytes", str(2 * held_bytes + (64 << 20)),
             "--max-session-length", "0"])
        address = addresses["grpc"]
        try:
            with attention_client.AttentionClient(address) as client:
                with client.session("dot_product", batch=args.batch, replay=False) as session:
                    for start in range(0, args.context, args.chunk):
                        session.step(rows[:, start:min(start + args.chunk, args.context)])
                    times = []
                    for t in range(args.context, total):
                        began = time.perf_counter()
                        answer = session.step(rows[:, t:t + 1])
                        times.append(time.perf_counter() - began)
        finally:
            bench_server.stop(server)
    error = np.abs(np.asarray(answer.output)[:, 0] - reference_last(rows, rows[:, -1])).max()
    step = statistics.median(times)
    # The median step reads the context as it stood half way through the steps.
    read = (args.context + args.steps // 2) * args.batch * args.dim * 4 / step / 1e9
    print(f"probe {probe:.1f} GB/s; context {args.context} x B={args.batch} x d={args.dim} "
          f"({held_bytes / 1e6:.0f} MB): step p50 {step * 1e3:.2f} ms "
          f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}), {read:.1f} GB/s, "
          f"{read / probe:.2f} of the probe; last step's max error {error:.2e}")
    if error > 1e-4:
        raise SystemExit("the last step's output is off the float64 reference")


if __name__ == "__main__":
    main()
