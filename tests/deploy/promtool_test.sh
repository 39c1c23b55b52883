#!/usr/bin/env bash
# promtool_test.sh: the compose stack's Prometheus configuration and alert
# rules are valid (promtool check), the alert unit tests in
# deploy/compose/alerts.test.yml and edge-alerts.test.yml (a replica down,
# replicas unbalanced) pass (promtool test rules), and every file the
# compose stack mounts exists where the services expect it.
set -euo pipefail

compose=$(cd "$(dirname "$0")/../.." && pwd)/deploy/compose
command -v promtool >/dev/null || { echo "promtool missing: scripts/install-deps.sh installs prometheus"; exit 1; }
cd "$compose"

passed=0
failed=0
step() {
  local name=$1
  shift
  if "$@"; then
    echo "ok   $name"
    passed=$((passed + 1))
  else
    echo "FAIL $name"
    failed=$((failed + 1))
  fi
}

step "promtool check config prometheus.yml" promtool check config prometheus.yml
step "promtool check rules alerts.yml" promtool check rules alerts.yml
step "promtool test rules alerts.test.yml" promtool test rules alerts.test.yml
step "promtool check rules edge-alerts.yml" promtool check rules edge-alerts.yml
step "promtool test rules edge-alerts.test.yml" promtool test rules edge-alerts.test.yml
step "docker-compose.yml mounts only files that exist, as the services expect them" \
  /usr/bin/python3 - <<'PY'
import json, os, sys
import yaml

compose = yaml.safe_load(open("docker-compose.yml"))
problems = []
for name, service in compose["services"].items():
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")) and not os.path.exists(source):
            problems.append(f"{name}: mounts missing {source}")
prometheus = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["prometheus"]["volumes"]}
config = yaml.safe_load(open("prometheus.yml"))
for rule_file in config["rule_files"]:
    if os.path.join("/etc/prometheus", rule_file) not in prometheus:
        problems.append(f"prometheus: rule file {rule_file} is not mounted next to prometheus.yml")
targets = [t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
if "attention-server:9464" not in targets:
    problems.append(f"prometheus.yml does not scrape attention-server:9464: {targets}")
# The edge's exporter, which edge-alerts.yml reads, where run.sh serves it.
entrypoint = compose["services"]["attention-server"]["entrypoint"]
edge_metrics = entrypoint[entrypoint.index("--edge-metrics-address") + 1] \
    if "--edge-metrics-address" in entrypoint else None
if not edge_metrics or f"attention-server:{edge_metrics.rsplit(':', 1)[1]}" not in targets:
    problems.append(f"prometheus.yml does not scrape the edge's metrics ({edge_metrics}): {targets}")
datasource = yaml.safe_load(open("grafana/provisioning/datasources/prometheus.yml"))["datasources"][0]
dashboard = json.load(open("grafana/dashboards/attention-service.json"))
default = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")["current"]["value"]
if datasource["uid"] != default:
    problems.append(f"dashboard's default data source {default} is not the provisioned {datasource['uid']}")
home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
if os.path.basename(home) not in os.listdir("grafana/dashboards"):
    problems.append(f"Grafana home dashboard {home} is not provisioned")
for p in problems:
    print(p, file=sys.stderr)
sys.exit(1 if problems else 0)
PY

echo "$passed passed, $failed failed"
((failed == 0))
