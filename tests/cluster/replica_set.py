"""replica_set: three (or N) attention-servers behind one edge, two ways.

  RunShSet(n, server_flags)      deploy/edge/run.sh --replicas n on loopback:
                                 run.sh supervises (replaces what exits)
  NamespaceSet(prefix, n, flags) one server per network namespace PREFIXr<i>
                                 (address 10.77.<i>.2), started with
                                 `ip netns exec`, replaced by a test-only
                                 supervisor as run.sh would; the edge runs here
                                 (the caller's namespace) on the configuration
                                 run.sh uses (haproxy.cfg + backends.sh)

Both expose: address (the edge, for clients), edge_metrics, replicas()
({slot: Replica}), replacement(slot, old_pid) (waits for a new process in the
slot that serves and that the edge has back UP), stop(). RunShSet also
add_replica() (SIGUSR1 to run.sh: one more replica, with run.sh's
--max-replicas).

ATTENTION_CLUSTER_EDGE_DIR runs another deploy/edge/ (run.sh, haproxy.cfg,
backends.sh), e.g. an older one, to show what a test measures against it.
"""

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import NamedTuple

from workload import edge_servers, wait_until

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EDGE_DIR = os.environ.get("ATTENTION_CLUSTER_EDGE_DIR") or os.path.join(SOURCE_DIR, "deploy", "edge")
RUN_SH = os.path.join(EDGE_DIR, "run.sh")
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests", "support"))
from ports import free_port  # noqa: E402


class Replica(NamedTuple):
    slot: int             # 1..n: the edge's server r<slot>
    pid: int
    grpc_address: str
    metrics_address: str


def end(process, sig=signal.SIGTERM, seconds=60):
    """Sends `sig` to a process we started and waits for it; SIGKILL after
    `seconds`."""
    if process.poll() is None:
        process.send_signal(sig)
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def ready(rest_address):
    try:
        with urllib.request.urlopen(f"http://{rest_address}/v2/health/ready", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


class RunShSet:
    def __init__(self, n, server_flags=(), run_flags=()):
        self.dir = tempfile.TemporaryDirectory()
        self.pid_file = os.path.join(self.dir.name, "pids")
        self.log_path = os.path.join(self.dir.name, "log")
        self.address = f"127.0.0.1:{free_port()}"
        self.edge_metrics = f"127.0.0.1:{free_port()}"
        # Marks every process run.sh starts (its environment is inherited),
        # so the test can tell that none is left.
        self.marker = f"ATTENTION_REPLICA_SET_TEST={os.getpid()}-{id(self)}"
        marker_name, marker_value = self.marker.split("=")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                ["bash", RUN_SH, "--listen", self.address, "--replicas", str(n),
                 "--pid-file", self.pid_file, "--edge-metrics-address", self.edge_metrics,
                 *run_flags, "--", "--metrics-address", "127.0.0.1:0", "--threads", "1",
                 *server_flags],
                stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, marker_name: marker_value})
        self.slots = {}
        wait_until(lambda: self._read() and len(self._read()) == n, 120,
                   f"run.sh --replicas {n}: every replica serving", step=0.1)
        # A slot keeps its gRPC address across restarts (run.sh), in the
        # order of the edge's servers r1, r2...
        for slot, line in enumerate(self._read(), 1):
            self.slots[line[2]] = slot
        # (Spare slots for replicas added later are MAINT.)
        wait_until(lambda: all(edge_servers(self.edge_metrics).get(f"r{i}") == "UP"
                               for i in range(1, n + 1)), 30, "the edge: every replica UP")

    def _read(self):
        if self.process.poll() is not None:
            raise RuntimeError(f"run.sh exited ({self.process.returncode}):\n{self.log()}")
        try:
            with open(self.pid_file) as f:
                lines = [line.split() for line in f.read().splitlines()]
        except FileNotFoundError:
            return None
        return [line for line in lines if line[0] == "server"]

    def pid_file_lines(self):
        with open(self.pid_file) as f:
            return f.read().splitlines()

    def replicas(self):
        lines = self._read()
        for line in lines:
            # A replica added later (add_replica) takes the next slot.
            self.slots.setdefault(line[2], len(self.slots) + 1)
        return {self.slots[line[2]]: Replica(self.slots[line[2]], int(line[1]), line[2], line[3])
                for line in lines}

    def add_replica(self, seconds=30):
        """SIGUSR1 to run.sh, then waits until the new replica serves and the
        edge has it UP; its slot."""
        slot = len(self.replicas()) + 1
        self.process.send_signal(signal.SIGUSR1)
        wait_until(lambda: slot in self.replicas() and
                   edge_servers(self.edge_metrics).get(f"r{slot}") == "UP", seconds,
                   f"replica {slot} added and UP at the edge")
        return self.replicas()[slot]

    def replacement(self, slot, old_pid, seconds=30):
        def replaced():
            r = self.replicas().get(slot)
            return r and r.pid != old_pid and \
                edge_servers(self.edge_metrics).get(f"r{slot}") == "UP"
        wait_until(replaced, seconds, f"replica {slot} replaced and back in the edge's rotation")
        return self.replicas()[slot]

    def leftovers(self):
        """Processes still carrying this set's marker."""
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if self.marker.encode() in f.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:
                pass
        return found

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        end(self.process)
        for pid in self.leftovers():
            os.kill(pid, signal.SIGKILL)
        self.dir.cleanup()


class NamespaceSet:
    """Replica i listens on 10.77.<i>.2 (gRPC 50051, REST 8000, metrics 9464)
    in namespace PREFIXr<i>, which the caller made; this process is in the
    namespace holding the edge, where 10.77.<i>.1 faces replica i."""

    def __init__(self, prefix, n, server_flags=()):
        self.prefix = prefix
        self.n = n
        self.server_flags = list(server_flags)
        self.dir = tempfile.TemporaryDirectory()
        self.log = open(os.path.join(self.dir.name, "log"), "wb")
        self.processes = {}
        self.lock = threading.Lock()
        self.stopping = False
        self.restarts = 0
        for slot in range(1, n + 1):
            self._launch(slot)
        for slot in range(1, n + 1):
            wait_until(lambda: ready(self.rest(slot)), 120, f"replica {slot} ready", step=0.1)
        self.address = f"127.0.0.1:{free_port()}"
        self.edge_metrics = f"127.0.0.1:{free_port()}"
        config = os.path.join(self.dir.name, "backends.cfg")
        with open(config, "w") as f:
            subprocess.run(["bash", os.path.join(EDGE_DIR, "backends.sh"), "--metrics",
                            self.edge_metrics,
                            *[f"{self.host(s)}:50051,{self.rest(s)}" for s in range(1, n + 1)]],
                           stdout=f, check=True)
        self.edge = subprocess.Popen(
            ["haproxy", "-db", "-f", os.path.join(EDGE_DIR, "haproxy.cfg"), "-f", config],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "ATTENTION_EDGE_LISTEN": self.address,
                 "ATTENTION_EDGE_BIND_OPTIONS": "proto h2"})
        wait_until(lambda: list(edge_servers(self.edge_metrics).values()) == ["UP"] * n, 30,
                   "the edge: every replica UP")
        self.supervisor = threading.Thread(target=self._supervise, daemon=True)
        self.supervisor.start()

    def host(self, slot):
        return f"10.77.{slot}.2"

    def rest(self, slot):
        return f"{self.host(slot)}:8000"

    def namespace(self, slot):
        return f"{self.prefix}r{slot}"

    def _launch(self, slot):
        # `ip netns exec` execs the server: the process is the server itself.
        self.processes[slot] = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(slot), os.environ["ATTENTION_SERVER_BIN"],
             "--address", f"{self.host(slot)}:50051", "--http-address", self.rest(slot),
             "--metrics-address", f"{self.host(slot)}:9464", "--threads", "1",
             *self.server_flags],
            stdout=self.log, stderr=subprocess.STDOUT)

    def _supervise(self):
        """Test-only stand-in for run.sh's supervision: a replica that exits
        is started again at once."""
        while not self.stopping:
            with self.lock:
                for slot, process in list(self.processes.items()):
                    if process.poll() is not None and not self.stopping:
                        self.restarts += 1
                        self._launch(slot)
            time.sleep(0.02)

    def replicas(self):
        with self.lock:
            return {slot: Replica(slot, p.pid, f"{self.host(slot)}:50051", f"{self.host(slot)}:9464")
                    for slot, p in self.processes.items()}

    def replacement(self, slot, old_pid, seconds=30):
        def replaced():
            r = self.replicas()[slot]
            return r.pid != old_pid and ready(self.rest(slot)) and \
                edge_servers(self.edge_metrics).get(f"r{slot}") == "UP"
        wait_until(replaced, seconds, f"replica {slot} replaced and back in the edge's rotation")
        return self.replicas()[slot]

    def stop(self):
        self.stopping = True
        self.supervisor.join(timeout=5)
        # Every replica drains at once (a frozen one is woken first).
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            end(process, seconds=40)
        end(self.edge, signal.SIGUSR1, seconds=10)
        self.log.close()
        self.dir.cleanup()
