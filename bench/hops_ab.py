# hops_ab.py: two attention-server builds side by side, same client, alternating.
"""A/B: two attention-server binaries side by side, alternating, same client.

Usage: hops_ab.py BUILD_A BUILD_B CLIENT ROUNDS. Each BUILD has server/attention-server.
Both servers run with default flags. Workloads (service_targets.py's, plus token256: one token of
mh_torch_e256_h8, self-attention): trivial, token256 and token at concurrency 64, trivial,
token256 and small at concurrency 1 (a lone client); 1 s warm-up + 3 s each. Prints throughput,
p50, server CPU per answer (/proc) and mean batch per round, then the medians.
"""
import os, pathlib, shutil, subprocess, sys, tempfile, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import service_targets as st

a, b, client, rounds = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
work = pathlib.Path(tempfile.mkdtemp(prefix="hops_ab."))
repo = work / "models"
subprocess.run([sys.executable, str(st.REPO / "bench/make_service_model.py"), str(repo)], check=True,
               stdout=subprocess.DEVNULL)
shutil.copy(st.REPO / "models/mh_torch_e256_h8.safetensors", repo)
servers = {}
for name, build in (("A", a), ("B", b)):
    own = work / name
    own.mkdir()
    s = st.Server(build, repo, own, "on")
    s.mode = name
    servers[name] = s
st.WORKLOADS["token256"] = ["--model", "mh_torch_e256_h8", "--batch", "1", "--n", "1", "--self-attention"]
st.MODEL_OF["token256"] = "mh_torch_e256_h8"
points = [("trivial", 64), ("token256", 64), ("token", 64), ("trivial", 1), ("token256", 1), ("small", 1)]
res = {}
try:
    for r in range(rounds):
        for wl, conc in points:
            order = ["A", "B"] if r % 2 == 0 else ["B", "A"]
            for name in order:
                x = st.bench(client, servers[name], wl, ["--concurrency", str(conc)], 1, 3)
                res.setdefault((wl, conc, name), []).append(x)
                print(f"round {r+1} {wl:7s} c={conc:2d} {name} {x['throughput_rps']:8.0f}/s "
                      f"p50 {x['latency_ms']['p50']:6.3f} ms server {x['server_cpu_us']:6.1f} us "
                      f"batch {x['mean_batch']:4.1f} load {x['load_average']}", flush=True)
    print("\nmedians: workload conc | A: rps p50 cpu | B: rps p50 cpu")
    for wl, conc in points:
        row = []
        for name in ("A", "B"):
            xs = res[(wl, conc, name)]
            row.append("%8.0f %6.3f %6.1f" % (statistics.median(x['throughput_rps'] for x in xs),
                                              statistics.median(x['latency_ms']['p50'] for x in xs),
                                              statistics.median(x['server_cpu_us'] for x in xs)))
        print(f"{wl:7s} {conc:2d} | {row[0]} | {row[1]}")
finally:
    for s in servers.values():
        s.stop()
