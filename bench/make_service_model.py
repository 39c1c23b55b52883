#!/usr/bin/python3
"""make_service_model.py: writes the model of the service benchmarks.

A torch-layout multi_head model, `nn.MultiheadAttention(1024, 16)` (E = 1024,
16 heads, in_proj_weight [3072, 1024], F32, 16 MiB), saved as safetensors
under the name `mh_torch_e1024_h16`. It is generated, not committed: the file
is too large for the repository and its weights mean nothing (PyTorch's own
initialisation under a fixed seed). bench/service_targets.sh calls this.

The weights come from PyTorch when it is installed (Debian's python3-torch),
else from numpy with the same initialisation scale; the bytes are written by
tools/make_example_models.py's safetensors writer either way, so no
safetensors package is needed.

With --precision bf16 the file's metadata asks for BF16 compute
(docs/api.md 5.5) and its name ends in `_bf16`.

Usage: /usr/bin/python3 bench/make_service_model.py OUT_DIR [--embed-dim 1024 --heads 16]
       [--precision fp32|bf16]
"""

import argparse
import pathlib
import sys

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tools"))
from make_example_models import safetensors_bytes, torch_packed  # noqa: E402

SEED = 20261123


def torch_tensors(embed_dim, heads):
    """The state_dict of nn.MultiheadAttention(embed_dim, heads), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.manual_seed(SEED)
    mha = torch.nn.MultiheadAttention(embed_dim, heads, batch_first=True)
    # Torch initialises both biases to zero; random ones make the bias path
    # do visible work, as in a trained model.
    with torch.no_grad():
        mha.in_proj_bias.uniform_(-0.1, 0.1)
        mha.out_proj.bias.uniform_(-0.1, 0.1)
    return [(name, value.detach().numpy().astype(np.float32))
            for name, value in mha.state_dict().items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="directory to write the file to")
    parser.add_argument("--embed-dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    if args.embed_dim < 1 or args.heads < 1 or args.embed_dim % args.heads != 0:
        parser.error(f"--heads must divide --embed-dim; got E={args.embed_dim}, H={args.heads}")
    tensors = torch_tensors(args.embed_dim, args.heads)
    source = "torch"
    if tensors is None:
        tensors = torch_packed(np.random.default_rng(SEED), args.embed_dim)
        source = "numpy"
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_bf16" if args.precision == "bf16" else ""
    path = args.out / f"mh_torch_e{args.embed_dim}_h{args.heads}{suffix}.safetensors"
    metadata = {"kind": "multi_head", "num_heads": str(args.heads)}
    if args.precision == "bf16":
        metadata["precision"] = "bf16"
    path.write_bytes(safetensors_bytes(tensors, metadata, "F32"))
    print(f"{path}: multi_head E={args.embed_dim} H={args.heads}, weights from {source}, "
          f"{path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
