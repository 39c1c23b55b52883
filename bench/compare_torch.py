#!/usr/bin/python3
"""compare_torch.py: PyTorch's nn.MultiheadAttention on the shapes of attention-bench.

Same problems as `multi_head/...` in attention-bench: self-attention, width E,
H heads, eval mode, need_weights=False, on 2 threads; masked:1 passes a
key_padding_mask built from the same valid lengths (SplitMix64 from seed 42,
uniform in [n/4, n]). GFLOPS uses attention-bench's formula,
sum_b n * L_b * 4E + 8 B n E^2, over wall-clock time; GFLOPS_per_core over
the CPU time of all threads.

--dtype bfloat16 runs the module and its inputs in torch.bfloat16 (names
torch_multi_head_bf16/...), PyTorch's side of attention-bench's
multi_head_bf16/....

Needs Debian's python3-torch (and libopenblas0-pthread):
  /usr/bin/python3 bench/compare_torch.py [--min-time 1.0] [--repetitions 5]
      [--dtype float32|bfloat16]
"""
import argparse
import os
import time

# Idle OpenMP workers sleep instead of spinning, so that CPU time counts work.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402  (after the OpenMP setting)

SHAPES = [(8, 128, 256, 8), (4, 512, 512, 8), (1, 2048, 512, 8), (32, 32, 256, 8)]
SEED = 42
MASK64 = (1 << 64) - 1


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def valid_lengths(batch, length):
    state, lens = SEED, []
    lowest = length // 4
    for _ in range(batch):
        state, r = splitmix64(state)
        lens.append(lowest + r % (length - lowest + 1))
    return lens


def time_call(fn, min_time, repetitions):
    """(wall, cpu) seconds per call, each the best of `repetitions` runs of at
    least min_time (as attention-bench's _min/_max rows: the least disturbed
    run on a shared machine); cpu is the CPU time of all the process's threads."""
    fn()  # warm-up
    best_wall = best_cpu = float("inf")
    for _ in range(repetitions):
        iterations, elapsed = 0, 0.0
        start, cpu_start = time.perf_counter(), time.process_time()
        while elapsed < min_time or iterations < 3:
            fn()
            iterations += 1
            elapsed = time.perf_counter() - start
        best_wall = min(best_wall, elapsed / iterations)
        best_cpu = min(best_cpu, (time.process_time() - cpu_start) / iterations)
    return best_wall, best_cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds per benchmark")
    parser.add_argument("--repetitions", type=int, default=5, help="runs per benchmark; the best is kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(SEED)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'benchmark':<48} {'ms':>9} {'GFLOPS':>8} {'GFLOPS_per_core':>16}")
    for batch, length, width, heads in SHAPES:
        dtype = getattr(torch, args.dtype)
        mha = torch.nn.MultiheadAttention(width, heads, bias=True, batch_first=True)
        mha = mha.eval().to(dtype)
        x = (torch.rand(batch, length, width) * 2 - 1).to(dtype)
        for masked in (0, 1):
            lens = valid_lengths(batch, length) if masked else [length] * batch
            mask = None
            if masked:
                mask = torch.arange(length)[None, :] >= torch.tensor(lens)[:, None]
            flops = sum(length * l * 4 * width for l in lens) + 8 * batch * length * width**2

            def call():
                with torch.inference_mode():
                    mha(x, x, x, key_padding_mask=mask, need_weights=False)

            wall, cpu = time_call(call, args.min_time, args.repetitions)
            kind = "torch_multi_head" + ("_bf16" if args.dtype == "bfloat16" else "")
            name = f"{kind}/B:{batch}/n:{length}/E:{width}/H:{heads}/masked:{masked}"
            print(f"{name:<48} {wall * 1e3:9.3f} {flops / wall * 1e-9:8.2f} "
                  f"{flops / cpu * 1e-9:16.2f}", flush=True)


if __name__ == "__main__":
    main()
