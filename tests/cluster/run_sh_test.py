"""run_sh_test: deploy/edge/run.sh --replicas 3 on loopback (the edge's
side of a replica set), with the real attention-server and HAProxy:

  - bad input: --replicas out of range, a bad --edge-metrics-address (exit 2
    with the reason); a replica that cannot start (a missing model
    repository) makes run.sh exit non-zero with the server's reason, and
    leaves nothing running;
  - the pid file: one "server PID GRPC METRICS" line per replica and an
    "edge PID" line; the edge's metrics (HAProxy's exporter) show every
    replica UP;
  - balance: 8 threads over one connection, each replica within 0.08 of 1/3
    (the replicas' own counters);
  - affinity: 8 Triton sequences of 48 unary ModelInfer steps with the
    attention-sequence-id header, and 8 of 12 REST infer steps with it, none
    refused; without it (the control) and with an invalid one, refused as
    today;
  - run.sh's supervision: kill -9 of a replica under load (nothing fails, a
    new one serves within 5 s, the pid file rewritten), a rolling SIGTERM of
    all three (nothing fails: needs the server's drain, which keeps serving
    while it reports NOT_SERVING);
  - SIGTERM to run.sh under load: every call OK or UNAVAILABLE, exit 0,
    nothing left running.

    ATTENTION_SERVER_BIN=build/server/attention-server \\
        build/tests/python-client-venv/bin/python tests/cluster/run_sh_test.py
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scenarios  # noqa: E402
from replica_set import RUN_SH, RunShSet, free_port  # noqa: E402
from scenarios import Checks, figure  # noqa: E402
from workload import Load, edge_servers, metrics  # noqa: E402


def run_sh(*args, seconds=60):
    return subprocess.run(["bash", RUN_SH, *args], capture_output=True, text=True, timeout=seconds)


def check_bad_input(checks):
    listen = f"127.0.0.1:{free_port()}"
    for replicas in ("0", "65", "three"):
        result = run_sh("--listen", listen, "--replicas", replicas)
        checks.expect(result.returncode == 2 and "--replicas must be a whole number from 1 to 64"
                      in result.stderr, f"--replicas {replicas}: exit 2 with the reason "
                      f"({result.returncode}: {result.stderr.strip().splitlines()[:1]})")
    result = run_sh("--listen", listen, "--edge-metrics-address", "nowhere")
    checks.expect(result.returncode == 2 and "--edge-metrics-address must be HOST:PORT" in result.stderr,
                  f"--edge-metrics-address nowhere: exit 2 with the reason ({result.returncode})")
    # A replica that cannot start: the server's own reason, run.sh's exit.
    missing = os.path.join(tempfile.gettempdir(), f"no-such-models-{os.getpid()}")
    marker = f"ATTENTION_REPLICA_SET_TEST_BAD={os.getpid()}"
    start = time.monotonic()
    result = subprocess.run(
        ["bash", RUN_SH, "--listen", listen, "--replicas", "3", "--", "--metrics-address",
         "127.0.0.1:0", "--model-repository", missing],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, marker.split("=")[0]: marker.split("=")[1]})
    took = time.monotonic() - start
    output = result.stdout + result.stderr
    checks.expect(result.returncode != 0 and "before serving" in result.stderr and missing in output,
                  f"a replica that cannot start: run.sh exits non-zero ({result.returncode}) in "
                  f"{took:.1f} s with the server's reason naming {missing}")
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _has_marker(pid, marker)]
    checks.expect(not left, f"a replica that cannot start: nothing left running ({left})")


def _has_marker(pid, marker):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker.encode() in f.read().split(b"\0")
    except OSError:
        return False


def check_pid_file(checks, replica_set):
    lines = [line.split() for line in replica_set.pid_file_lines()]
    servers = [line for line in lines if line[0] == "server"]
    edges = [line for line in lines if line[0] == "edge"]
    checks.expect(len(servers) == 3 and all(len(line) == 4 for line in servers) and
                  len({line[2] for line in servers}) == 3 and len(edges) == 1 and len(edges[0]) == 2,
                  f"pid file: 3 'server PID GRPC METRICS' lines and an 'edge PID' line ({lines})")
    ok = all(metrics(line[3]) for line in servers)
    checks.expect(ok, "pid file: each replica's metrics address serves its metrics")
    states = edge_servers(replica_set.edge_metrics)
    checks.expect(states == {"r1": "UP", "r2": "UP", "r3": "UP"},
                  f"--edge-metrics-address: HAProxy's exporter shows every replica UP ({states})")


def rest_sequences(address, header, count=8, steps=12):
    """REST infer steps of `count` sequences, one curl (one HTTP/2
    connection, prior knowledge, as the edge takes plaintext) per sequence:
    the edge limits new connections per source; the number refused."""
    refused = 0
    first = int.from_bytes(os.urandom(5), "little") + 1
    for sequence_id in range(first, first + count):
        command = ["curl", "-s", "--http2-prior-knowledge"]
        for step in range(steps):
            body = {"parameters": {"sequence_id": sequence_id, "sequence_start": step == 0,
                                   "sequence_end": step == steps - 1},
                    "inputs": [{"name": "queries", "datatype": "FP32", "shape": [1, 1, 4],
                                "data": [0.5, -1.0, 0.25, float(step)]}]}
            if step:
                command.append("--next")
            command += ["-o", "/dev/null", "-w", "%{http_code}\\n", "-H",
                        "content-type: application/json", "--data", json.dumps(body)]
            if header:
                command += ["-H", f"attention-sequence-id: {sequence_id}"]
            command.append(f"http://{address}/v2/models/dot_product/infer")
        codes = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout.split()
        refused += steps - codes.count("200")
    return refused


def check_rest_affinity(checks, replica_set):
    refused = rest_sequences(replica_set.address, header=True)
    figure("REST sequences with the header", f"{refused} of 96 steps refused")
    checks.expect(refused == 0, f"REST infer sequences with the header: no step refused ({refused})")
    refused = rest_sequences(replica_set.address, header=False)
    figure("REST sequences without the header", f"{refused} of 96 steps refused")
    checks.expect(refused > 0, "REST infer sequences without the header: steps refused (the control)")


def check_sigterm(checks, replica_set):
    with Load(replica_set.address) as load:
        time.sleep(2.0)
        start = time.monotonic()
        replica_set.process.send_signal(signal.SIGTERM)
        code = replica_set.process.wait(timeout=60)
        took = time.monotonic() - start
    codes = {c.code for c in load.calls}
    figure("SIGTERM to run.sh", f"exit {code} after {took:.1f} s; call codes {sorted(codes)}")
    checks.expect(code == 0, f"SIGTERM to run.sh: exit 0 ({code})")
    checks.expect(codes <= {"OK", "UNAVAILABLE"}, f"SIGTERM to run.sh: calls only OK or UNAVAILABLE ({codes})")
    time.sleep(0.5)
    left = replica_set.leftovers()
    checks.expect(not left, f"SIGTERM to run.sh: nothing left running ({left})")


def main():
    checks = Checks()
    os.system("uptime")
    check_bad_input(checks)
    replica_set = RunShSet(3)
    try:
        check_pid_file(checks, replica_set)
        scenarios.check_balance(checks, replica_set)
        scenarios.check_triton(checks, replica_set)
        check_rest_affinity(checks, replica_set)
        scenarios.check_kill9(checks, replica_set)
        lines = replica_set.pid_file_lines()
        checks.expect(sum(line.startswith("server ") for line in lines) == 3,
                      f"pid file after the replacement: 3 server lines ({lines})")
        scenarios.check_rolling(checks, replica_set)
        check_sigterm(checks, replica_set)
    except Exception as error:  # noqa: BLE001 - reported as a failure with run.sh's log
        checks.expect(False, f"the scenario ran to its end: {error!r}")
        print(replica_set.log()[-4000:])
    finally:
        replica_set.stop()
    os.system("uptime")
    return checks.summary()


if __name__ == "__main__":
    sys.exit(main())
