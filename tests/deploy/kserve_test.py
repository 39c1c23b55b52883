#!/usr/bin/python3
"""kserve_test: the KServe manifests in deploy/kserve validate against KServe's
published CRD schemas (tests/deploy/kserve_crds, vendored with their license;
nothing is fetched), the check rejects broken copies of them, and the
manifests keep what deploy/README.md promises of the runtime.

  tests/deploy/kserve_test.py

Needs python3-yaml and python3-jsonschema (Debian's).

The schemas are the CRDs' openAPIV3Schema, made strict as kubectl's default
field validation is: an object schema with `properties` admits no other
field unless it says x-kubernetes-preserve-unknown-fields or
additionalProperties.
"""

import copy
import gzip
import hashlib
import os
import re
import sys

import jsonschema
import yaml

from k8s_test import Checks  # the same ok/FAIL tally

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
KSERVE = os.path.join(REPO, "deploy/kserve")
CRDS = os.path.join(HERE, "kserve_crds")
FORMAT = "attention-safetensors"


def strict(schema):
    """A copy of `schema` that refuses fields it does not name."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        result["additionalProperties"] = False
    return result


def load_crds(checks):
    """{(apiVersion, kind): validator}, from the vendored CRDs, whose hashes
    must match kserve_crds/README.md."""
    with open(os.path.join(CRDS, "README.md")) as f:
        hashes = dict(re.findall(r"`(serving\.kserve\.io_\w+\.yaml\.gz)`.*`([0-9a-f]{64})`", f.read()))
    checks.expect(os.path.exists(os.path.join(CRDS, "LICENSE")), "the CRDs' license is vendored")
    validators = {}
    for name, expected in sorted(hashes.items()):
        with gzip.open(os.path.join(CRDS, name), "rb") as f:
            data = f.read()
        checks.expect(hashlib.sha256(data).hexdigest() == expected,
                      f"{name} is the upstream file README.md names")
        crd = yaml.safe_load(data)
        group = crd["spec"]["group"]
        for version in crd["spec"]["versions"]:
            if not version.get("served"):
                continue
            schema = strict(version["schema"]["openAPIV3Schema"])
            key = (f"{group}/{version['name']}", crd["spec"]["names"]["kind"])
            validators[key] = jsonschema.Draft7Validator(schema)
    checks.expect(len(validators) == 2, f"two CRD schemas loaded, found {sorted(validators)}")
    return validators


def errors(validators, document):
    """Why `document` is not a valid object of its kind (empty: it is)."""
    key = (document.get("apiVersion"), document.get("kind"))
    if key not in validators:
        return [f"no KServe CRD for {key}"]
    found = [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
             for e in validators[key].iter_errors(document)]
    if not isinstance(document.get("metadata"), dict) or not document["metadata"].get("name"):
        found.append("metadata.name: missing")
    return found


def load_manifests():
    manifests = {}
    for name in sorted(os.listdir(KSERVE)):
        if name.endswith(".yaml"):
            with open(os.path.join(KSERVE, name)) as f:
                manifests[name] = [d for d in yaml.safe_load_all(f) if d is not None]
    return manifests


def check_schemas(checks, validators, manifests):
    for name, documents in manifests.items():
        for document in documents:
            found = errors(validators, document)
            checks.expect(not found, f"{name}: {document.get('kind')} matches KServe's CRD"
                          + "".join(f"\n       {e}" for e in found))


def check_broken_copies_fail(checks, validators, runtime, service):
    """Each breakage is one a reader could make; each must be refused."""
    def broken(document, path, value):
        copied = copy.deepcopy(document)
        target = copied
        for step in path[:-1]:
            target = target[step]
        if value is None:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return copied

    container = ["spec", "containers", 0]
    cases = [
        ("port number as text", broken(runtime, container + ["ports", 0, "containerPort"], "8001")),
        ("misspelt field", broken(runtime, ["spec", "protocolVersion"], ["v2"])),
        ("model format without a name", broken(runtime, ["spec", "supportedModelFormats", 0],
                                               {"version": "1"})),
        ("probe with an unknown handler", broken(runtime, container + ["readinessProbe"],
                                                 {"grpcHealth": {"port": 8001}})),
        ("runtime without containers", broken(runtime, ["spec", "containers"], None)),
        ("storageUri misspelt", broken(service, ["spec", "predictor", "model", "storageURI"],
                                       "s3://bucket/models")),
        ("modelFormat as text", broken(service, ["spec", "predictor", "model", "modelFormat"],
                                       FORMAT)),
        ("wrong kind", broken(service, ["kind"], "InferenceServices")),
    ]
    for what, document in cases:
        checks.expect(bool(errors(validators, document)), f"a broken copy is refused: {what}")


def single(manifests, kind, name=None):
    found = [d for docs in manifests.values() for d in docs
             if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    if len(found) < 1:
        raise AssertionError(f"no {kind} {name or ''} in deploy/kserve")
    return found


def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def check_runtime_promises(checks, runtime, services):
    spec = runtime["spec"]
    formats = [f["name"] for f in spec["supportedModelFormats"]]
    checks.expect(formats == [FORMAT], f"the runtime supports the format {FORMAT}: {formats}")
    checks.expect(spec.get("protocolVersions") == ["v2", "grpc-v2"],
                  f"protocolVersions [v2, grpc-v2]: {spec.get('protocolVersions')}")
    container = spec["containers"][0]
    checks.expect(env_of(container).get("ATTENTION_MODEL_REPOSITORY") == "/mnt/models",
                  "the model repository is /mnt/models")
    ports = container.get("ports", [])
    checks.expect(len(ports) == 1 and ports[0]["name"] == "h2c",
                  f"one container port (Knative admits one), named h2c: {ports}")
    port = ports[0]["containerPort"] if ports else None
    listen = " ".join(container.get("args", []))
    checks.expect(f"--listen 0.0.0.0:{port}" in listen,
                  f"the edge listens on the h2c port: args {container.get('args')}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        checks.expect(container.get(probe, {}).get("grpc", {}).get("port") == port,
                      f"{probe} asks grpc.health.v1 on the h2c port")
    annotations = spec.get("annotations", {})
    checks.expect(annotations.get("prometheus.kserve.io/port") == "9464"
                  and annotations.get("prometheus.kserve.io/path") == "/metrics",
                  "Prometheus annotations name the metrics endpoint, 9464 /metrics")
    checks.expect(env_of(container).get("ATTENTION_METRICS_ADDRESS", "").endswith(":9464"),
                  "the server's metrics listen where the annotations say")
    by_runtime = [s for s in services if s["spec"]["predictor"]["model"].get("runtime")]
    by_storage = [s for s in services if s["spec"]["predictor"]["model"].get("storageUri")]
    checks.expect(bool(by_runtime) and bool(by_storage),
                  "examples: one names the runtime, one has a storageUri")
    for service in services:
        model = service["spec"]["predictor"]["model"]
        checks.expect(model["modelFormat"]["name"] == FORMAT,
                      f"{service['metadata']['name']} asks for the runtime's format")
        checks.expect(model.get("runtime") in (None, runtime["metadata"]["name"]),
                      f"{service['metadata']['name']} names no other runtime")


def main():
    checks = Checks()
    validators = load_crds(checks)
    manifests = load_manifests()
    check_schemas(checks, validators, manifests)
    runtime = single(manifests, "ServingRuntime")[0]
    services = single(manifests, "InferenceService")
    check_broken_copies_fail(checks, validators, runtime, services[0])
    check_runtime_promises(checks, runtime, services)
    print(f"{checks.passed} passed, {checks.failed} failed")
    return 1 if checks.failed or not checks.passed else 0


if __name__ == "__main__":
    sys.exit(main())
