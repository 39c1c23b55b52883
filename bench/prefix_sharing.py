"""prefix_sharing: sessions that open with one prompt, through a real
attention-server, with prefix sharing on (the default) and off
(--no-prefix-sharing), the same run both ways.

SESSIONS sessions of the multi_head model mh_torch_e1024_h16 (E = 1024, 16
heads; bench/make_service_model.py writes it) are opened one after the
other, each with the same PROMPT-token prompt, then stepped STEPS one-token
steps of its own, all kept open. Prints, per run: the time of the first
opening (its prompt's step) and of the others (median, largest, and their
ratio to the first), as the client saw it and as the server spent it
(attention_request_duration_seconds, from the request parsed to the answer
written), one session's pool bytes (the first, measured alone)
and the pool's used, shared and cached bytes with every session open (and
the used bytes over one session's), and the prompt tokens looked up and
found; then whether every answer of the two runs is the same bit for bit.

Run with the Python client's virtual environment (tests/client/python_install.sh
makes one over /usr/bin/python3 and Debian's packages):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE \\
      build/tests/python-client-venv/bin/python bench/prefix_sharing.py \\
      --server build/server/attention-server [--sessions 32 --prompt 4096 --steps 16]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

import bench_server

ROOT = os.path.dirname(os.path.abspath(__file__))
MODEL = "mh_torch_e1024_h16"


def metrics_lines(address):
    """The lines of the server's /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode().splitlines()


def metrics(address):
    """The unlabelled samples of the server's /metrics, by name."""
    values = {}
    for line in metrics_lines(address):
        if line.startswith("#") or "{" in line:
            continue
        name, _, value = line.partition(" ")
        values[name] = float(value)
    return values


def request_seconds(address):
    """The server's attention_request_duration_seconds_sum over every label
    set: the time its calls took from the request parsed to the answer
    written, without the transport or the client."""
    return sum(float(line.rpartition(" ")[2]) for line in metrics_lines(address)
               if line.startswith("attention_request_duration_seconds_sum"))


def run(binary, directory, flags, args, prompt, tokens):
    """One server's run: its answers and figures."""
    import attention_client
    process, addresses = bench_server.start(
        binary, directory, ["--metrics-address", "127.0.0.1:0", "--http-address", "", *flags])
    address, metrics_address = addresses["grpc"], addresses["metrics"]
    try:
        client = attention_client.AttentionClient(address, timeout=600)
        client.attend(prompt[:, :1], model=MODEL)  # connection and first-call costs
        sessions, answers, openings, served = [], [], [], []
        one_session = None
        for s in range(args.sessions):
            session = client.session(MODEL)
            session.__enter__()
            sessions.append(session)
            server_before = request_seconds(metrics_address)
            start = time.perf_counter()
            answers.append(session.step(prompt).output)
            openings.append(time.perf_counter() - start)
            served.append(request_seconds(metrics_address) - server_before)
            for t in range(args.steps):
                answers.append(session.step(tokens[s][:, t:t + 1]).output)
            if s == 0:
                one_session = metrics(metrics_address)["attention_session_pool_used_bytes"]
        figures = metrics(metrics_address)
        for session in sessions:
            session.close()
        return answers, (openings, served), one_session, figures
    finally:
        bench_server.stop(process)


def report(name, timings, one_session, figures):
    used = figures["attention_session_pool_used_bytes"]
    print(f"{name}:")
    for what, times in zip(("at the client", "in the server"), timings):
        rest = times[1:]
        print(f"  {what}: first opening {times[0] * 1e3:9.1f} ms; the others median "
              f"{statistics.median(rest) * 1e3:9.1f} ms, largest {max(rest) * 1e3:9.1f} ms "
              f"({statistics.median(rest) / times[0]:.3f}x and {max(rest) / times[0]:.3f}x "
              f"the first)")
    print(f"  one session {one_session / 2**20:8.1f} MiB; all open: used "
          f"{used / 2**20:8.1f} MiB ({used / one_session:.2f}x one session), shared "
          f"{figures['attention_session_pool_shared_bytes'] / 2**20:8.1f} MiB, cached "
          f"{figures['attention_session_pool_cached_bytes'] / 2**20:8.1f} MiB")
    print(f"  prompt tokens looked up "
          f"{figures['attention_session_prefix_query_tokens_total']:.0f}, found "
          f"{figures['attention_session_prefix_hit_tokens_total']:.0f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="build/server/attention-server")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--memory-bytes", type=int, default=4 << 30,
                        help="--session-memory-bytes: room for every session held apart")
    args = parser.parse_args()
    rng = np.random.default_rng(31)
    prompt = rng.uniform(-1, 1, (1, args.prompt, 1024)).astype(np.float32)
    tokens = [rng.uniform(-1, 1, (1, args.steps, 1024)).astype(np.float32)
              for _ in range(args.sessions)]
    with tempfile.TemporaryDirectory() as directory:
        subprocess.run([sys.executable, os.path.join(ROOT, "make_service_model.py"), directory,
                        "--embed-dim", "1024", "--heads", "16"], check=True,
                       stdout=subprocess.DEVNULL)
        flags = ["--session-memory-bytes", str(args.memory_bytes), "--max-session-length",
                 str(args.prompt + args.steps)]
        runs = {}
        for name, extra in (("prefix sharing on", []),
                            ("--no-prefix-sharing", ["--no-prefix-sharing"])):
            runs[name] = run(args.server, directory, flags + extra, args, prompt, tokens)
            report(name, *runs[name][1:])
    on, off = (runs[name][0] for name in runs)
    same = len(on) == len(off) and all(
        a.shape == b.shape and a.tobytes() == b.tobytes() for a, b in zip(on, off))
    print(f"answers the same bit for bit with sharing on and off: {'yes' if same else 'NO'} "
          f"({len(on)} answers)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
