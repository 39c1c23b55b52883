"""drain_python_test: SIGTERM under closed-loop load, seen by an independent
Python grpcio client (raw stubs, no retries): every call gets OK or
UNAVAILABLE, never CANCELLED or anything else, in each of ATTENTION_DRAIN_RUNS
(default 20) SIGTERMs; every request the server logged as computed got OK;
and the server exits 0 each time.

The load is 16 threads, each sending the conformance cases' requests back to
back over one shared channel, through the drain and past the exit
(docs/api.md, "Shutdown"). SIGTERM comes after a random number of answers,
so that it lands at varying points of a batch.

The stubs are the plain generated ones that the attention-client package
carries (pb2, pb2_grpc), so it runs with the Python of a virtual environment
that package is installed in (tests/client/python_install.sh):

    ATTENTION_SERVER_BIN=build/server/attention-server \
        build/tests/python-client-venv/bin/python tests/reliability/drain_python_test.py
"""

import collections
import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from attention_client import pb2, pb2_grpc

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFORMANCE = os.path.join(SOURCE_DIR, "tests", "conformance")

THREADS = 16
# The debug line the server writes for each request it computed.
COMPUTED = re.compile(r"request done: .*?request_id='([^']*)'")
RUNS = int(os.environ.get("ATTENTION_DRAIN_RUNS", "20"))


def tensor(value):
    return pb2.Tensor(shape=value["shape"], data=value["data"])


def conformance_requests():
    """The conformance cases that use built-in models, as AttendRequests."""
    requests = []
    for path in sorted(glob.glob(os.path.join(CONFORMANCE, "cases", "*.json"))):
        with open(path) as f:
            case = json.load(f)
        fields = case.get("request", case)
        if fields.get("model") not in ("dot_product", "distance"):
            continue
        request = pb2.AttendRequest(model=fields["model"], queries=tensor(fields["queries"]))
        for name in ("keys", "values"):
            if name in fields:
                getattr(request, name).CopyFrom(tensor(fields[name]))
        request.valid_lens.extend(fields.get("valid_lens", []))
        request.causal = fields.get("causal", False)
        requests.append(request)
    if not requests:
        requests.append(pb2.AttendRequest(model="dot_product", queries=pb2.Tensor(
            shape=[1, 8, 16], data=[0.01 * i for i in range(128)])))
    return requests


def start_server(directory, flags):
    ports = os.path.join(directory, "ports")
    log = open(os.path.join(directory, "log"), "wb")
    process = subprocess.Popen(
        [os.environ["ATTENTION_SERVER_BIN"], "--address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
         "--metrics-address", "",
         "--port-file", ports, "--log-level", "debug", *flags], stdout=log, stderr=subprocess.STDOUT)
    give_up = time.monotonic() + 60
    while not os.path.exists(ports):
        if process.poll() is not None or time.monotonic() > give_up:
            process.kill()
            raise RuntimeError("attention-server did not start")
        time.sleep(0.02)
    with open(ports) as f:
        address = dict(line.split() for line in f.read().splitlines())["grpc"]
    return process, log, address


def one_run(requests, flags):
    """Statuses seen by the load around one SIGTERM, and the exit code."""
    with tempfile.TemporaryDirectory() as directory:
        process, log, address = start_server(directory, flags)
        channel = grpc.insecure_channel(address, options=[("grpc.enable_retries", 0)])
        stub = pb2_grpc.AttentionServiceStub(channel)
        codes = collections.Counter()
        ok_ids = set()
        lock = threading.Lock()
        answered = threading.Semaphore(0)
        stop = threading.Event()

        def load(seed):
            rng = random.Random(seed)
            n = 0
            while not stop.is_set():
                request = pb2.AttendRequest()
                request.CopyFrom(rng.choice(requests))
                request.request_id = f"{seed}-{n}"
                n += 1
                try:
                    stub.Attend(request, timeout=30)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as error:
                    code = error.code()
                with lock:
                    codes[code.name] += 1
                    if code == grpc.StatusCode.OK:
                        ok_ids.add(request.request_id)
                answered.release()
                # The loop goes on through the drain, as a client that has not
                # yet noticed would; briefly paced once refused.
                if code == grpc.StatusCode.UNAVAILABLE:
                    time.sleep(0.002)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        for _ in range(random.randint(30, 300)):
            answered.acquire()
        process.send_signal(signal.SIGTERM)
        exit_code = process.wait(timeout=120)
        # A little load after the exit too: those calls must fail UNAVAILABLE.
        time.sleep(0.05)
        stop.set()
        for thread in threads:
            thread.join()
        channel.close()
        log.close()
        with open(os.path.join(directory, "log")) as f:
            server_log = f.read()
        computed = set(COMPUTED.findall(server_log))
        return codes, exit_code, server_log, computed - ok_ids


def main():
    flags = sys.argv[1:]
    requests = conformance_requests()
    failures = []
    total = collections.Counter()
    for run in range(RUNS):
        codes, exit_code, server_log, lost = one_run(requests, flags)
        total.update(codes)
        unexpected = {c: n for c, n in codes.items() if c not in ("OK", "UNAVAILABLE")}
        print(f"run {run}: {dict(codes)} exit {exit_code}, {len(lost)} lost", flush=True)
        if unexpected or exit_code != 0 or lost:
            failures.append(f"run {run}: statuses {dict(codes)}, exit code {exit_code}, "
                            f"computed but not answered OK: {sorted(lost)}")
            print(server_log[-3000:], flush=True)
    print(f"total over {RUNS} runs: {dict(total)}")
    if failures:
        print("FAILED: only OK and UNAVAILABLE with exit 0 are allowed:\n  " +
              "\n  ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
