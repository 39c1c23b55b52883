#!/usr/bin/python3
"""make_hostile_inputs.py: writes the hand-made hostile inputs of
tests/fuzz/regressions/ (hostile-*), each aimed at one check of the loader or
of request validation. fuzz_regression_test replays them with the inputs that
once crashed a target (crash-*); re-run this after changing the list:

    tests/fuzz/make_hostile_inputs.py     (from anywhere; needs protoc)
"""
import json
import pathlib
import struct
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUT = HERE / "regressions"


def safetensors(header, data=b"", raw_header=None):
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def f32(*values):
    return struct.pack(f"<{len(values)}f", *values)


def tensor(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def deep(depth):
    return b'{"__metadata__": {"kind": ' + b"[" * depth + b"]" * depth + b"}}"


MODEL_FILES = {
    "header-length-max": b"\xff" * 8,
    "header-length-zero": struct.pack("<Q", 0),
    "header-not-an-object": safetensors(None, raw_header=b"[1, 2, 3]"),
    "header-deeply-nested": safetensors(None, raw_header=deep(100000)),
    "header-invalid-utf8": safetensors(None, raw_header=b'{"\xff\xfe": 1}'),
    "shape-product-overflows": safetensors({
        "__metadata__": {"kind": "bilinear"},
        "W_k.weight": tensor("F32", [2**32, 2**32, 2**32], 0, 0)}),
    "shape-wraps-to-small": safetensors({
        "__metadata__": {"kind": "bilinear"},
        "W_k.weight": tensor("F32", [2**62, 4], 0, 0)}),
    "offsets-overlap": safetensors({
        "__metadata__": {"kind": "additive"},
        "W_q.weight": tensor("F32", [1, 2], 0, 8),
        "W_k.weight": tensor("F32", [1, 2], 4, 12),
        "w_v.weight": tensor("F32", [1, 1], 12, 16)}, f32(1, 2, 3, 4)),
    "offsets-past-end": safetensors({
        "__metadata__": {"kind": "bilinear"},
        "W_k.weight": tensor("F32", [2, 2], 0, 1 << 40)}, f32(1, 2, 3, 4)),
    "num-heads-beyond-int64": safetensors({
        "__metadata__": {"kind": "multi_head", "num_heads": "18446744073709551616"},
        "W_q.weight": tensor("F32", [1, 1], 0, 4), "W_k.weight": tensor("F32", [1, 1], 4, 8),
        "W_v.weight": tensor("F32", [1, 1], 8, 12), "W_o.weight": tensor("F32", [1, 1], 12, 16)},
        f32(1, 1, 1, 1)),
    "num-heads-above-width": safetensors({
        "__metadata__": {"kind": "multi_head", "num_heads": "4"},
        "W_q.weight": tensor("F32", [2, 1], 0, 8), "W_k.weight": tensor("F32", [2, 1], 8, 16),
        "W_v.weight": tensor("F32", [2, 1], 16, 24), "W_o.weight": tensor("F32", [2, 2], 24, 40)},
        f32(*range(10))),
    "one-head-per-feature": safetensors({
        "__metadata__": {"kind": "multi_head", "num_heads": "2"},
        "W_q.weight": tensor("F32", [2, 1], 0, 8), "W_k.weight": tensor("F32", [2, 1], 8, 16),
        "W_v.weight": tensor("F32", [2, 1], 16, 24), "W_o.weight": tensor("F32", [2, 2], 24, 40)},
        f32(*range(10))),
    "f16-infinity-weight": safetensors({
        "__metadata__": {"kind": "bilinear"},
        "W_k.weight": tensor("F16", [1, 2], 0, 4)}, struct.pack("<2H", 0x3C00, 0x7C00)),
    "bf16-denormal-weights": safetensors({
        "__metadata__": {"kind": "bilinear"},
        "W_k.weight": tensor("BF16", [1, 2], 0, 4)}, struct.pack("<2H", 0x0001, 0x8001)),
    "duplicate-tensor-name": safetensors(None, raw_header=(
        b'{"__metadata__": {"kind": "bilinear"}, '
        b'"W_k.weight": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}, '
        b'"W_k.weight": {"dtype": "F32", "shape": [1, 1], "data_offsets": [4, 8]}}'), data=f32(1, 2)),
    "weightless-kind-with-weights": safetensors({
        "__metadata__": {"kind": "dot_product"},
        "W_k.weight": tensor("F32", [1, 1], 0, 4)}, f32(1)),
}


def request(queries, **fields):
    return {"model": fields.pop("model", "dot_product"), "queries": queries, **fields}


def t(shape, data):
    return {"shape": [str(s) if s >= 2**31 else s for s in shape], "data": data}


REQUESTS = {
    "no-queries": {"model": "dot_product"},
    "shape-product-overflows": request(t([2**62, 4, 4], [1.0])),
    "shape-product-wraps-to-zero": request(t([2**32, 2**32, 1], [])),
    "negative-dims-multiply-to-one": request(t([-1, -1, 1], [1.0])),
    "rank-zero-keys": request(t([1, 1, 2], [1.0, 2.0]), keys={}),
    "values-without-keys-other-n_k": request(t([1, 2, 2], [1.0] * 4), values=t([1, 3, 1], [1.0] * 3)),
    "valid-len-int32-min": request(t([1, 2, 2], [1.0] * 4), valid_lens=[-2147483648]),
    "valid-len-int32-max": request(t([1, 2, 2], [1.0] * 4), valid_lens=[2147483647]),
    "valid-lens-wrong-count": request(t([2, 2, 2], [1.0] * 8), valid_lens=[1, 1, 1]),
    "scale-nan": request(t([1, 2, 2], [1.0] * 4), scale="NaN"),
    "scale-float-max": request(t([1, 2, 2], [1.0] * 4), scale=3.4028234663852886e38,
                               return_attention_weights=True),
    "infinity-in-values": request(t([1, 2, 2], [1.0] * 4), keys=t([1, 2, 2], [1.0] * 4),
                                  values=t([1, 2, 1], [1.0, "-Infinity"])),
    "causal-more-queries-than-keys": request(t([1, 5, 2], [0.5] * 10), keys=t([1, 2, 2], [1.0] * 4),
                                             causal=True, return_attention_weights=True),
    "everything-masked": request(t([2, 3, 2], [0.25] * 12), valid_lens=[0] * 6, causal=True,
                                 return_attention_weights=True),
    "wrong-size-for-model": request(t([1, 1, 3], [1.0] * 3), model="bilinear_small"),
    "multi-head-values-wrong-size": request(t([1, 1, 8], [1.0] * 8), model="mh_torch_kvdim",
                                            values=t([1, 1, 1], [1.0])),
    "positions-for-a-model-without-them": request(t([1, 2, 2], [1.0] * 4), position_ids=[0, 1]),
    "window-negative": request(t([1, 2, 2], [1.0] * 4), sliding_window=-1),
    "softcap-infinite": request(t([1, 2, 2], [1.0] * 4), softcap="Infinity"),
    "softcap-for-a-layer": request(t([1, 1, 8], [1.0] * 8), model="mh_torch_kvdim", softcap=30.0),
}


def encode_binary(requests):
    """JSON -> binary AttendRequest, with the proto compiled on the fly."""
    with tempfile.TemporaryDirectory() as out:
        proto_dir = ROOT / "proto"
        subprocess.run(["protoc", f"-I{proto_dir}", f"--python_out={out}",
                        str(proto_dir / "attention/v1/attention.proto")], check=True)
        sys.path.insert(0, out)
        from attention.v1 import attention_pb2
        from google.protobuf import json_format
        encoded = {}
        for name, body in requests.items():
            try:
                message = json_format.Parse(json.dumps(body), attention_pb2.AttendRequest())
            except json_format.ParseError:
                continue  # no binary form (a shape beyond int64)
            encoded[name] = message.SerializeToString()
        return encoded


def write(target, name, data):
    (OUT / target).mkdir(parents=True, exist_ok=True)
    (OUT / target / f"hostile-{name}").write_bytes(data)


def main():
    for name, data in MODEL_FILES.items():
        write("model_file", f"{name}.safetensors", data)
    for name, body in REQUESTS.items():
        write("request_json", f"{name}.json", json.dumps(body).encode())
    for name, data in encode_binary(REQUESTS).items():
        write("request_proto", f"{name}.pb", data)


if __name__ == "__main__":
    main()
