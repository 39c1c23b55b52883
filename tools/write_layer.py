#!/usr/bin/python3
"""write_layer.py: writes one Hugging Face attention layer as a model file.

The server loads a layer in Hugging Face's layout (docs/api.md 5.6) from its
attention module's tensors (q_proj.weight, k_proj.weight, v_proj.weight,
o_proj.weight; optional .bias on each, q_norm.weight, k_norm.weight, sinks)
and the model's config.json in the file's metadata. `save_file(
layer.self_attn.state_dict(), path, metadata={"kind": "multi_head", "config":
model.config.to_json_string()})` writes such a file; this script does the same
without the safetensors package, and straight from a checkpoint:

  from a checkpoint's safetensors shard(s), a tensor prefix and its config.json
  (the layer index comes from the prefix):

    /usr/bin/python3 tools/write_layer.py --checkpoint path/to/Llama-3.2-1B \\
        --prefix model.layers.7.self_attn. --out models/llama_layer7.safetensors

  --checkpoint takes the checkpoint's directory (its model.safetensors.index.json
  or every *.safetensors in it), an index file, or shard files; --config
  defaults to the config.json beside them.

  from PyTorch (torch only needed for torch tensors; numpy arrays work too):

    import sys; sys.path.insert(0, "tools")
    from write_layer import write_layer
    write_layer("models/layer7.safetensors", model.model.layers[7].self_attn.state_dict(),
                model.config, layer_index=7)

Every tensor is written as F32 (BF16, F16 and F64 are converted; BF16 and F16
exactly). The metadata holds "kind": "multi_head", "config" (the config as
JSON; a multimodal config's "text_config" when the top level has no
num_attention_heads), "layer_index", and "rope_interleaved" / "alibi" when
asked for. The file is written beside its destination as <name>.tmp and
renamed into place, so a server polling the repository never reads half of it.

Phi-3's fused qkv_proj.weight is split into q_proj, k_proj and v_proj by
the config's head counts. Refused, with the reason: no tensor under the
prefix, a tensor under it that the layout has no place for (GPT-NeoX's
query_key_value, say), a dtype that is not a float, a non-finite weight,
and configs of models whose attention the file cannot describe (Gemma 3:
its qk-norm multiplies by 1 + weight).
"""

import argparse
import json
import os
import pathlib
import re
import struct
import sys

import numpy as np

from make_example_models import safetensors_bytes

# The tensors of Hugging Face's attention layout, as docs/api.md 5.3 lists them.
LAYER_TENSORS = (
    "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
    "v_proj.weight", "v_proj.bias", "o_proj.weight", "o_proj.bias",
    "q_norm.weight", "k_norm.weight", "sinks",
)
REQUIRED_TENSORS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
# Phi-3's fused projection, split into the three above (split_fused).
FUSED_TENSORS = ("qkv_proj.weight", "qkv_proj.bias")
# Buffers some transformers versions keep in the module's state dict that the
# server recomputes from the config (rotary frequencies): left out.
DERIVED_PREFIXES = ("rotary_emb.",)
# safetensors' own cap on a header, so a file that is not one fails fast.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Model types whose attention this layout would compute differently.
UNSUPPORTED_MODEL_TYPES = {
    "gemma3": "Gemma 3's q_norm and k_norm multiply by (1 + weight), the layout's by weight",
    "gemma3_text": "Gemma 3's q_norm and k_norm multiply by (1 + weight), the layout's by weight",
}


class LayerError(Exception):
    """A layer that cannot be written; the message says why."""


# ---- reading safetensors checkpoints ----------------------------------------

def json_object(text, what):
    """`text` parsed as a JSON object; LayerError naming `what` otherwise."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise LayerError(f"{what} is not JSON: {error}") from None
    if not isinstance(value, dict):
        raise LayerError(f"{what} is a JSON {type(value).__name__}, expected an object")
    return value


def read_header(path):
    """The header of safetensors file `path`: (entries by name, data offset)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise LayerError(f"{path}: not a safetensors file ({len(prefix)} bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise LayerError(f"{path}: not a safetensors file (header length {length})")
        text = f.read(length)
    if len(text) != length:
        raise LayerError(f"{path}: truncated header ({len(text)} of {length} bytes)")
    header = json_object(text, f"{path}: header")
    header.pop("__metadata__", None)
    return header, 8 + length


def widen(raw, dtype, shape, where):
    """Little-endian bytes of `dtype` to a float32 array of `shape`."""
    if dtype == "F32":
        values = np.frombuffer(raw, dtype="<f4")
    elif dtype == "F16":
        values = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    elif dtype == "BF16":
        values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    elif dtype == "F64":
        values = np.frombuffer(raw, dtype="<f8").astype(np.float32)
    else:
        raise LayerError(f"{where}: dtype {dtype}, expected a float (F32, F16, BF16 or F64)")
    count = int(np.prod(shape, dtype=np.int64))
    if values.size != count:
        raise LayerError(f"{where}: {len(raw)} bytes for shape {list(shape)} of {dtype}")
    return values.reshape(shape).astype(np.float32)


def read_tensor(path, name, entry, data_start):
    begin, end = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        raw = f.read(end - begin)
    if len(raw) != end - begin:
        raise LayerError(f"{path}: tensor '{name}' runs past the end of the file")
    return widen(raw, entry["dtype"], entry["shape"], f"{path}: tensor '{name}'")


def shard_paths(checkpoint):
    """The shard files `checkpoint` names: a directory, an index file or shards.

    An index (model.safetensors.index.json) maps each tensor to its shard;
    only the shards it names are read.
    """
    paths = []
    for given in checkpoint:
        given = pathlib.Path(given)
        if given.is_dir():
            index = given / "model.safetensors.index.json"
            found = [index] if index.exists() else sorted(given.glob("*.safetensors"))
            if not found:
                raise LayerError(f"{given}: no model.safetensors.index.json and no *.safetensors")
            paths += found
        elif not given.exists():
            raise LayerError(f"{given}: no such file or directory")
        else:
            paths.append(given)
    shards = []
    for path in paths:
        if path.name.endswith(".json"):
            try:
                weight_map = json.loads(path.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise LayerError(f"{path}: not a safetensors index (no weight_map): {error}") from None
            for shard in sorted(set(weight_map.values())):
                shards.append(path.parent / shard)
        else:
            shards.append(path)
    return list(dict.fromkeys(shards))


def checkpoint_tensors(checkpoint, prefix):
    """{name: float32 array} of the tensors of `checkpoint` whose name starts
    with `prefix`."""
    tensors, seen_in = {}, {}
    for shard in shard_paths(checkpoint):
        header, data_start = read_header(shard)
        for name, entry in header.items():
            if not name.startswith(prefix):
                continue
            if name in seen_in:
                raise LayerError(f"tensor '{name}' is in both {seen_in[name]} and {shard}")
            seen_in[name] = shard
            tensors[name] = read_tensor(shard, name, entry, data_start)
    if not tensors:
        raise LayerError(f"no tensor in {', '.join(map(str, checkpoint))} starts with "
                         f"'{prefix}'{nearby_names(checkpoint, prefix)}")
    return tensors


def nearby_names(checkpoint, prefix):
    """A hint for a prefix that matched nothing: attention tensors that exist."""
    names = []
    for shard in shard_paths(checkpoint):
        names += [n for n in read_header(shard)[0] if n.endswith("q_proj.weight")]
    if not names:
        return " (and no tensor ends in q_proj.weight)"
    shown = sorted(names)[:3]
    return f"; tensors ending in q_proj.weight are e.g. {', '.join(shown)}"


# ---- the layer ---------------------------------------------------------------

def as_float32(name, value):
    """A torch tensor or array-like as a float32 numpy array."""
    if hasattr(value, "detach"):  # torch: numpy() has no bfloat16
        import torch  # only when given torch tensors
        if not value.is_floating_point():
            raise LayerError(f"tensor '{name}' has dtype {value.dtype}, expected a float")
        value = value.detach().to(device="cpu", dtype=torch.float32).numpy()
    array = np.asarray(value)
    if array.dtype.kind != "f":
        raise LayerError(f"tensor '{name}' has dtype {array.dtype}, expected a float")
    return np.ascontiguousarray(array, dtype=np.float32)


def split_fused(layer, config, prefix):
    """Phi-3's fused qkv_proj ([H hd + 2 H_kv hd, hidden], rows q, then k,
    then v) as q_proj, k_proj and v_proj, which is what Phi3Attention slices."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    widths = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    for part in ("weight", "bias"):
        fused = layer.pop(f"qkv_proj.{part}", None)
        if fused is None:
            continue
        if any(f"{name}.{part}" in layer for name in ("q_proj", "k_proj", "v_proj")):
            raise LayerError(f"{prefix}qkv_proj.{part} and q/k/v_proj.{part} both present")
        if fused.shape[0] != sum(widths):
            raise LayerError(
                f"tensor '{prefix}qkv_proj.{part}' has {fused.shape[0]} rows, expected "
                f"(num_attention_heads {heads} + 2 * num_key_value_heads {kv_heads}) * head_dim "
                f"{head_dim} = {sum(widths)}")
        first = 0
        for name, width in zip(("q_proj", "k_proj", "v_proj"), widths):
            layer[f"{name}.{part}"] = np.ascontiguousarray(fused[first:first + width])
            first += width


def select_layer(tensors, config, prefix=""):
    """The layer's tensors of `tensors` ({name: tensor}) under `prefix`,
    named as the layout names them, as float32 arrays; `config` (a dict)
    sizes a fused qkv_proj."""
    layer, unexpected = {}, []
    for name, value in tensors.items():
        if not name.startswith(prefix):
            continue
        short = name[len(prefix):]
        if short.startswith(DERIVED_PREFIXES):
            continue
        if short not in LAYER_TENSORS + FUSED_TENSORS:
            unexpected.append(name)
            continue
        array = as_float32(name, value)
        if not np.all(np.isfinite(array)):
            raise LayerError(f"tensor '{name}' has non-finite values")
        layer[short] = array
    if unexpected:
        shown = sorted(unexpected)[:5]
        more = f" and {len(unexpected) - len(shown)} more" if len(unexpected) > len(shown) else ""
        hint = [name[:-len("q_proj.weight")] for name in unexpected
                if name.endswith(".q_proj.weight")]
        hint = f"; is the prefix {hint[0]}?" if len(hint) == 1 else ""
        raise LayerError(f"tensor(s) {', '.join(shown)}{more} have no place in Hugging "
                         f"Face's attention layout ({', '.join(LAYER_TENSORS)}){hint}")
    split_fused(layer, config, prefix)
    missing = [name for name in REQUIRED_TENSORS if name not in layer]
    if missing:
        raise LayerError(f"missing tensor(s) {', '.join(prefix + m for m in missing)}")
    return layer


def config_dict(config):
    """The config as a dict: a dict, JSON text, a config.json path, or a
    transformers config (as its to_json_string() writes it, the form
    save_file users store). A multimodal config gives its text_config."""
    if hasattr(config, "to_json_string"):
        config = json_object(config.to_json_string(), "config")
    elif isinstance(config, (str, os.PathLike)):
        text = str(config)
        if not text.lstrip().startswith("{"):
            try:
                text = pathlib.Path(config).read_text()
            except OSError as error:
                raise LayerError(f"config {config}: {error.strerror}") from None
        config = json_object(text, "config")
    if not isinstance(config, dict):
        raise LayerError(f"config is a {type(config).__name__}, expected a JSON object")
    if "num_attention_heads" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    if "num_attention_heads" not in config:
        raise LayerError("config has no num_attention_heads (is it the model's config.json?)")
    model_type = config.get("model_type")
    if model_type in UNSUPPORTED_MODEL_TYPES:
        raise LayerError(f"config model_type {model_type!r}: {UNSUPPORTED_MODEL_TYPES[model_type]}")
    return config


def layer_index_of(prefix):
    """The last number between dots of `prefix` (model.layers.7.self_attn. -> 7),
    or None."""
    numbers = re.findall(r"(?:^|\.)(\d+)(?=\.)", prefix)
    return int(numbers[-1]) if numbers else None


def write_layer(path, tensors, config, layer_index=None, prefix="", rope_interleaved=False,
                alibi=False):
    """Writes the attention layer of `tensors` (a state dict: {name: torch
    tensor or array}, the module's own or a whole model's with `prefix`) and
    `config` (see config_dict) to `path`. Returns the metadata written."""
    config = config_dict(config)
    layer = select_layer(tensors, config, prefix)
    metadata = {"kind": "multi_head", "config": json.dumps(config, separators=(",", ":"))}
    if layer_index is None:
        layer_index = layer_index_of(prefix)
    if layer_index is not None:
        if int(layer_index) < 0:
            raise LayerError(f"layer_index {layer_index}, expected >= 0")
        metadata["layer_index"] = str(int(layer_index))
    if rope_interleaved:
        metadata["rope_interleaved"] = "true"
    if alibi:
        metadata["alibi"] = "true"
    path = pathlib.Path(path)
    temporary = path.with_name(path.name + ".tmp")
    named = [(name, layer[name]) for name in sorted(layer)]
    temporary.write_bytes(safetensors_bytes(named, metadata, "F32"))
    os.replace(temporary, path)
    return metadata


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="From PyTorch, import write_layer from this file (see its docstring).")
    parser.add_argument("--checkpoint", nargs="+", required=True,
                        help="the checkpoint's directory, its model.safetensors.index.json, "
                             "or shard files")
    parser.add_argument("--prefix", required=True,
                        help="the layer's tensor prefix, e.g. model.layers.7.self_attn.")
    parser.add_argument("--config", help="the model's config.json (default: beside the checkpoint)")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="the file to write")
    parser.add_argument("--layer-index", type=int,
                        help="the layer's index in the model (default: the prefix's last number)")
    parser.add_argument("--rope-interleaved", action="store_true",
                        help="rotary on adjacent pairs (Meta's and GPT-J's order)")
    parser.add_argument("--alibi", action="store_true", help="ALiBi instead of rotary")
    args = parser.parse_args(argv)
    try:
        if args.config is None:
            first = pathlib.Path(args.checkpoint[0])
            args.config = (first if first.is_dir() else first.parent) / "config.json"
        from_prefix = layer_index_of(args.prefix)
        if None not in (args.layer_index, from_prefix) and args.layer_index != from_prefix:
            raise LayerError(f"--layer-index {args.layer_index}, but the prefix "
                             f"'{args.prefix}' says layer {from_prefix}")
        tensors = checkpoint_tensors(args.checkpoint, args.prefix)
        metadata = write_layer(args.out, tensors, args.config, args.layer_index, args.prefix,
                               rope_interleaved=args.rope_interleaved, alibi=args.alibi)
    except LayerError as error:
        print(f"write_layer: {error}", file=sys.stderr)
        return 1
    shapes = ", ".join(f"{n[len(args.prefix):]} {list(t.shape)}"
                       for n, t in sorted(tensors.items()) if n[len(args.prefix):] in LAYER_TENSORS)
    print(f"{args.out}: layer_index {metadata.get('layer_index', '0 (default)')}, {shapes}; "
          f"{args.out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
