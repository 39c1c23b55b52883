#!/usr/bin/python3
"""make_example_models.py: writes the example model repository models/.

The server loads models/ by default, so a fresh checkout can answer requests
for every kind and the three multi-head layouts. Weights are random (fixed seed, so
the files are reproducible) with PyTorch's nn.Linear initialisation scale,
U(-1/sqrt(fan_in), 1/sqrt(fan_in)), which keeps scores in a sensible range.

The safetensors bytes are written here with struct + json (the format: u64
little-endian header length, JSON header padded with spaces to a multiple of
8 bytes, then the tensors back to back, little-endian and row-major), so the
script needs nothing beyond numpy.

Usage: /usr/bin/python3 tools/make_example_models.py [--out models]
"""

import argparse
import json
import pathlib
import struct

import numpy as np

SEED = 20240611
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def linear_weight(rng, out_features, in_features):
    bound = 1.0 / np.sqrt(in_features)
    return rng.uniform(-bound, bound, size=(out_features, in_features)).astype(np.float32)


def linear_bias(rng, out_features, in_features):
    bound = 1.0 / np.sqrt(in_features)
    return rng.uniform(-bound, bound, size=(out_features,)).astype(np.float32)


def to_bfloat16_bits(values):
    """float32 -> BF16 bit patterns, rounding to nearest even (no NaNs here)."""
    bits = values.astype("<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2")


def encode(values, dtype):
    if dtype == "F32":
        return values.astype("<f4").tobytes()
    if dtype == "F16":
        return values.astype("<f2").tobytes()
    if dtype == "BF16":
        return to_bfloat16_bits(values).tobytes()
    raise ValueError(f"unsupported dtype {dtype}")


def safetensors_bytes(tensors, metadata, dtype):
    """tensors: list of (name, float32 array), written in this order."""
    header = {"__metadata__": metadata}
    data = bytearray()
    for name, values in tensors:
        raw = encode(values, dtype)
        header[name] = {"dtype": dtype, "shape": list(values.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data)


def torch_packed(rng, embed_dim):
    """nn.MultiheadAttention(embed_dim, heads): in_proj_weight [3E, E]."""
    return [
        ("in_proj_weight", np.concatenate([linear_weight(rng, embed_dim, embed_dim) for _ in range(3)])),
        ("in_proj_bias", np.concatenate([linear_bias(rng, embed_dim, embed_dim) for _ in range(3)])),
        ("out_proj.weight", linear_weight(rng, embed_dim, embed_dim)),
        ("out_proj.bias", linear_bias(rng, embed_dim, embed_dim)),
    ]


def torch_separate(rng, embed_dim, kdim, vdim):
    """nn.MultiheadAttention(embed_dim, heads, kdim=, vdim=): q/k/v_proj_weight."""
    return [
        ("q_proj_weight", linear_weight(rng, embed_dim, embed_dim)),
        ("k_proj_weight", linear_weight(rng, embed_dim, kdim)),
        ("v_proj_weight", linear_weight(rng, embed_dim, vdim)),
        ("in_proj_bias", np.concatenate([linear_bias(rng, embed_dim, d) for d in (embed_dim, kdim, vdim)])),
        ("out_proj.weight", linear_weight(rng, embed_dim, embed_dim)),
        ("out_proj.bias", linear_bias(rng, embed_dim, embed_dim)),
    ]


def d2l_multi_head(rng, num_hiddens, query_size, key_size, value_size):
    """d2l.ai MultiHeadAttention with bias=True."""
    tensors = []
    for name, in_features in (("W_q", query_size), ("W_k", key_size), ("W_v", value_size), ("W_o", num_hiddens)):
        tensors.append((f"{name}.weight", linear_weight(rng, num_hiddens, in_features)))
        tensors.append((f"{name}.bias", linear_bias(rng, num_hiddens, in_features)))
    return tensors


def additive(rng, num_hiddens, query_size, key_size):
    """d2l.ai AdditiveAttention (its linear maps have no bias)."""
    return [
        ("W_q.weight", linear_weight(rng, num_hiddens, query_size)),
        ("W_k.weight", linear_weight(rng, num_hiddens, key_size)),
        ("w_v.weight", linear_weight(rng, 1, num_hiddens)),
    ]


def bilinear(rng, query_size, key_size):
    return [("W_k.weight", linear_weight(rng, query_size, key_size))]


def hf_llama(rng, config):
    """A Llama attention module (LlamaAttention: no biases), grouped kv heads."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    return [
        ("q_proj.weight", linear_weight(rng, heads * config["head_dim"], hidden)),
        ("k_proj.weight", linear_weight(rng, kv_width, hidden)),
        ("v_proj.weight", linear_weight(rng, kv_width, hidden)),
        ("o_proj.weight", linear_weight(rng, hidden, heads * config["head_dim"])),
    ]


# The config.json of a Llama 3.2-shaped model shrunk to hidden 64: 8 query
# heads over 2 kv heads, and Llama 3.2's rotary (theta 500000, llama3 scaling).
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
    "num_hidden_layers": 2, "intermediate_size": 256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "attention_bias": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


def hf_layer(config, layer_index):
    """Hugging Face's layout: the model's config.json in the metadata."""
    return {"kind": "multi_head", "config": json.dumps(config, separators=(",", ":")),
            "layer_index": str(layer_index)}


def multi_head(heads):
    return {"kind": "multi_head", "num_heads": str(heads)}


def example_models(rng):
    """(name, tensors, metadata, dtype) of every example model."""
    return [
        ("mh_torch_e256_h8", torch_packed(rng, 256), multi_head(8), "F32"),
        ("mh_torch_kvdim_e64_h4", torch_separate(rng, 64, kdim=32, vdim=48), multi_head(4), "BF16"),
        ("mh_d2l_e64_h4", d2l_multi_head(rng, 64, query_size=48, key_size=32, value_size=40), multi_head(4), "F32"),
        ("additive_h32", additive(rng, 32, query_size=64, key_size=64), {"kind": "additive"}, "F32"),
        ("bilinear_d64", bilinear(rng, 64, 64), {"kind": "bilinear"}, "F16"),
        # Last, so that the models above keep the random numbers they had.
        # Layer 1 of 2: without a window in the config, any index computes the same.
        ("mh_hf_llama_e64_h8_kv2", hf_llama(rng, LLAMA_CONFIG), hf_layer(LLAMA_CONFIG, 1), "F32"),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT / "models",
                        help="directory to write the .safetensors files to (default: models/)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    for name, tensors, metadata, dtype in example_models(rng):
        path = args.out / f"{name}.safetensors"
        path.write_bytes(safetensors_bytes(tensors, metadata, dtype))
        print(f"{path}: {metadata['kind']}, {dtype}, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
