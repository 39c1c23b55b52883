#!/usr/bin/python3
"""prometheus_queries_test: every Grafana dashboard query, every alert
expression and the prometheus-adapter rule run through a real Prometheus that
scrapes a real attention-server, all on 127.0.0.1.

A query fails the test when Prometheus reports an error, returns no series, or
returns only NaN (a query that never saw the traffic it is about). Alert
expressions compare a quantity with a threshold and are legitimately empty
while the server is healthy, so each is run with `bool` added to its top-level
comparison (`x > 0.5` becomes `x > bool 0.5`): that keeps every series and
checks the whole expression. The rules file is also loaded into Prometheus,
whose rule evaluations must report health "ok".

  tests/deploy/prometheus_queries_test.py --server BIN --client BIN
"""

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))
from ports import free_port  # noqa: E402

DASHBOARD = os.path.join(REPO, "deploy/compose/grafana/dashboards/attention-service.json")
ALERTS = os.path.join(REPO, "deploy/compose/alerts.yml")
ADAPTER = os.path.join(REPO, "deploy/k8s/prometheus-adapter-values.yaml")
DEADLINE_SECONDS = 240  # the whole test; every wait below is bounded by it
SCRAPE_SECONDS = 1

# The target labels prometheus-operator's PodMonitor gives a pod's series.
POD_LABELS = {"namespace": "attention", "pod": "attention-server-0"}

# Grafana's template variables, as "All" selected; Prometheus sees the result.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model": ".*", "$instance": ".*"}


class Failure(Exception):
    pass


class Processes:
    """Starts processes and stops every one of them on exit."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.started = []

    def start(self, name, argv):
        log = open(os.path.join(self.workdir, f"{name}.log"), "wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.started.append((name, proc))
        return proc

    def log(self, name):
        with open(os.path.join(self.workdir, f"{name}.log"), errors="replace") as f:
            return f.read()[-4000:]

    def stop_all(self):
        for _, proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.started):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(what, check, deadline, interval=0.25):
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    raise Failure(f"timed out waiting for {what}")


def prometheus_query(port, expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
    except urllib.error.HTTPError as err:
        # A starting Prometheus answers 503 with a plain-text body.
        text = err.read().decode(errors="replace")
        try:
            body = json.loads(text)
        except ValueError:
            raise Failure(f"HTTP {err.code}: {text.strip()[:200]}") from None
    if body.get("status") != "success":
        raise Failure(f"{body.get('errorType')}: {body.get('error')}")
    return body["data"]


def finite_values(data):
    """The finite sample values of an instant query's vector or scalar result."""
    if data["resultType"] == "vector":
        values = [float(s["value"][1]) for s in data["result"]]
    elif data["resultType"] == "scalar":
        values = [float(data["result"][1])]
    else:
        raise Failure(f"unexpected result type {data['resultType']}")
    return [v for v in values if math.isfinite(v)]


def with_bool_comparison(expr):
    """Inserts `bool` after the last comparison operator outside parentheses,
    brackets, braces and strings: `a > 0.5` -> `a > bool 0.5`."""
    depth, quote, last = 0, None, None
    i = 0
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            two = expr[i:i + 2]
            if two in ("==", "!=", ">=", "<="):
                last = i + 2
                i += 1
            elif c in "<>":
                last = i + 1
        i += 1
    if last is None:
        raise Failure(f"no top-level comparison in alert expression: {expr}")
    return expr[:last] + " bool" + expr[last:]


def dashboard_queries():
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    queries = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        # label_values(selector, label) is Grafana's; Prometheus answers the same
        # question with group by (label) (selector).
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["query"]["query"])
        if not m:
            raise Failure(f"variable {variable['name']}: unexpected query {variable['query']}")
        queries.append((f"variable {variable['name']}", f"group by ({m[2]}) ({m[1]})"))
    for panel in dashboard["panels"]:
        if not panel.get("targets"):
            raise Failure(f"panel {panel['title']!r} has no queries")
        for target in panel["targets"]:
            queries.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for i, (name, expr) in enumerate(queries):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        if "$" in expr:
            raise Failure(f"{name}: unsubstituted variable in {expr}")
        queries[i] = (name, expr)
    return queries


def alert_queries():
    with open(ALERTS) as f:
        groups = yaml.safe_load(f)["groups"]
    return [(f"alert {rule['alert']}", with_bool_comparison(rule["expr"].strip()))
            for group in groups for rule in group["rules"] if "alert" in rule]


def adapter_queries():
    """The prometheus-adapter rule, its templates filled in as the adapter
    fills them when the HPA asks for the pods of one namespace."""
    with open(ADAPTER) as f:
        rules = yaml.safe_load(f)["rules"]["custom"]
    queries = []
    for rule in rules:
        queries.append((f"adapter seriesQuery {rule['name']['as']}", rule["seriesQuery"]))
        series = re.match(r"\s*(\w+)", rule["seriesQuery"])[1]
        expr = (rule["metricsQuery"].replace("<<.Series>>", series)
                .replace("<<.LabelMatchers>>", f'namespace="{POD_LABELS["namespace"]}",pod=~"{POD_LABELS["pod"]}"')
                .replace("<<.GroupBy>>", "pod"))
        queries.append((f"adapter metricsQuery {rule['name']['as']}", expr))
    return queries


def run_client(client, args, deadline, stdin=None):
    return subprocess.run([client, *args], input=stdin, capture_output=True, text=True,
                          timeout=max(1, deadline - time.monotonic()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--client", required=True)
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "prometheus")
    args = parser.parse_args()
    deadline = time.monotonic() + DEADLINE_SECONDS

    queries = dashboard_queries() + alert_queries() + adapter_queries()
    workdir = tempfile.mkdtemp(prefix="deploy-prometheus-")
    processes = Processes(workdir)
    failures = []
    passed = 0
    try:
        # The example models plus one file that is not a model, so the load
        # failure counter (and the alert on it) has a series to show.
        repository = os.path.join(workdir, "models")
        shutil.copytree(os.path.join(REPO, "models"), repository)
        with open(os.path.join(repository, "broken.safetensors"), "wb") as f:
            f.write(b"not a safetensors file")
        port_file = os.path.join(workdir, "ports")
        processes.start("server", [
            args.server, "--address", "127.0.0.1:0", "--http-address", "127.0.0.1:0",
            "--metrics-address", "127.0.0.1:0",
            "--port-file", port_file, "--model-repository", repository,
            "--max-batch-size", "8", "--queue-capacity", "256"])
        ports = wait_for("the server's port file", lambda: os.path.exists(port_file) and dict(
            line.split() for line in open(port_file) if line.strip()), deadline)
        grpc_target, metrics_target = ports["grpc"], ports["metrics"]

        prometheus_port = free_port()
        config = os.path.join(workdir, "prometheus.yml")
        with open(config, "w") as f:
            yaml.safe_dump({
                "global": {"scrape_interval": f"{SCRAPE_SECONDS}s",
                           "evaluation_interval": f"{SCRAPE_SECONDS}s"},
                "rule_files": [ALERTS],
                "scrape_configs": [{"job_name": "attention-server",
                                    "static_configs": [{"targets": [metrics_target],
                                                        "labels": POD_LABELS}]}],
            }, f)
        processes.start("prometheus", [
            args.prometheus, f"--config.file={config}",
            f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}", "--log.level=warn"])

        def scraped():
            try:
                return prometheus_query(prometheus_port, 'up{job="attention-server"} == 1')["result"]
            except (OSError, Failure):
                return None
        wait_for("Prometheus to scrape the server", scraped, deadline)

        # Traffic: successful requests that get batched, and one for a model
        # that does not exist (a NOT_FOUND in attention_requests_total).
        bench = run_client(args.client, ["bench", "--target", grpc_target, "--model", "dot_product",
                                         "--concurrency", "8", "--duration", "2", "--warmup", "0"],
                           deadline)
        if bench.returncode != 0:
            raise Failure(f"attention-client bench failed: {bench.stderr}")
        missing = run_client(args.client, ["attend", "--target", grpc_target], deadline, stdin=json.dumps({
            "model": "no_such_model", "queries": {"shape": [1, 1, 2], "data": [1, 2]}}))
        if missing.returncode == 0 or "NOT_FOUND" not in missing.stderr:
            raise Failure(f"an Attend for an unknown model should fail with NOT_FOUND: {missing.stderr}")

        # Rates need two scrapes after the traffic. The NOT_FOUND series is born
        # at 1 and stays there, so only its presence can be awaited.
        def counted():
            return prometheus_query(prometheus_port, 'attention_requests_total{code="NOT_FOUND"}')["result"] and \
                prometheus_query(prometheus_port, 'sum(rate(attention_batch_size_count[1m])) > 0')["result"]
        wait_for("the traffic to show in rates", counted, deadline)

        for name, expr in queries:
            try:
                values = finite_values(prometheus_query(prometheus_port, expr))
                if not values:
                    raise Failure("no finite value in the result (empty or all NaN)")
                print(f"ok   {name}: {len(values)} series")
                passed += 1
            except Failure as err:
                failures.append(f"{name}: {err}\n     query: {expr}")

        # Every rule must have been evaluated without error.
        def evaluated():
            with urllib.request.urlopen(f"http://127.0.0.1:{prometheus_port}/api/v1/rules", timeout=10) as r:
                rules = [rule for g in json.load(r)["data"]["groups"] for rule in g["rules"]]
            never = "0001-01-01"  # Prometheus' lastEvaluation before the first one
            return rules if rules and not any(rule["lastEvaluation"].startswith(never)
                                              for rule in rules) else None
        for rule in wait_for("every rule to be evaluated", evaluated, deadline):
            if rule["health"] != "ok":
                failures.append(f"rule {rule['name']}: health {rule['health']}: {rule.get('lastError')}")
            else:
                print(f"ok   rule {rule['name']}: evaluated, health ok")
                passed += 1
    except (Failure, subprocess.TimeoutExpired) as err:
        failures.append(str(err))
        for name, _ in processes.started:
            print(f"--- {name} log ---\n{processes.log(name)}", file=sys.stderr)
    finally:
        processes.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)

    for failure in failures:
        print(f"FAIL {failure}")
    print(f"{passed} passed, {len(failures)} failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
