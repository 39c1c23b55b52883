#!/usr/bin/python3
"""k8s_test: the Kubernetes manifests in deploy/k8s render with
`kubectl kustomize`, pass an offline schema check (deploy/validate: the
Kubernetes and prometheus-operator OpenAPI schemas vendored by npm's
kubernetes-models), that check rejects type errors, and the rendered objects
keep the operational promises deploy/README.md makes; the HAProxy
configurations the rendered edge containers run (the pods' sidecar and the
edge StatefulSet in front of them) pass `haproxy -c` with the containers'
environment, and a broken one does not; two edge pods' HAProxy processes,
run on loopback from that configuration, share their sequence table (an
entry made on either is on the other, and one that starts gets the table).

  tests/deploy/k8s_test.py --tools-dir DIR   (npm packages are installed into DIR)

Installs what it lacks, once: kubectl (Debian's kubernetes-client, when no
kubectl is on PATH), node and npm (Debian's), and the validator's locked npm
packages.
"""

import argparse
import filecmp
import tempfile
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))
from ports import free_port  # noqa: E402

K8S = os.path.join(REPO, "deploy/k8s")
EDGE = os.path.join(REPO, "deploy/edge")
# Where the Dockerfile puts deploy/edge/ in the image.
IMAGE_EDGE = "/usr/local/share/attention-edge/"
VALIDATOR = os.path.join(REPO, "deploy/validate")
VALIDATOR_FILES = ("package.json", "package-lock.json", "validate-manifests.mjs")


def apt_install(packages):
    if os.geteuid() != 0:
        sys.exit(f"missing {' '.join(packages)}: install them (apt-get install {' '.join(packages)})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=600", "update"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "--no-install-recommends",
                    "-o", "DPkg::Lock::Timeout=600", *packages], check=True, env=env)


def ensure_tools(tools_dir):
    if not shutil.which("kubectl"):
        apt_install(["kubernetes-client"])
    if not shutil.which("node") or not shutil.which("npm"):
        apt_install(["nodejs", "npm"])
    os.makedirs(tools_dir, exist_ok=True)
    lock = os.path.join(tools_dir, "package-lock.json")
    fresh = os.path.isdir(os.path.join(tools_dir, "node_modules")) and os.path.exists(lock) and \
        filecmp.cmp(lock, os.path.join(VALIDATOR, "package-lock.json"), shallow=False)
    for name in VALIDATOR_FILES:
        shutil.copyfile(os.path.join(VALIDATOR, name), os.path.join(tools_dir, name))
    if not fresh:
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                       cwd=tools_dir, check=True)


def validate(tools_dir, manifests):
    """Runs the schema check on a YAML string; returns (exit code, output)."""
    result = subprocess.run(["node", os.path.join(tools_dir, "validate-manifests.mjs"), "-"],
                            input=manifests, capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout + result.stderr


class Checks:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def expect(self, ok, what):
        if ok:
            self.passed += 1
            print(f"ok   {what}")
        else:
            self.failed += 1
            print(f"FAIL {what}")


def by_kind(documents, kind, name=None):
    found = [d for d in documents if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    if len(found) != 1:
        raise AssertionError(f"expected one {kind} {name or ''}, found {len(found)}")
    return found[0]


def check_promises(documents, checks):
    """What deploy/README.md promises about the rendered objects."""
    deployment = by_kind(documents, "Deployment", "attention-server")
    pod = deployment["spec"]["template"]["spec"]
    server = next(c for c in pod["containers"] if c["name"] == "attention-server")
    config = by_kind(documents, "ConfigMap")["data"]

    checks.expect(pod["securityContext"].get("runAsNonRoot") is True, "pod runs as non-root")
    for container in pod["containers"] + pod.get("initContainers", []):
        sc = container.get("securityContext", {})
        checks.expect(sc.get("readOnlyRootFilesystem") is True and sc.get("allowPrivilegeEscalation") is False,
                      f"container {container['name']}: read-only root file system, no privilege escalation")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        checks.expect(server.get(probe, {}).get("grpc", {}).get("port") == 50051,
                      f"{probe} is a native gRPC probe on 50051")
    checks.expect(server["resources"]["requests"].get("cpu") and server["resources"]["limits"].get("memory"),
                  "server has CPU requests and a memory limit")
    pre_stop = server["lifecycle"]["preStop"]["exec"]["command"]
    sleep = int(pre_stop[1]) if pre_stop[0] == "sleep" else None
    grace = float(config["ATTENTION_SHUTDOWN_GRACE_SECONDS"])
    checks.expect(sleep is not None and pod["terminationGracePeriodSeconds"] > sleep + grace,
                  f"terminationGracePeriodSeconds ({pod['terminationGracePeriodSeconds']}) > preStop sleep "
                  f"({sleep}) + ATTENTION_SHUTDOWN_GRACE_SECONDS ({grace:g})")
    checks.expect(int(config.get("ATTENTION_MAX_CONNECTION_AGE_SECONDS", 0)) > 0,
                  "ATTENTION_MAX_CONNECTION_AGE_SECONDS is set, so gRPC connections rebalance")
    checks.expect(any(ref.get("configMapRef", {}).get("name") == by_kind(documents, "ConfigMap")["metadata"]["name"]
                      for ref in server.get("envFrom", [])),
                  "server reads its ATTENTION_* configuration from the generated ConfigMap")
    checks.expect(int(config.get("ATTENTION_REPOSITORY_POLL_SECONDS", 0)) > 0,
                  "ATTENTION_REPOSITORY_POLL_SECONDS is set, so a model copied onto the volume is served without a rollout")
    edge = next((c for c in pod["containers"] if c["name"] == "edge"), None)
    checks.expect(edge is not None and "haproxy" in edge["command"][0] and
                  any(p["containerPort"] == 50051 for p in edge["ports"]) and
                  not any(p["containerPort"] == 50051 for p in server.get("ports", [])),
                  "the edge sidecar (HAProxy), not the server, owns the pod's gRPC port 50051")
    server_env = {e["name"]: e.get("value") for e in server.get("env", [])}
    edge_env = {e["name"]: e.get("value") for e in (edge or {}).get("env", [])}
    checks.expect(server_env.get("ATTENTION_ADDRESS", "").startswith("127.0.0.1:") and
                  edge_env.get("ATTENTION_EDGE_BACKEND") == server_env.get("ATTENTION_ADDRESS"),
                  "the server listens on loopback only, where the edge sends its calls")
    checks.expect(server_env.get("ATTENTION_HTTP_ADDRESS", "").startswith("127.0.0.1:") and
                  edge_env.get("ATTENTION_EDGE_HTTP_BACKEND") ==
                  server_env.get("ATTENTION_HTTP_ADDRESS"),
                  "REST listens on loopback only, where the edge sends non-gRPC requests")
    delay = float(config.get("ATTENTION_DRAIN_DELAY_SECONDS", 0))
    checks.expect(0 < delay and sleep is not None and
                  pod["terminationGracePeriodSeconds"] > sleep + delay + grace,
                  f"ATTENTION_DRAIN_DELAY_SECONDS ({delay:g}) lets the edge's checks see NOT_SERVING, "
                  f"within terminationGracePeriodSeconds with the preStop and the grace")
    edge_stop = (edge or {}).get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    edge_sleep = int(edge_stop[1]) if edge_stop[:1] == ["sleep"] else None
    checks.expect(edge_sleep is not None and sleep is not None and
                  sleep + delay + grace <= edge_sleep < pod["terminationGracePeriodSeconds"],
                  f"the edge stops ({edge_sleep} s) after the server's preStop, drain delay and drain "
                  f"({sleep} + {delay:g} + {grace:g} s), within terminationGracePeriodSeconds")
    mounts = {m["mountPath"]: m["name"] for m in server["volumeMounts"]}
    volumes = {v["name"] for v in pod["volumes"]}
    checks.expect(mounts.get("/models") in volumes, "models come from a volume mounted at /models")

    headless = by_kind(documents, "Service", "attention-server-headless")
    edge_service = by_kind(documents, "Service", "attention-server-edge")
    front = by_kind(documents, "StatefulSet", "attention-edge")
    front_pod = front["spec"]["template"]["spec"]
    front_edge = front_pod["containers"][0]
    front_env = {e["name"]: e.get("value") for e in front_edge.get("env", [])}
    service = front_env.get("ATTENTION_EDGE_SERVICE", "")
    checks.expect(service.startswith(edge_service["metadata"]["name"] + ".") and
                  service.endswith(":" + str(edge_service["spec"]["ports"][0]["port"])) and
                  edge_service["spec"].get("clusterIP") == "None" and
                  edge_service["spec"].get("publishNotReadyAddresses") is True and
                  all(pod_labels_of(deployment).get(k) == v
                      for k, v in edge_service["spec"]["selector"].items()),
                  f"the edge pods resolve every server pod, ready or not, from a headless Service ({service})")
    peers = [by_kind(documents, "Service", f"attention-edge-{i}-peer") for i in range(front["spec"]["replicas"])]
    checks.expect(front["spec"]["replicas"] == 2 and
                  all(p["spec"]["selector"].get("statefulset.kubernetes.io/pod-name") == f"attention-edge-{i}" and
                      front_env.get(f"ATTENTION_EDGE_PEER_{i}", "").startswith(p["metadata"]["name"] + ".")
                      for i, p in enumerate(peers)) and
                  "-L" in front_edge["command"],
                  "the 2 edge pods share their sequence table: each reaches its peer through its own Service")
    checks.expect(all(front["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in
                      by_kind(documents, "Service", "attention-edge")["spec"]["selector"].items()),
                  "Service attention-edge selects the edge Deployment's pods")
    hpa_max = by_kind(documents, "HorizontalPodAutoscaler")["spec"]["maxReplicas"]
    with open(os.path.join(EDGE, "cluster.cfg")) as f:
        cluster_cfg = f.read()
    slots = [int(m) for m in re.findall(r"server-template \S+ 1-(\d+) ", cluster_cfg)]
    checks.expect(len(slots) == 4 and min(slots) >= hpa_max,
                  f"cluster.cfg has a server slot for each of the HPA's {hpa_max} pods in all 4 backends ({slots})")
    checks.expect(len(re.findall(r"balance hdr\(attention-sequence-id\)\s+hash-type consistent", cluster_cfg)) == 2 and
                  len(re.findall(r"stick on req\.hdr\(attention-sequence-id\)", cluster_cfg)) == 2 and
                  re.search(r"stick-table type string .* peers edges srvkey addr", cluster_cfg),
                  "the edge pods keep a sequence on its pod (a shared stick table, a consistent hash for new ones)")
    front_sc = front_edge.get("securityContext", {})
    checks.expect(front_pod["securityContext"].get("runAsNonRoot") is True and
                  front_sc.get("readOnlyRootFilesystem") is True and
                  front_sc.get("allowPrivilegeEscalation") is False,
                  "the edge Deployment runs as non-root on a read-only root file system")
    cluster_ip = by_kind(documents, "Service", "attention-server")
    labels = pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for service in (headless, cluster_ip):
        checks.expect(all(pod_labels.get(k) == v for k, v in service["spec"]["selector"].items()),
                      f"Service {service['metadata']['name']} selects the pods")
    checks.expect(headless["spec"].get("clusterIP") == "None", "headless Service has clusterIP None")
    checks.expect(cluster_ip["spec"].get("type", "ClusterIP") == "ClusterIP", "ClusterIP Service")

    hpa = by_kind(documents, "HorizontalPodAutoscaler")
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    checks.expect(metrics.get("Resource", {}).get("resource", {}).get("name") == "cpu", "HPA scales on CPU")
    checks.expect(metrics.get("Pods", {}).get("pods", {}).get("metric", {}).get("name") == "attention_queue_depth",
                  "HPA scales on the attention_queue_depth custom metric")
    checks.expect(hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"], "HPA targets the Deployment")
    with open(os.path.join(K8S, "prometheus-adapter-values.yaml")) as f:
        adapter_rules = yaml.safe_load(f)["rules"]["custom"]
    checks.expect(any(r["name"]["as"] == "attention_queue_depth" for r in adapter_rules),
                  "prometheus-adapter rule exposes attention_queue_depth")

    monitor = by_kind(documents, "PodMonitor", "attention-server")
    checks.expect(all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items()) and
                  monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics" and
                  any(p["name"] == "metrics" and p["containerPort"] == 9464 for p in server["ports"]),
                  "PodMonitor scrapes the metrics port (9464) of the pods")
    checks.expect(labels.get(monitor["spec"]["jobLabel"]) == "attention-server",
                  "PodMonitor's job label is attention-server, as the alert rules expect")


# Type errors the schema check must reject: (description, pattern, replacement).
TYPE_ERRORS = [
    ("string where an integer belongs (HPA minReplicas)", r"minReplicas: 2", 'minReplicas: "2"'),
    ("string where a port number belongs (containerPort)", r"containerPort: 50051", "containerPort: grpc-port"),
    ("number where a duration string belongs (PodMonitor interval)", r"interval: 15s", "interval: 15"),
    ("string where a boolean belongs (readOnlyRootFilesystem)", r"readOnlyRootFilesystem: true",
     'readOnlyRootFilesystem: "yes"'),
]


def pod_labels_of(workload):
    return workload["spec"]["template"]["metadata"]["labels"]


def edge_containers(documents):
    """(name, command, env) of every rendered container that runs haproxy."""
    found = []
    for d in documents:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c.get("command", [""])[0] == "haproxy":
                found.append((f"{d['metadata']['name']}/{c['name']}", c["command"], c.get("env", [])))
    return found


def haproxy_check(command, env, extra=""):
    """`haproxy -c` on the files `command` names, read from deploy/edge/ (as
    the Dockerfile copies them), with the container's environment
    ($(VAR) references expanded as the kubelet does; the namespace is
    "attention", the pod attention-edge-0), its -L (peer name) if any, and
    the edge peers' addresses, which only the cluster's DNS resolves, on
    loopback; `extra` is appended to the last file. Returns (ok, output)."""
    variables = {"POD_NAMESPACE": "attention", "POD_NAME": "attention-edge-0"}

    def expand(value):
        return re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), value)

    for e in (e for e in env if "value" in e):
        variables[e["name"]] = expand(e["value"])
        if e["name"].startswith("ATTENTION_EDGE_PEER_") and ":" in e["value"]:
            variables[e["name"]] = "127.0.0.1:" + variables[e["name"]].rsplit(":", 1)[1]
    files = [a for a in command if a.startswith(IMAGE_EDGE)]
    local_peer = [a for i, a in enumerate(command) if i and command[i - 1] == "-L"]
    options = ["-L", expand(local_peer[0])] if local_peer else []
    with tempfile.TemporaryDirectory() as scratch:
        paths = [os.path.join(EDGE, os.path.relpath(f, IMAGE_EDGE)) for f in files]
        if extra:
            # A copy next to the original, so its relative errorfile paths hold.
            broken = os.path.join(EDGE, ".k8s_test_broken.cfg")
            with open(paths[-1]) as f, open(broken, "w") as out:
                out.write(f.read() + extra)
            paths[-1] = broken
        try:
            result = subprocess.run(["haproxy", "-c", *options, *[a for p in paths for a in ("-f", p)]],
                                    env={**os.environ, **{k: v for k, v in variables.items()
                                                          if k not in ("POD_NAMESPACE", "POD_NAME")}},
                                    capture_output=True, text=True, timeout=60, cwd=scratch)
        finally:
            if extra:
                os.unlink(broken)
    return result.returncode == 0 and "Configuration file is valid" in result.stdout, \
        result.stdout + result.stderr


def check_edge_configs(documents, checks):
    """The HAProxy configurations of the rendered edge containers are valid,
    and every file they name is one the Dockerfile puts in the image."""
    if not shutil.which("haproxy"):
        checks.expect(False, "haproxy is installed (scripts/install-deps.sh), to check the edge configurations")
        return
    with open(os.path.join(REPO, "Dockerfile")) as f:
        copied = " ".join(line for line in f.read().replace("\\\n", " ").splitlines()
                          if line.startswith("COPY") and IMAGE_EDGE in line)
    containers = edge_containers(documents)
    checks.expect(len(containers) == 2, f"two edge containers: the sidecar and the edge Deployment ({containers and [c[0] for c in containers]})")
    for name, command, env in containers:
        files = [a for a in command if a.startswith(IMAGE_EDGE)]
        checks.expect(files and all(f"deploy/edge/{os.path.relpath(f, IMAGE_EDGE)}" in copied for f in files),
                      f"{name}: the Dockerfile copies {files} into the image")
        ok, output = haproxy_check(command, env)
        checks.expect(ok, f"{name}: haproxy -c accepts its configuration" + ("" if ok else f"\n{output}"))
        ok, _ = haproxy_check(command, env, "\nbackend attention\n    server extra 127.0.0.1:1\n")
        checks.expect(not ok, f"{name}: haproxy -c rejects it with a backend defined twice")


def haproxy_cli(path, command):
    """One command to an HAProxy stats socket; its answer."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(command.encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while data := s.recv(65536):
            answer += data
    return answer.decode()


def check_edge_peers(documents, checks):
    """The edge StatefulSet's two pods, as two HAProxy processes on loopback
    with the rendered container's command and environment (the peers'
    Services replaced by loopback ports): an entry of the sequence table set
    on attention-edge-0 before attention-edge-1 starts reaches it, and one
    set on attention-edge-1 reaches attention-edge-0."""
    front = by_kind(documents, "StatefulSet", "attention-edge")
    container = front["spec"]["template"]["spec"]["containers"][0]
    files = [os.path.join(EDGE, os.path.relpath(a, IMAGE_EDGE))
             for a in container["command"] if a.startswith(IMAGE_EDGE)]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    ports = [free_port(), free_port()]
    processes = []
    with tempfile.TemporaryDirectory() as scratch:
        try:
            sockets = []
            for i in (0, 1):
                name = f"attention-edge-{i}"
                sockets.append(os.path.join(scratch, f"{i}.sock"))
                extra = os.path.join(scratch, f"{i}.cfg")
                with open(extra, "w") as f:
                    f.write(f'global\n    stats socket "{sockets[i]}" mode 600 level admin\n')
                variables = {**{k: v.replace("$(POD_NAMESPACE)", "attention") for k, v in env.items()},
                             "ATTENTION_EDGE_PEER_NAME": name,
                             "ATTENTION_EDGE_PEER_0": f"127.0.0.1:{ports[0]}",
                             "ATTENTION_EDGE_PEER_1": f"127.0.0.1:{ports[1]}",
                             "ATTENTION_EDGE_PEERS_BIND": f"127.0.0.1:{ports[i]}",
                             "ATTENTION_EDGE_LISTEN": f"127.0.0.1:{free_port()}",
                             "ATTENTION_EDGE_METRICS_LISTEN": f"127.0.0.1:{free_port()}"}
                if i == 1:
                    # attention-edge-0 holds an entry before its peer starts.
                    haproxy_cli(sockets[0], "set table attention_sequence key before data.server_id 1")
                processes.append(subprocess.Popen(
                    ["haproxy", "-db", "-L", name, *[a for p in files for a in ("-f", p)], "-f", extra],
                    env={**os.environ, **variables}, cwd=scratch,
                    stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
                give_up = time.monotonic() + 10
                while not os.path.exists(sockets[i]) and time.monotonic() < give_up:
                    time.sleep(0.05)

            def has(i, key):
                give_up = time.monotonic() + 10
                while time.monotonic() < give_up:
                    if f"key={key} " in haproxy_cli(sockets[i], "show table attention_sequence"):
                        return True
                    time.sleep(0.1)
                return False

            checks.expect(has(1, "before"), "edge peers: attention-edge-1 starts with the table "
                          "attention-edge-0 holds")
            haproxy_cli(sockets[1], "set table attention_sequence key after data.server_id 2")
            checks.expect(has(0, "after"), "edge peers: an entry made on attention-edge-1 reaches "
                          "attention-edge-0")
        except OSError as error:
            checks.expect(False, f"edge peers: the two edges ran ({error!r})")
        finally:
            for process in processes:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools-dir", required=True)
    args = parser.parse_args()
    ensure_tools(args.tools_dir)
    checks = Checks()

    render = subprocess.run(["kubectl", "kustomize", K8S], capture_output=True, text=True, timeout=120)
    checks.expect(render.returncode == 0, "kubectl kustomize deploy/k8s renders" + (f": {render.stderr.strip()}" if render.returncode else ""))
    if render.returncode != 0:
        return 1
    rendered = render.stdout

    code, output = validate(args.tools_dir, rendered)
    print(output.rstrip())
    checks.expect(code == 0, "rendered manifests pass the schema check")

    for what, pattern, replacement in TYPE_ERRORS:
        broken, count = re.subn(pattern, replacement, rendered, count=1)
        if count != 1:
            checks.expect(False, f"schema check rejects {what}: '{pattern}' not in the rendered manifests")
            continue
        code, output = validate(args.tools_dir, broken)
        checks.expect(code != 0 and "FAIL" in output, f"schema check rejects {what}")

    checks.expect(validate(args.tools_dir, rendered.replace("kind: PodDisruptionBudget", "kind: PodDisruptionBudgett"))[0] != 0,
                  "schema check rejects a kind it has no schema for")

    try:
        documents = list(yaml.safe_load_all(rendered))
        check_promises(documents, checks)
        check_edge_configs(documents, checks)
        if shutil.which("haproxy"):
            check_edge_peers(documents, checks)
    except (AssertionError, KeyError, StopIteration, TypeError, ValueError, IndexError) as err:
        checks.expect(False, f"rendered manifests have the expected shape: {err!r}")

    print(f"{checks.passed} passed, {checks.failed} failed")
    return 0 if checks.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
