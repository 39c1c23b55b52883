"""server_kv_dtype_python_test: sessions holding keys and values in 16 bits
(--kv-cache-dtype, docs/api.md section 11.7) against PyTorch's own error.

For bfloat16 and float16, a real attention-server runs the conformance cases
(tests/conformance) as sessions over AttendSession: every case a cross
session can hold (no causal mask, valid lengths per example or none) as one
with the case's keys, values and valid lengths, its queries sent as a first
step of several rows and then one row per step; and every fp32 model that
has self memory (dot_product, multi_head with d_q = d_k = d_v) as a self
session over the case's queries as tokens, a prompt and then one token per
step. Each answer's largest error against a float64 reference (the rule of
docs/api.md over the keys and values as sent) must be within twice the
error PyTorch 1.13 makes when it casts the keys and values the session
holds (the projected ones for multi_head, W_k k for additive) to the same
dtype and back and computes in float32. The Hugging Face layer cases
(tests/conformance/layers) with a causal mask, as self sessions, stay within
8 units of the dtype's rounding of their answers' largest magnitude. Also:
ListModels, the Open Inference Protocol's metadata and config and the
metrics say the dtype.

    ATTENTION_SERVER_BIN=build/server/attention-server /usr/bin/python3 tests/server/kv_dtype_python_test.py
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import unittest
import urllib.request

import numpy as np
import torch

SOURCE_DIR = pathlib.Path(__file__).resolve().parent.parent.parent
CONFORMANCE = SOURCE_DIR / "tests" / "conformance"
PACKAGE = tempfile.TemporaryDirectory()


def build_client():
    """The Python client from client/python/src with its stubs generated from
    the repository's proto by Debian's protoc, as its setup.py does."""
    package = os.path.join(PACKAGE.name, "attention_client")
    shutil.copytree(SOURCE_DIR / "client" / "python" / "src" / "attention_client", package)
    subprocess.run(["protoc", f"-I{SOURCE_DIR / 'proto'}", f"--python_out={PACKAGE.name}",
                    f"--grpc_out={PACKAGE.name}",
                    "--plugin=protoc-gen-grpc=" + shutil.which("grpc_python_plugin"),
                    os.path.join("attention", "v1", "attention.proto")], check=True)
    generated = os.path.join(PACKAGE.name, "attention", "v1")
    shutil.copy(os.path.join(generated, "attention_pb2.py"), package)
    with open(os.path.join(generated, "attention_pb2_grpc.py")) as f:
        stubs = f.read().replace("from attention.v1 import attention_pb2",
                                 "from . import attention_pb2")
    with open(os.path.join(package, "attention_pb2_grpc.py"), "w") as f:
        f.write(stubs)
    # The package asks its installed metadata for its version.
    info = os.path.join(PACKAGE.name, "attention_client-0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: attention-client\nVersion: 0\n")
    sys.path.insert(0, PACKAGE.name)


build_client()
import attention_client  # noqa: E402

# The model files' reader and multi_head's projections of either layout.
sys.path.insert(0, str(SOURCE_DIR / "tools"))
import make_bf16_cases  # noqa: E402

# The client tests' server on 127.0.0.1 (ports picked by the system).
sys.path.insert(0, str(SOURCE_DIR / "tests" / "client"))
from python_test import Server  # noqa: E402

MASKED = -1e6
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def read_model(name):
    """The tensors (float64) and metadata of a conformance model file."""
    metadata, tensors = make_bf16_cases.read_safetensors(CONFORMANCE / "models" /
                                                         f"{name}.safetensors")
    return tensors, metadata


def allowed_mask(batch, n_q, n_k, valid_lens, causal):
    allowed = np.ones((batch, n_q, n_k), dtype=bool)
    if len(valid_lens) == batch:
        allowed &= np.arange(n_k)[None, None, :] < np.array(valid_lens)[:, None, None]
    if causal:
        allowed &= np.arange(n_k)[None, None, :] <= np.arange(n_q)[None, :, None]
    return torch.tensor(allowed)


def attend(kind, model, queries, keys, values, allowed, scale, dtype, held=None):
    """The answer of docs/api.md's rule in `dtype` (masked scores replaced by
    -1e6). `held`: the torch dtype the keys and values a session holds are
    cast to and back (None: as computed)."""
    def t(x):
        return torch.tensor(np.asarray(x), dtype=dtype)

    def hold(x):
        return x if held is None else x.to(held).to(dtype)

    q, k, v = t(queries), t(keys), t(values)
    if kind == "multi_head":
        w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o = (t(x) for x in model["weights"])
        heads = model["heads"]
        q = q @ w_q.T + b_q
        k, v = hold(k @ w_k.T + b_k), hold(v @ w_v.T + b_v)
        batch, n_q, e = q.shape
        n_k, size = k.shape[1], e // heads

        def split(x, n):
            return x.reshape(batch, n, heads, size).transpose(1, 2)

        s = scale if scale is not None else 1.0 / np.sqrt(size)
        scores = split(q, n_q) @ split(k, n_k).transpose(2, 3) * s
        scores = torch.where(allowed[:, None], scores, torch.tensor(MASKED, dtype=dtype))
        out = torch.softmax(scores, dim=-1) @ split(v, n_k)
        return (out.transpose(1, 2).reshape(batch, n_q, e) @ w_o.T + b_o).numpy()
    if kind == "additive":
        w_q, w_k, w_v = (t(model["tensors"][f"{p}.weight"]) for p in ("W_q", "W_k", "w_v"))
        features = hold(k @ w_k.T)
        scores = torch.tanh((q @ w_q.T)[:, :, None, :] + features[:, None, :, :]) @ w_v[0]
    elif kind == "bilinear":
        k, v = hold(k), hold(v)
        s = scale if scale is not None else 1.0 / np.sqrt(q.shape[-1])
        scores = (q @ t(model["tensors"]["W_k.weight"])) @ k.transpose(1, 2) * s
    elif kind == "distance":
        k, v = hold(k), hold(v)
        s = scale if scale is not None else 1.0
        scores = -s * ((q[:, :, None, :] - k[:, None, :, :]) ** 2).sum(-1) / 2
    else:
        k, v = hold(k), hold(v)
        s = scale if scale is not None else 1.0 / np.sqrt(q.shape[-1])
        scores = q @ k.transpose(1, 2) * s
    if kind == "additive":
        v = hold(v)
    scores = torch.where(allowed, scores, torch.tensor(MASKED, dtype=dtype))
    return (torch.softmax(scores, dim=-1) @ v).numpy()


def tensor(message, key):
    return np.array(message[key]["data"], dtype=np.float32).reshape(message[key]["shape"])


def repository(path):
    """Flags serving every model of `path`, refusing to start on a bad one."""
    return ("--model-repository", str(path), "--strict")


def steps_of(n):
    """A first step of several rows (the prompt), then one row a step."""
    first = max(1, n - 3)
    return [(0, first)] + [(i, i + 1) for i in range(first, n)]


class KvDtypeAccuracy(unittest.TestCase):
    def setUp(self):
        self.models = {}
        self.cases = [json.loads(p.read_text())
                      for p in sorted((CONFORMANCE / "cases").glob("*.json"))]

    def model(self, name):
        """(kind, model dict, its fp32-ness) of a case's model."""
        if name in ("dot_product", "distance"):
            return name, {}, True
        if name not in self.models:
            tensors, metadata = read_model(name)
            model = {"tensors": tensors}
            if metadata["kind"] == "multi_head":
                model["weights"] = make_bf16_cases.projections(tensors)
                model["heads"] = int(metadata["num_heads"])
            self.models[name] = (metadata["kind"], model, metadata.get("precision") != "bf16")
        return self.models[name]

    def compare(self, what, client, model, opening, problem, held):
        """A session opened with `opening`, its queries (problem[2]) sent as
        steps_of them, against the float64 reference: its largest error,
        which must be within twice PyTorch's with the keys and values
        `held`."""
        reference = attend(*problem, torch.float64)
        torch_error = float(np.abs(attend(*problem, torch.float32, held) - reference).max())
        queries = problem[2]
        with client.session(model, **opening) as session:
            got = np.concatenate([session.step(queries[:, a:b]).output
                                  for a, b in steps_of(queries.shape[1])], axis=1)
        error = float(np.abs(got.astype(np.float64) - reference).max())
        self.assertLessEqual(error, 2 * torch_error + 1e-6,
                             f"{what}: error {error:.3g}, PyTorch's {torch_error:.3g}")
        return error

    def run_dtype(self, dtype):
        server = Server("--kv-cache-dtype", dtype, *repository(CONFORMANCE / "models"))
        held = TORCH_DTYPES[dtype]
        ran = {"cross": 0, "self": 0}
        worst = 0.0
        try:
            client = attention_client.AttentionClient(server.address)
            for case in self.cases:
                request = case["request"]
                kind, model, fp32 = self.model(request["model"])
                queries = tensor(request, "queries")
                keys = tensor(request, "keys") if "keys" in request else queries
                values = tensor(request, "values") if "values" in request else keys
                valid_lens = request.get("valid_lens", [])
                scale = request.get("scale")
                batch, n_q = queries.shape[:2]
                if fp32 and not request.get("causal") and len(valid_lens) in (0, batch):
                    allowed = allowed_mask(batch, n_q, keys.shape[1], valid_lens, False)
                    opening = dict(memory="cross", keys=keys, values=values,
                                   valid_lens=valid_lens or None, scale=scale)
                    worst = max(worst, self.compare(
                        f"{dtype} cross {case['name']}", client, request["model"], opening,
                        (kind, model, queries, keys, values, allowed, scale), held))
                    ran["cross"] += 1
                sizes = {queries.shape[2]} if kind == "dot_product" else set()
                if kind == "multi_head":
                    w_q, w_k, w_v = model["weights"][:3]
                    sizes = {w_q.shape[1], w_k.shape[1], w_v.shape[1]}
                if fp32 and kind in ("dot_product", "multi_head") and len(sizes) == 1 \
                        and queries.shape[2] in sizes and scale is None:
                    allowed = allowed_mask(batch, n_q, n_q, [], True)
                    worst = max(worst, self.compare(
                        f"{dtype} self {case['name']}", client, request["model"],
                        dict(memory="self", batch=batch),
                        (kind, model, queries, queries, queries, allowed, None), held))
                    ran["self"] += 1
            self.assertGreaterEqual(ran["cross"], 15)
            self.assertGreaterEqual(ran["self"], 5)
            print(f"{dtype}: {ran} sessions, largest error {worst:.3g}", file=sys.stderr)
            self.check_reported(server, client, dtype)
        finally:
            server.stop()

    def check_reported(self, server, client, dtype):
        """ListModels, the metrics and the Open Inference Protocol's REST
        metadata say the server's dtype, and the model file's overrides it
        where it has one (none of the conformance models has)."""
        names = {m.name: m.kv_cache_dtype for m in client.list_models()}
        self.assertEqual(names["dot_product"], dtype)
        self.assertEqual(names["mh_torch_small"], dtype)
        with urllib.request.urlopen(f"http://{server.metrics_address}/metrics") as answer:
            metrics = answer.read().decode()
        self.assertIn(f'attention_model_kv_cache_dtype_info{{kv_cache_dtype="{dtype}",'
                      f'model="mh_torch_small",version="1"}} 1', metrics)
        with urllib.request.urlopen(
                f"http://{server.http_address}/v2/models/mh_torch_small") as answer:
            metadata = json.loads(answer.read())
        self.assertEqual(metadata["properties"]["kv_cache_dtype"], dtype)

    def test_layer_cases_as_sessions(self):
        """The Hugging Face layer cases (tests/conformance/layers) with a
        causal mask as self sessions, a prompt and then one token a step:
        their largest error against the case's answer (PyTorch's float32
        layer) stays within 8 units of the dtype's rounding (2^-8 for
        bfloat16, 2^-11 for float16) of the answer's largest magnitude."""
        for dtype, unit in (("bfloat16", 2.0 ** -8), ("float16", 2.0 ** -11)):
            server = Server("--kv-cache-dtype", dtype, *repository(CONFORMANCE / "layers" / "models"))
            try:
                client = attention_client.AttentionClient(server.address)
                ran = 0
                for path in sorted((CONFORMANCE / "layers" / "cases").glob("*_causal.json")):
                    case = json.loads(path.read_text())
                    queries = tensor(case["request"], "queries")
                    expected = tensor(case["expected"], "output").astype(np.float64)
                    with client.session(case["request"]["model"], memory="self",
                                        batch=queries.shape[0]) as session:
                        got = np.concatenate([session.step(queries[:, a:b]).output
                                              for a, b in steps_of(queries.shape[1])], axis=1)
                    error = float(np.abs(got - expected).max())
                    bound = 8 * unit * float(np.abs(expected).max())
                    self.assertLessEqual(error, bound, f"{dtype} {case['name']}")
                    ran += 1
                self.assertGreaterEqual(ran, 10)
            finally:
                server.stop()

    def test_bfloat16(self):
        self.run_dtype("bfloat16")

    def test_float16(self):
        self.run_dtype("float16")


if __name__ == "__main__":
    unittest.main()
