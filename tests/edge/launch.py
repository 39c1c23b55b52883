"""launch: starts attention-server for the edge tests, bare or behind an edge.

    with Launch("edge", server_flags) as target:   # deploy/edge/run.sh (HAProxy)
        target.address      # HOST:PORT clients use
        target.pids()       # processes whose memory counts: server and edge
        target.rss_bytes()

Modes: "edge" runs deploy/edge/run.sh --listen 127.0.0.1:PORT; "bare" runs
attention-server alone on 127.0.0.1; "nginx" puts nginx 1.22 (grpc_pass,
tests/edge/nginx-comparison.conf) in front instead, for the comparison in
RELIABILITY.md section 10. attention-server is $ATTENTION_SERVER_BIN.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_SH = os.path.join(SOURCE_DIR, "deploy", "edge", "run.sh")
NGINX_CONF = os.path.join(SOURCE_DIR, "tests", "edge", "nginx-comparison.conf")
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests", "support"))
from ports import free_port  # noqa: E402


def wait_for(predicate, what, process, seconds=60):
    give_up = time.monotonic() + seconds
    while not predicate():
        if process.poll() is not None:
            raise RuntimeError(f"{what}: the process exited ({process.returncode})")
        if time.monotonic() > give_up:
            raise RuntimeError(f"{what}: not ready after {seconds} s")
        time.sleep(0.02)


def listening(address):
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def rss_of(pid):
    """Resident bytes of pid and its children (nginx's workers)."""
    total = 0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            with open(f"/proc/{p}/task/{p}/children") as f:
                pids.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return total


class Launch:
    def __init__(self, mode, server_flags=(), run_flags=(), metrics=False):
        self.mode = mode
        # The server's Prometheus endpoint, which the edge does not carry.
        self.metrics_address = f"127.0.0.1:{free_port()}" if metrics else ""
        self.server_flags = list(server_flags)
        self.run_flags = list(run_flags)
        self.dir = tempfile.TemporaryDirectory()
        self.log_path = os.path.join(self.dir.name, "log")
        self.processes = []
        self.address = None
        self.server_pid = None
        self.edge_pid = None

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def _popen(self, argv, env=None):
        log = open(self.log_path, "ab")
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.processes.append(process)
        return process

    def _bare_server(self, address):
        ports = os.path.join(self.dir.name, "ports")
        process = self._popen([os.environ["ATTENTION_SERVER_BIN"], "--address", address,
                               "--http-address", "127.0.0.1:0",
                               "--metrics-address", self.metrics_address, "--port-file", ports,
                               *self.server_flags])
        wait_for(lambda: os.path.exists(ports), "attention-server", process)
        with open(ports) as f:
            return process, dict(line.split() for line in f.read().splitlines())["grpc"]

    def _start(self):
        if self.mode == "bare":
            process, self.address = self._bare_server("127.0.0.1:0")
            self.server_pid = process.pid
        elif self.mode == "edge":
            self.address = f"127.0.0.1:{free_port()}"
            pid_file = os.path.join(self.dir.name, "pids")
            process = self._popen(["bash", RUN_SH, "--listen", self.address, "--pid-file",
                                   pid_file, *self.run_flags, "--", "--metrics-address",
                                   self.metrics_address, *self.server_flags])
            wait_for(lambda: os.path.exists(pid_file), "run.sh", process)
            # "server PID GRPC METRICS" (one server here) and "edge PID".
            with open(pid_file) as f:
                pids = {line.split()[0]: line.split()[1] for line in f.read().splitlines()}
            self.server_pid, self.edge_pid = int(pids["server"]), int(pids["edge"])
            wait_for(lambda: listening(self.address), "the edge", process)
        elif self.mode == "nginx":
            server, backend = self._bare_server("127.0.0.1:0")
            self.server_pid = server.pid
            self.address = f"127.0.0.1:{free_port()}"
            with open(NGINX_CONF) as f:
                conf = f.read().replace("@LISTEN@", self.address).replace("@BACKEND@", backend)
            conf = conf.replace("@DIR@", self.dir.name)
            path = os.path.join(self.dir.name, "nginx.conf")
            with open(path, "w") as f:
                f.write(conf)
            nginx = self._popen(["nginx", "-p", self.dir.name, "-c", path, "-e", "stderr"])
            self.edge_pid = nginx.pid
            wait_for(lambda: listening(self.address), "nginx", nginx)
        else:
            raise ValueError(f"unknown mode {self.mode}")

    def pids(self):
        return [p for p in (self.server_pid, self.edge_pid) if p]

    def rss_by_process(self):
        return {"server": rss_of(self.server_pid),
                **({"edge": rss_of(self.edge_pid)} if self.edge_pid else {})}

    def rss_bytes(self):
        return sum(self.rss_by_process().values())

    def alive(self):
        return all(p.poll() is None for p in self.processes)

    def terminate(self, seconds=60):
        """SIGTERM to the first process started (run.sh, or the server), as a
        process manager would; returns its exit code."""
        first = self.processes[0]
        first.send_signal(signal.SIGTERM)
        return first.wait(timeout=seconds)

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.dir.cleanup()
