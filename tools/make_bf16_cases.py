#!/usr/bin/env python3
"""make_bf16_cases.py: the accuracy cases of bf16 models (docs/api.md 5.5).

Writes tests/bf16/cases/<name>.safetensors, one per case: a multi_head model,
a request, the float64 answer, and the error PyTorch 1.13 makes when it runs
the same model in torch.bfloat16 on CPU. tests/core/bf16_accuracy_test.cc holds
the engine's bf16 answers to twice that error and to PyTorch's own BF16
tolerance (atol = rtol = 5e-2); it needs no PyTorch.

Cases: every multi_head conformance case (tests/conformance), and random
draws at the kernels' edges (64-row query and key tiles, 32-column weight
panels, odd input widths that leave half a BF16 pair), with and without valid
lengths (per example and per query) and causal masks.

The reference is the rule of docs/api.md in float64: projections, per head
scaled scores, disallowed scores replaced by -1e6, softmax, weights . values,
output projection. PyTorch's BF16 run is the same computation the way
nn.MultiheadAttention runs it on CPU (F.linear, baddbmm, softmax, bmm; here
with the -1e6 rule as an additive mask), with the module and inputs in
torch.bfloat16; the d2l layout (d_q != E) has no nn.MultiheadAttention, so
the functional form serves both.

Each file holds F32 tensors w_q, w_k, w_v, w_o [E, d_*], b_q, b_k, b_v, b_o [E]
(the model as its file gives it), queries, keys, values [B, n, d_*] (keys
and values absent for self-attention, which the request then asks for) and
expected [B, n_q, E]; __metadata__: num_heads, causal ("0"/"1"), valid_lens
(comma-separated, empty for none), scale (empty for the default) and
torch_bf16_error (max |torch bf16 - float64| over the output, as repr).

Run with /usr/bin/python3 (torch 1.13): /usr/bin/python3 tools/make_bf16_cases.py
"""
import json
import pathlib
import struct

import numpy as np
import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFORMANCE = ROOT / "tests" / "conformance"
OUT = ROOT / "tests" / "bf16" / "cases"
MASKED = -1e6


def read_safetensors(path):
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        chunk = data[begin:end]
        if entry["dtype"] == "F32":
            values = np.frombuffer(chunk, dtype="<f4").astype(np.float64)
        elif entry["dtype"] == "F16":
            values = np.frombuffer(chunk, dtype="<f2").astype(np.float64)
        elif entry["dtype"] == "BF16":
            wide = np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16
            values = wide.view(np.float32).astype(np.float64)
        else:
            raise ValueError(f"{path}: dtype {entry['dtype']}")
        tensors[name] = values.reshape(entry["shape"])
    return header.get("__metadata__", {}), tensors


def write_safetensors(path, tensors, metadata):
    header = {"__metadata__": metadata}
    blobs, offset = [], 0
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def projections(tensors):
    """w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o of either layout."""
    if "W_q.weight" in tensors:
        w = [tensors[f"W_{p}.weight"] for p in "qkvo"]
        e = w[0].shape[0]
        b = [tensors.get(f"W_{p}.bias", np.zeros(e)) for p in "qkvo"]
        return w + b
    w_o = tensors["out_proj.weight"]
    e = w_o.shape[0]
    if "in_proj_weight" in tensors:
        w_q, w_k, w_v = np.split(tensors["in_proj_weight"], 3)
    else:
        w_q, w_k, w_v = (tensors[f"{p}_proj_weight"] for p in "qkv")
    b_q, b_k, b_v = np.split(tensors.get("in_proj_bias", np.zeros(3 * e)), 3)
    return [w_q, w_k, w_v, w_o, b_q, b_k, b_v, tensors.get("out_proj.bias", np.zeros(e))]


def allowed_mask(batch, n_q, n_k, valid_lens, causal):
    """[B, n_q, n_k] booleans: True where the rule allows the score."""
    allowed = np.ones((batch, n_q, n_k), dtype=bool)
    if len(valid_lens) == batch:
        limits = np.repeat(np.array(valid_lens).reshape(batch, 1), n_q, axis=1)
    elif len(valid_lens) == batch * n_q:
        limits = np.array(valid_lens).reshape(batch, n_q)
    else:
        limits = np.full((batch, n_q), n_k)
    allowed &= np.arange(n_k)[None, None, :] < limits[:, :, None]
    if causal:
        allowed &= np.arange(n_k)[None, None, :] <= np.arange(n_q)[None, :, None]
    return allowed


def attend(weights, queries, keys, values, heads, allowed, scale, dtype, replace):
    """The multi_head answer in `dtype`; `replace`: the -1e6 rule exactly (the
    float64 reference), else as an additive mask (how PyTorch masks)."""
    w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o = (torch.tensor(x, dtype=dtype) for x in weights)
    q = F.linear(torch.tensor(queries, dtype=dtype), w_q, b_q)
    k = F.linear(torch.tensor(keys, dtype=dtype), w_k, b_k)
    v = F.linear(torch.tensor(values, dtype=dtype), w_v, b_v)
    batch, n_q, e = q.shape
    n_k = k.shape[1]
    size = e // heads
    def split(x, n):
        return x.reshape(batch, n, heads, size).transpose(1, 2).reshape(batch * heads, n, size)

    q, k, v = split(q, n_q), split(k, n_k), split(v, n_k)
    s = scale if scale is not None else 1.0 / np.sqrt(size)
    mask = torch.tensor(np.repeat(allowed, heads, axis=0))
    if replace:
        scores = torch.bmm(q, k.transpose(1, 2)) * s
        scores = torch.where(mask, scores, torch.tensor(MASKED, dtype=dtype))
    else:
        zero, masked = torch.tensor(0.0, dtype=dtype), torch.tensor(MASKED, dtype=dtype)
        additive = torch.where(mask, zero, masked)
        scores = torch.baddbmm(additive, q * s, k.transpose(1, 2))
    attention = torch.bmm(torch.softmax(scores, dim=-1), v)
    concat = attention.reshape(batch, heads, n_q, size).transpose(1, 2).reshape(batch, n_q, e)
    return F.linear(concat, w_o, b_o)


def make_case(name, weights, heads, queries, keys, values, valid_lens, causal, scale):
    batch, n_q, n_k = queries.shape[0], queries.shape[1], keys.shape[1]
    allowed = allowed_mask(batch, n_q, n_k, valid_lens, causal)
    args = (weights, queries, keys, values, heads, allowed, scale)
    expected = attend(*args, torch.float64, True).numpy()
    with torch.no_grad():
        bf16 = attend(*args, torch.bfloat16, False).to(torch.float64).numpy()
    error = float(np.max(np.abs(bf16 - expected)))
    tensors = dict(zip(["w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"], weights))
    tensors["queries"] = queries
    if keys is not queries or values is not queries:  # else self-attention: keys omitted
        tensors.update(keys=keys, values=values)
    tensors["expected"] = expected
    metadata = {"num_heads": str(heads), "causal": "1" if causal else "0",
                "valid_lens": ",".join(str(int(x)) for x in valid_lens),
                "scale": "" if scale is None else repr(float(scale)),
                "torch_bf16_error": repr(error)}
    write_safetensors(OUT / f"{name}.safetensors", tensors, metadata)
    print(f"{name}: B={batch} n_q={n_q} n_k={n_k} E={weights[0].shape[0]} heads={heads} "
          f"torch bf16 error {error:.3g}")


def conformance_cases():
    for path in sorted((CONFORMANCE / "cases").glob("multi_head*.json")):
        case = json.loads(path.read_text())
        request = case["request"]
        model_file = CONFORMANCE / "models" / f"{request['model']}.safetensors"
        metadata, tensors = read_safetensors(model_file)
        tensor = lambda t: np.array(t["data"], dtype=np.float64).reshape(t["shape"])
        queries = tensor(request["queries"])
        keys = tensor(request["keys"]) if "keys" in request else queries
        values = tensor(request["values"]) if "values" in request else keys
        make_case(f"conformance_{case['name']}", projections(tensors), int(metadata["num_heads"]),
                  queries, keys, values, request.get("valid_lens", []),
                  request.get("causal", False), request.get("scale"))


def random_cases():
    rng = np.random.default_rng(26)
    # (name, B, n_q, n_k, d_q, d_k, d_v, E, heads, masks)
    shapes = [
        ("tile_edges_self", 2, 65, 65, 48, 48, 48, 48, 3),
        ("tile_edges_cross", 1, 63, 129, 33, 17, 31, 64, 4),
        ("odd_widths", 3, 7, 9, 13, 11, 5, 30, 5),
        ("wide", 1, 72, 72, 128, 128, 128, 128, 4),
        ("one_query", 2, 1, 130, 64, 64, 64, 64, 8),
    ]
    for name, batch, n_q, n_k, d_q, d_k, d_v, e, heads in shapes:
        bound = 1.0 / np.sqrt(max(d_q, d_k, d_v, e))
        weights = [rng.uniform(-bound, bound, (e, d)) for d in (d_q, d_k, d_v, e)]
        weights += [rng.uniform(-bound, bound, e) for _ in range(4)]
        self_attention = n_q == n_k and d_q == d_k == d_v
        queries = rng.standard_normal((batch, n_q, d_q))
        keys = queries if self_attention else rng.standard_normal((batch, n_k, d_k))
        values = queries if self_attention else rng.standard_normal((batch, n_k, d_v))
        per_example = [int(x) for x in rng.integers(0, n_k + 1, batch)]
        per_query = [int(x) for x in rng.integers(0, n_k + 1, batch * n_q)]
        masks = [("unmasked", [], False), ("valid_lens", per_example, False),
                 ("query_lens", per_query, False), ("causal", [], True)]
        for mask, valid_lens, causal in masks:
            if causal and n_q != n_k:
                continue
            make_case(f"random_{name}_{mask}", weights, heads, queries, keys, values, valid_lens,
                      causal, None)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.safetensors"):
        old.unlink()
    conformance_cases()
    random_cases()


if __name__ == "__main__":
    main()
