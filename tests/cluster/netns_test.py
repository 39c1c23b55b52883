"""netns_test: the cluster suite. Three attention-servers,
each in its own network namespace with one address (10.77.<i>.2, a veth pair
into the namespace holding the edge), behind the edge (HAProxy on the
configuration run.sh uses: deploy/edge/haproxy.cfg + backends.sh), under 8
client threads of small Attend calls over one connection, and a real
Prometheus (Debian's) scraping every replica and the edge, with
deploy/compose/edge-alerts.yml loaded. Every address is inside namespaces
this test makes and deletes, or their loopback.

  - balance: each replica within 0.08 of 1/3;
  - kill -9 of a replica: no call fails; replaced (by a test-only
    supervisor, as run.sh would; run_sh_test.py covers run.sh's own) and
    back in the edge's rotation within 5 s;
  - rolling SIGTERM of all three: no call fails (needs the server's drain
    that serves while NOT_SERVING);
  - SIGSTOP of a replica for 12 s, then one replica's link down for 10 s and
    up (2 s deadlines): at most 2 failed calls per thread, none begun later
    than 3.5 s into the fault; meanwhile Prometheus has AttentionReplicaDown
    pending for that replica;
  - 6 session decodes of 96 steps, the replica holding the most killed at
    step 48: all 6 finish within 1e-4 of an uninterrupted run (needs the
    Python client's replay);
  - 8 Triton sequences of 48 unary ModelInfer steps with the
    attention-sequence-id header: none refused (and, as controls, refusals
    without it or with an invalid one);
  - Prometheus: every target up, each replica's and the edge's series
    present, the edge alerts' expressions and rules evaluate.

Each figure is printed ("figure ...: ...") for the record. Needs root (ip
netns); exits 77 (skipped) with the reason where namespaces cannot be made.
ATTENTION_CLUSTER_STEPS (e.g. "freeze,partition") runs only the steps named:
balance, kill, rolling, freeze, partition, sessions, triton, prometheus.

    ATTENTION_SERVER_BIN=build/server/attention-server \\
        build/tests/python-client-venv/bin/python tests/cluster/netns_test.py
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "deploy"))
REPLICAS = 3
SKIP = 77


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def make_namespaces(prefix):
    """The edge's namespace PREFIXe and PREFIXr1..3, each replica's joined to
    it by a veth pair: e<i> 10.77.<i>.1/24 there, r 10.77.<i>.2/24 in it."""
    edge = prefix + "e"
    ip("netns", "add", edge)
    ip("-n", edge, "link", "set", "lo", "up")
    for i in range(1, REPLICAS + 1):
        replica = f"{prefix}r{i}"
        ip("netns", "add", replica)
        ip("-n", replica, "link", "set", "lo", "up")
        ip("link", "add", f"e{i}", "netns", edge, "type", "veth", "peer", "name", "r",
           "netns", replica)
        ip("-n", edge, "addr", "add", f"10.77.{i}.1/24", "dev", f"e{i}")
        ip("-n", replica, "addr", "add", f"10.77.{i}.2/24", "dev", "r")
        ip("-n", edge, "link", "set", f"e{i}", "up")
        ip("-n", replica, "link", "set", "r", "up")


def delete_namespaces(prefix):
    """Ends what still runs in them (only this test's processes: the
    namespaces are its own), then deletes them."""
    names = [prefix + "e"] + [f"{prefix}r{i}" for i in range(1, REPLICAS + 1)]
    for name in names:
        pids = ip("netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
    for name in names:
        ip("netns", "del", name, check=False)


def outside():
    """Makes the namespaces, runs this file again inside the edge's, and
    deletes them whatever happens."""
    if os.geteuid() != 0:
        print("SKIP: network namespaces need root (ip netns add)")
        return SKIP
    if not shutil.which("ip"):
        print("SKIP: iproute2's ip is not installed")
        return SKIP
    prefix = f"at{os.getpid() % 100000}"
    try:
        try:
            make_namespaces(prefix)
        except subprocess.CalledProcessError as error:
            print(f"SKIP: cannot make network namespaces: {' '.join(error.cmd)}: "
                  f"{error.stderr.strip()}")
            return SKIP
        inside = subprocess.run(["ip", "netns", "exec", prefix + "e", sys.executable,
                                 os.path.abspath(__file__), "--inside", prefix], timeout=900)
        return inside.returncode
    finally:
        delete_namespaces(prefix)
        left = [n for n in ip("netns", "list", check=False).stdout.split() if n.startswith(prefix)]
        if left:
            print(f"FAIL namespaces left behind: {left}")
            return 1


class Prometheus:
    """Debian's prometheus, scraping every replica and the edge each second
    and evaluating deploy/compose/edge-alerts.yml."""

    def __init__(self, replica_set):
        from replica_set import free_port
        self.dir = tempfile.TemporaryDirectory()
        self.port = free_port()
        rules = os.path.join(os.path.dirname(os.path.dirname(HERE)), "deploy", "compose",
                             "edge-alerts.yml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "900ms"},
            "rule_files": [rules],
            "scrape_configs": [
                {"job_name": "attention-server", "static_configs": [
                    {"targets": [r.metrics_address for r in replica_set.replicas().values()]}]},
                {"job_name": "attention-edge",
                 "static_configs": [{"targets": [replica_set.edge_metrics]}]}]}
        path = os.path.join(self.dir.name, "prometheus.yml")
        with open(path, "w") as f:
            json.dump(config, f)  # JSON is YAML
        self.log = open(os.path.join(self.dir.name, "log"), "wb")
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={path}", f"--storage.tsdb.path={self.dir.name}/data",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def api(self, path, **query):
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        if body.get("status") != "success":
            raise RuntimeError(f"{path}: {body}")
        return body["data"]

    def query(self, expr):
        return self.api("query", query=expr)["result"]

    def pending(self, alertname):
        """Servers (label) whose alert `alertname` is pending or firing."""
        return {a["labels"].get("server") for a in self.api("alerts")["alerts"]
                if a["labels"].get("alertname") == alertname}

    def stop(self):
        from replica_set import end
        end(self.process, seconds=30)
        self.log.close()
        self.dir.cleanup()


def check_prometheus(checks, prometheus, replica_set):
    from prometheus_queries_test import with_bool_comparison
    import yaml
    up = {s["metric"]["instance"]: s["value"][1] for s in prometheus.query("up")}
    targets = [r.metrics_address for r in replica_set.replicas().values()] + [replica_set.edge_metrics]
    checks.expect(sorted(up) == sorted(targets) and set(up.values()) == {"1"},
                  f"Prometheus: every replica and the edge scraped and up ({up})")
    served = {s["metric"]["instance"]: float(s["value"][1]) for s in
              prometheus.query('sum by (instance) (attention_requests_total{code="OK"})')}
    figure_line = " ".join(f"{k} {v:.0f}" for k, v in sorted(served.items()))
    print(f"figure Prometheus: calls answered OK per replica: {figure_line}")
    checks.expect(len(served) == REPLICAS and all(v > 0 for v in served.values()),
                  "Prometheus: each replica's attention_requests_total")
    live = prometheus.query('count(haproxy_server_status{proxy="attention_http",state="UP"} == 1)')
    checks.expect(live and live[0]["value"][1] == str(REPLICAS),
                  f"Prometheus: the edge's exporter counts {REPLICAS} replicas UP ({live})")
    with open(os.path.join(os.path.dirname(os.path.dirname(HERE)), "deploy", "compose",
                           "edge-alerts.yml")) as f:
        rules = [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]
    for rule in rules:
        result = prometheus.query(with_bool_comparison(rule["expr"].strip()))
        checks.expect(len(result) > 0, f"Prometheus: {rule['alert']}'s expression evaluates on "
                      f"the real edge ({len(result)} series)")
    health = {r["name"]: r["health"] for g in prometheus.api("rules")["groups"] for r in g["rules"]}
    checks.expect(health and set(health.values()) == {"ok"}, f"Prometheus: rules healthy ({health})")


def inside(prefix):
    import scenarios
    from replica_set import NamespaceSet
    checks = scenarios.Checks()
    subprocess.run(["uptime"])
    replica_set = NamespaceSet(prefix, REPLICAS, ["--drain-delay-seconds", "2"])
    prometheus = Prometheus(replica_set)

    def freeze():
        frozen = replica_set.replicas()[1].pid
        scenarios.check_outage(checks, replica_set, "SIGSTOP for 12 s",
                               lambda: os.kill(frozen, signal.SIGSTOP),
                               lambda: os.kill(frozen, signal.SIGCONT), 12.0)
        scenarios.wait_until(lambda: scenarios.edge_servers(replica_set.edge_metrics).get("r1") == "UP",
                             30, "r1 back in the rotation after SIGCONT")

    def partition():
        seen = set()

        def link(state):
            ip("-n", f"{prefix}r3", "link", "set", "r", state)

        def watch():
            try:
                seen.update(prometheus.pending("AttentionReplicaDown"))
            except OSError:
                pass
        scenarios.check_outage(checks, replica_set, "link down 10 s", lambda: link("down"),
                               lambda: link("up"), 10.0, during=watch)
        checks.expect("r3" in seen, f"Prometheus: AttentionReplicaDown pending for r3 while its "
                      f"link is down ({seen})")
        scenarios.wait_until(lambda: scenarios.edge_servers(replica_set.edge_metrics).get("r3") == "UP",
                             30, "r3 back in the rotation after its link is up")

    def prometheus_checks():
        time.sleep(2.0)  # a last scrape of every target
        check_prometheus(checks, prometheus, replica_set)

    steps = {"balance": lambda: scenarios.check_balance(checks, replica_set),
             "kill": lambda: scenarios.check_kill9(checks, replica_set, slot=2),
             "rolling": lambda: scenarios.check_rolling(checks, replica_set),
             "freeze": freeze, "partition": partition,
             "sessions": lambda: scenarios.check_sessions(checks, replica_set),
             "triton": lambda: scenarios.check_triton(checks, replica_set),
             "prometheus": prometheus_checks}
    # ATTENTION_CLUSTER_STEPS=freeze,partition runs only those (in this order).
    wanted = os.environ.get("ATTENTION_CLUSTER_STEPS", ",".join(steps)).split(",")
    unknown = [w for w in wanted if w not in steps]
    if unknown:
        print(f"ATTENTION_CLUSTER_STEPS: unknown {unknown}; the steps are {', '.join(steps)}")
        return 2
    try:
        for name in wanted:
            steps[name]()
        print(f"figure supervisor restarts: {replica_set.restarts}")
    except Exception as error:  # noqa: BLE001 - reported as a failure
        checks.expect(False, f"the scenario ran to its end: {error!r}")
    finally:
        prometheus.stop()
        replica_set.stop()
    subprocess.run(["uptime"])
    return checks.summary()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--inside":
        sys.exit(inside(sys.argv[2]))
    sys.exit(outside())
