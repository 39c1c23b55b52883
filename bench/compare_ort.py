#!/usr/bin/python3
"""compare_ort.py: ONNX Runtime (onnxruntime-node) on the shapes of attention-bench.

The same problems as `multi_head/...` in attention-bench and bench/compare_torch.py:
self-attention, width E, H heads, random weights and biases; masked:1 gives
each example a valid length (SplitMix64 from seed 42, uniform in [n/4, n])
and masks the keys beyond it. Each shape is exported twice:

  onnx_export  nn.MultiheadAttention(E, H, batch_first=True) through
               torch.onnx.export (opset 17), key_padding_mask as an input;
  fused        one com.microsoft.Attention node (ORT's fused CPU kernel: the
               packed QKV projection, the heads, a 1-D mask_index of valid
               lengths) then MatMul + Add for the output projection,
               written with onnx.helper.

Both are run by bench/ort_bench.js on onnxruntime-node (ORT's CPU execution
provider, the library its npm package ships) with 2 intra-op threads, 1
inter-op thread and every graph optimisation (ORT_ENABLE_ALL); each graph's
first answer is checked against PyTorch's (max abs difference printed; a
difference over 1e-3 fails the run). Printed lines:

  ort_<graph>/multi_head/B:b/n:n/E:e/H:h/masked:m  ms  GFLOPS  GFLOPS_per_core

GFLOPS uses attention-bench's formula (sum_b n * L_b * 4E + 8 B n E^2) over
wall-clock time, GFLOPS_per_core over the CPU time of the Node process.

onnxruntime-node is a benchmark dependency only, installed by hand:

  npm install --prefix /tmp/ort --ignore-scripts onnxruntime-node@1.30.0
  /usr/bin/python3 bench/compare_ort.py --ort /tmp/ort/node_modules [--min-time 0.5]

(--ignore-scripts: the package's install script only fetches GPU builds; the
CPU library ships in the package.) Needs Debian's python3-torch and
python3-onnx for the export, and node.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_torch  # noqa: E402  (sets the OpenMP wait policy before torch)

torch = compare_torch.torch
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(REPO, "bench", "ort_bench.js")
TOLERANCE = 1e-3


def write(directory, name, array):
    path = os.path.join(directory, name)
    np.ascontiguousarray(array).tofile(path)
    return path


def export_fused(mha, heads, path):
    """com.microsoft.Attention (QKV projection and the heads in one node), then
    the output projection, with the module's weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    width = mha.embed_dim
    w_qkv = mha.in_proj_weight.detach().numpy().T.copy()  # (E, 3E): input @ weights
    b_qkv = mha.in_proj_bias.detach().numpy()
    w_out = mha.out_proj.weight.detach().numpy().T.copy()
    b_out = mha.out_proj.bias.detach().numpy()
    nodes = [
        helper.make_node("Attention", ["x", "w_qkv", "b_qkv", "valid_lens"], ["heads"],
                         domain="com.microsoft", num_heads=heads),
        helper.make_node("MatMul", ["heads", "w_out"], ["projected"]),
        helper.make_node("Add", ["projected", "b_out"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "multi_head_fused",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "n", width]),
         helper.make_tensor_value_info("valid_lens", TensorProto.INT32, ["B"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "n", width])],
        [numpy_helper.from_array(w_qkv, "w_qkv"), numpy_helper.from_array(b_qkv, "b_qkv"),
         numpy_helper.from_array(w_out, "w_out"), numpy_helper.from_array(b_out, "b_out")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    onnx.checker.check_model(model)
    onnx.save(model, path)


def export_torch(mha, x, mask, path):
    """nn.MultiheadAttention as torch.onnx exports it."""
    class Layer(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, key_padding_mask=None):
            return self.inner(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)[0]

    layer = Layer(mha).eval()
    args = (x,) if mask is None else (x, mask)
    names = ["x"] if mask is None else ["x", "key_padding_mask"]
    # With autograd on, the module takes its composite path (linear layers,
    # bmm, softmax), which torch.onnx can export; its inference fast path
    # (_native_multi_head_attention) has no ONNX form.
    with torch.enable_grad():
        torch.onnx.export(layer, args, path, input_names=names, output_names=["y"],
                          opset_version=17, do_constant_folding=True)


def prepare(directory):
    """Exports every shape's two graphs and their inputs; returns the manifest
    bench/ort_bench.js reads."""
    torch.manual_seed(compare_torch.SEED)
    cases = []
    for batch, length, width, heads in compare_torch.SHAPES:
        mha = torch.nn.MultiheadAttention(width, heads, bias=True, batch_first=True).eval()
        x = torch.rand(batch, length, width) * 2 - 1
        for masked in (0, 1):
            lens = compare_torch.valid_lengths(batch, length) if masked else [length] * batch
            mask = None
            if masked:
                mask = torch.arange(length)[None, :] >= torch.tensor(lens)[:, None]
            with torch.inference_mode():
                expected = mha(x, x, x, key_padding_mask=mask, need_weights=False)[0].numpy()
            flops = sum(length * l * 4 * width for l in lens) + 8 * batch * length * width**2
            shape = f"multi_head/B:{batch}/n:{length}/E:{width}/H:{heads}/masked:{masked}"
            stem = shape.replace("/", "_").replace(":", "")
            x_file = write(directory, stem + "_x.bin", x.numpy())
            expected_file = write(directory, stem + "_y.bin", expected)
            dims = [batch, length, width]
            exported = os.path.join(directory, stem + "_export.onnx")
            export_torch(mha, x, mask, exported)
            inputs = {"x": {"file": x_file, "type": "float32", "dims": dims}}
            if masked:
                inputs["key_padding_mask"] = {
                    "file": write(directory, stem + "_mask.bin", mask.numpy().astype(np.uint8)),
                    "type": "bool", "dims": [batch, length]}
            cases.append({"name": f"ort_onnx_export/{shape}", "model": exported, "inputs": inputs,
                          "expected": expected_file, "flops": flops})
            fused = os.path.join(directory, stem + "_fused.onnx")
            export_fused(mha, heads, fused)
            cases.append({"name": f"ort_fused/{shape}", "model": fused, "flops": flops,
                          "expected": expected_file,
                          "inputs": {"x": {"file": x_file, "type": "float32", "dims": dims},
                                     "valid_lens": {
                                         "file": write(directory, stem + "_lens.bin",
                                                       np.array(lens, dtype=np.int32)),
                                         "type": "int32", "dims": [batch]}}})
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ort", required=True,
                        help="node_modules folder holding onnxruntime-node")
    parser.add_argument("--min-time", type=float, default=1.0, help="seconds per benchmark")
    parser.add_argument("--repetitions", type=int, default=5,
                        help="runs per benchmark; the best is kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", help="folder for the exported graphs (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.models or scratch
        os.makedirs(directory, exist_ok=True)
        manifest = {"cases": prepare(directory), "min_time": args.min_time,
                    "repetitions": args.repetitions, "threads": args.threads,
                    "tolerance": TOLERANCE}
        path = os.path.join(directory, "manifest.json")
        with open(path, "w") as f:
            json.dump(manifest, f)
        env = dict(os.environ, NODE_PATH=os.path.abspath(args.ort))
        sys.exit(subprocess.run(["node", RUNNER, path], env=env).returncode)


if __name__ == "__main__":
    main()
