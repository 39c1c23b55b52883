# decode_floor.py: where a session step's server CPU goes, against gRPC's own per-call floor.
"""Server CPU per call, one call at a time from the Python client, alternating:

  bare     bench/bare-attention-server answering a 1x1x1 Attend (gRPC 1.51's
           own cost of a lone unary call: no pipeline, no compute);
  trivial  attention-server, the same 1x1x1 Attend on dot_product (gRPC plus
           our request pipeline, next to no compute);
  step     attention-server, one-token steps of a 512-step session decode
           (E=512, 8 heads: session_decode.py's model).

step - trivial is about the step's compute; trivial - bare our pipeline's
per-call cost. Usage: decode_floor.py BUILD_DIR [ROUNDS]
"""
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402

import attention_client  # noqa: E402
import bench_server  # noqa: E402
import session_decode as sd  # noqa: E402

STEPS = 512


def per_call_us(pid, calls, run):
    cpu = sd.server_cpu_seconds(pid)
    run()
    return (sd.server_cpu_seconds(pid) - cpu) / calls * 1e6


def main():
    build, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
    directory = tempfile.mkdtemp(prefix="decode_floor.")
    ours, ours_address = sd.start_server(os.path.join(build, "server", "attention-server"),
                                         directory)
    bare, bare_addresses = bench_server.start(os.path.join(build, "bench", "bare-attention-server"))
    bare_address = bare_addresses["grpc"]
    tokens = np.random.default_rng(25).uniform(-1, 1, (1, STEPS, 512)).astype(np.float32)
    one = np.ones((1, 1, 1), np.float32)
    clients = {name: attention_client.AttentionClient(address, timeout=60)
               for name, address in (("bare", bare_address), ("ours", ours_address))}
    calls = STEPS * 2

    def lone(client):
        for _ in range(calls):
            client.attend(one, model="dot_product")

    def decode():
        for _ in range(2):
            with clients["ours"].session(sd.MODEL) as session:
                for t in range(STEPS):
                    session.step(tokens[:, t:t + 1])

    points = {"bare": (bare.pid, lambda: lone(clients["bare"])),
              "trivial": (ours.pid, lambda: lone(clients["ours"])),
              "step": (ours.pid, decode)}
    results = {name: [] for name in points}
    try:
        decode()  # warm-up: scratch, pool blocks, connections
        lone(clients["bare"])
        for r in range(rounds):
            order = list(points) if r % 2 == 0 else list(reversed(points))
            for name in order:
                pid, run = points[name]
                results[name].append(per_call_us(pid, calls, run))
            print(f"round {r + 1}: " + ", ".join(f"{n} {results[n][-1]:.0f} us" for n in points) +
                  f" (load {open('/proc/loadavg').read().split()[0]})", flush=True)
        median = {n: statistics.median(v) for n, v in results.items()}
        print("median server CPU per call: " +
              ", ".join(f"{n} {median[n]:.0f} us" for n in points))
        print(f"our pipeline per lone call (trivial - bare): {median['trivial'] - median['bare']:.0f} us;"
              f" a step's compute (step - trivial): {median['step'] - median['trivial']:.0f} us;"
              f" a {STEPS}-step decode: {median['step'] * STEPS / 1e6:.3f} s of server CPU")
    finally:
        for process in (ours, bare):
            bench_server.stop(process)


if __name__ == "__main__":
    main()
