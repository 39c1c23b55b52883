#!/usr/bin/python3
"""trivial_ab.py: trivial calls against the bare server, for several builds side by side.

bench/service_targets.py measures one build of attention-server against
bare-attention-server among its other workloads; this runs only its trivial
workload (dot_product B=1 n=1 d=1, closed loop at concurrency 64, the same
`attention-client bench` for every server), against the bare server and one
attention-server per build named on the command line, all started once and
alternated inside each round (the first server of each round rotates), so
that a change's effect on the per-call cost is read beside the same host
moment. Prints, per server, the median calls/s, the per-round ratio to the
bare server's and its median, and the medians of the server's and the
client's CPU per call (the steadier figures on a shared host).

  /usr/bin/python3 bench/trivial_ab.py [--build build] [--rounds 8]
      [NAME=BUILD_DIR ...] [-- SERVER_FLAG ...]

`--build` gives the client and the bare server, and the attention-server
named "main"; each NAME=BUILD_DIR adds that build's attention-server. Flags
after `--` go to every attention-server.
"""

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import service_targets as st  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=pathlib.Path, default=st.REPO / "build")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=4)
    parser.add_argument("--warmup", type=float, default=1)
    parser.add_argument("builds", nargs="*", help="NAME=BUILD_DIR")
    args, server_flags = parser.parse_known_args()
    server_flags = [f for f in server_flags if f != "--"]
    builds = {"main": args.build}
    for named in args.builds:
        name, _, directory = named.partition("=")
        if not directory:
            sys.exit(f"expected NAME=BUILD_DIR, got {named!r}")
        builds[name] = pathlib.Path(directory)

    work = pathlib.Path(tempfile.mkdtemp(prefix="trivial_ab."))
    servers = {}
    try:
        repository = work / "models"
        repository.mkdir()
        servers[st.BARE] = st.Server(args.build, repository, work, st.BARE)
        for name, build in builds.items():
            st.MODES[name] = server_flags
            servers[name] = st.Server(build, repository, work, name)
        client = args.build / "client/attention-client"
        runs = {name: [] for name in servers}
        for round_index in range(args.rounds):
            names = list(servers)
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                r = st.bench(client, servers[name], "trivial",
                             ["--concurrency", str(args.concurrency)], args.warmup, args.duration)
                runs[name].append(r)
                st.progress(f"round {round_index + 1} {name:8s}", r)
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    model, cpus, _ = st.machine()
    print(f"CPU: {model}, {cpus} CPUs; {args.rounds} rounds, concurrency {args.concurrency}")
    print()
    print("| server | calls/s (median) | against bare, rounds | median | server CPU us/call | "
          "client CPU us/call |")
    print("|---|---:|---|---:|---:|---:|")
    for name, rs in runs.items():
        ratios = [r["throughput_rps"] / b["throughput_rps"] for r, b in zip(rs, runs[st.BARE])]
        print(f"| {name} | {statistics.median(r['throughput_rps'] for r in rs):.0f} | "
              f"{' / '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f} | "
              f"{statistics.median(r['server_cpu_us'] for r in rs):.1f} | "
              f"{statistics.median(r['client_cpu_us'] for r in rs):.1f} |")


if __name__ == "__main__":
    main()
