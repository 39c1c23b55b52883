# decode_ab.py: server CPU of the session decode on two attention-server binaries, alternating.
"""A/B of the session decode's server CPU: two servers, alternating, 512-step
sessions (E=512), R rounds of 4 decodes each per server. Usage: decode_ab.py A B R."""
import os, sys, tempfile, time, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
import attention_client
import bench_server
import session_decode as sd

a, b, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokens = np.random.default_rng(25).uniform(-1, 1, (1, 512, 512)).astype(np.float32)
servers = {}
dirs = []
for name, binary in (("A", a), ("B", b)):
    d = tempfile.mkdtemp(prefix="decode_ab.")
    process, address = sd.start_server(binary, d)
    client = attention_client.AttentionClient(address, timeout=60)
    client.attend(tokens[:, :1], model=sd.MODEL, causal=True)
    servers[name] = (process, client)
res = {"A": [], "B": []}
try:
    for r in range(rounds):
        for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
            process, client = servers[name]
            cpu = sd.server_cpu_seconds(process.pid)
            start = time.perf_counter()
            for _ in range(4):
                with client.session(sd.MODEL) as s:
                    for t in range(512):
                        s.step(tokens[:, t:t + 1])
            wall = (time.perf_counter() - start) / 4
            c = (sd.server_cpu_seconds(process.pid) - cpu) / 4
            res[name].append((wall, c))
            print(f"round {r+1} {name} per decode: wall {wall:.3f} s server CPU {c:.4f} s "
                  f"({c / 512 * 1e6:.0f} us/step) load {open('/proc/loadavg').read().split()[0]}",
                  flush=True)
    for name in ("A", "B"):
        print(name, "median wall %.3f s, server CPU %.4f s per 512-step decode" % (
            statistics.median(x[0] for x in res[name]), statistics.median(x[1] for x in res[name])))
finally:
    for process, _ in servers.values():
        bench_server.stop(process)
