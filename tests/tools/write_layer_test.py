"""tools_write_layer_test: tools/write_layer.py writes layer files the server serves.

A small Qwen 2-shaped checkpoint is written here (two shards, BF16, F16 and
F32 tensors, an index, config.json, tensors of other modules around the
attention's); the tool's output is read back with this file's own
safetensors reader and checked tensor by tensor (names, shapes, F32 values
equal to the source's) and key by key (kind, config, layer_index). Then an
attention-server with --strict (a bad file stops its start) serves the files
written, and one layer's answer over REST is checked against a numpy
computation of Hugging Face's attention. Also: a module's state dict (numpy,
and torch when it is installed), Phi-3's fused qkv_proj split in three,
each refusal with its message, and layers the engine cannot compute (a
dynamic rope, kv heads that do not divide the heads) skipped by a server
without --strict with their reasons while the good one serves.

    ATTENTION_SERVER_BIN=build/server/attention-server /usr/bin/python3 tests/tools/write_layer_test.py
"""

import json
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

import numpy as np

SOURCE_DIR = pathlib.Path(__file__).resolve().parents[2]
TOOL = SOURCE_DIR / "tools" / "write_layer.py"
sys.path.insert(0, str(TOOL.parent))
import write_layer  # noqa: E402  (tools/ is not a package)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": HIDDEN,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": 2,
    "rope_theta": 10000.0, "use_sliding_window": True, "sliding_window": 4,
    "max_window_layers": 1, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
}
# The attention tensors of each layer (Qwen 2: biases on q, k and v only).
LAYER_SHAPES = {
    "q_proj.weight": [HEADS * HEAD_DIM, HIDDEN], "q_proj.bias": [HEADS * HEAD_DIM],
    "k_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN], "k_proj.bias": [KV_HEADS * HEAD_DIM],
    "v_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN], "v_proj.bias": [KV_HEADS * HEAD_DIM],
    "o_proj.weight": [HIDDEN, HEADS * HEAD_DIM],
}


def bf16_bits(values):
    """float32 values exact in BF16 (as made here) to their BF16 bits."""
    bits = np.asarray(values, dtype="<f4").view("<u4")
    assert not np.any(bits & 0xFFFF), "value not exact in BF16"
    return (bits >> 16).astype("<u2")


def encode(values, dtype):
    if dtype == "F32":
        return np.asarray(values, dtype="<f4").tobytes()
    if dtype == "F16":
        return np.asarray(values, dtype="<f2").tobytes()
    if dtype == "BF16":
        return bf16_bits(values).tobytes()
    if dtype == "I32":
        return np.asarray(values, dtype="<i4").tobytes()
    raise ValueError(dtype)


def write_shard(path, tensors):
    """tensors: [(name, dtype, float32 array)], back to back in this order."""
    header, data = {"__metadata__": {"format": "pt"}}, bytearray()
    for name, dtype, values in tensors:
        raw = encode(values, dtype)
        header[name] = {"dtype": dtype, "shape": list(np.shape(values)),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data))


def read_safetensors(path):
    """(metadata, {name: (dtype, shape, float32 array)}), checking that the
    header is padded to 8 bytes and that the tensors tile the data exactly."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0, f"header length {length} is not a multiple of 8"
    header = json.loads(raw[8:8 + length])
    data = raw[8 + length:]
    metadata = header.pop("__metadata__")
    tensors, spans = {}, []
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        spans.append((begin, end))
        assert entry["dtype"] == "F32", f"{name} is {entry['dtype']}"
        values = np.frombuffer(data[begin:end], dtype="<f4").reshape(entry["shape"])
        tensors[name] = (entry["dtype"], entry["shape"], values)
    position = 0
    for begin, end in sorted(spans):
        assert begin == position, f"data gap or overlap at byte {begin}"
        position = end
    assert position == len(data), f"{len(data) - position} bytes after the last tensor"
    return metadata, tensors


def layer_values(rng):
    """Random weights exact in BF16 and F16 (multiples of 1/64 in [-1, 1]),
    so every dtype holds them as they are."""
    return {name: (rng.integers(-64, 65, size=shape) / 64).astype(np.float32)
            for name, shape in LAYER_SHAPES.items()}


class Server:
    """attention-server on 127.0.0.1, port 0, serving `repository` (--strict:
    a bad file stops the start)."""

    def __init__(self, repository, strict=True):
        self.dir = tempfile.mkdtemp()
        ports, self.log_path = os.path.join(self.dir, "ports"), os.path.join(self.dir, "log")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [os.environ["ATTENTION_SERVER_BIN"], "--address", "127.0.0.1:0",
                 "--metrics-address", "", "--http-address", "127.0.0.1:0", "--port-file", ports,
                 "--threads", "1", "--warmup", "false", *(["--strict"] if strict else []),
                 "--model-repository", str(repository)],
                stdout=log, stderr=subprocess.STDOUT)
        give_up = time.monotonic() + 60
        while not os.path.exists(ports):
            if self.process.poll() is not None or time.monotonic() > give_up:
                raise AssertionError(f"the server did not start:\n{self.log()}")
            time.sleep(0.05)
        with open(ports) as f:
            self.http = dict(line.split() for line in f.read().splitlines())["http"]

    def log(self):
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def rest(self, path, body=None):
        request = urllib.request.Request(
            f"http://{self.http}{path}", data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=60)
        shutil.rmtree(self.dir)
        return code


def hf_attention(x, layer, positions):
    """Hugging Face's Qwen 2 attention in float64 (default rotary, causal, no
    window): what a layer file written from `layer` must compute."""
    x = x.astype(np.float64)
    w = {name: values.astype(np.float64) for name, values in layer.items()}
    n = x.shape[0]
    q = (x @ w["q_proj.weight"].T + w["q_proj.bias"]).reshape(n, HEADS, HEAD_DIM)
    k = (x @ w["k_proj.weight"].T + w["k_proj.bias"]).reshape(n, KV_HEADS, HEAD_DIM)
    v = (x @ w["v_proj.weight"].T + w["v_proj.bias"]).reshape(n, KV_HEADS, HEAD_DIM)
    inv_freq = 1.0 / CONFIG["rope_theta"] ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    angles = np.concatenate([np.outer(positions, inv_freq)] * 2, axis=1)[:, None, :]
    cos, sin = np.cos(angles), np.sin(angles)

    def rotate_half(t):
        half = HEAD_DIM // 2
        return np.concatenate([-t[..., half:], t[..., :half]], axis=-1)

    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    group = HEADS // KV_HEADS
    heads = []
    for h in range(HEADS):
        scores = q[:, h] @ k[:, h // group].T / np.sqrt(HEAD_DIM)
        scores[np.triu_indices(n, 1)] = -np.inf
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        heads.append(weights / weights.sum(axis=1, keepdims=True) @ v[:, h // group])
    return np.concatenate(heads, axis=1) @ w["o_proj.weight"].T


class WriteLayerTest(unittest.TestCase):
    def setUp(self):
        self.work = pathlib.Path(tempfile.mkdtemp())
        self.addCleanup(shutil.rmtree, self.work)
        self.checkpoint = self.work / "checkpoint"
        self.checkpoint.mkdir()
        rng = np.random.default_rng(7)
        self.layers = [layer_values(rng) for _ in range(2)]
        other = {"model.embed_tokens.weight": np.ones((10, HIDDEN), np.float32),
                 "model.norm.weight": np.ones(HIDDEN, np.float32)}
        for i in range(2):
            other[f"model.layers.{i}.mlp.up_proj.weight"] = np.ones((16, HIDDEN), np.float32)
            other[f"model.layers.{i}.input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        attn = "model.layers.{}.self_attn.{}"
        # Layer 0 in shard 1, BF16 as checkpoints are; layer 1 split over both
        # shards, F16 and F32, with the rotary buffer older transformers saved.
        shard1 = [(name, "BF16", values) for name, values in other.items()]
        shard1 += [(attn.format(0, name), "BF16", values) for name, values in self.layers[0].items()]
        shard1 += [(attn.format(1, "q_proj.weight"), "F16", self.layers[1]["q_proj.weight"])]
        shard2 = [(attn.format(1, name), "F32", values)
                  for name, values in self.layers[1].items() if name != "q_proj.weight"]
        shard2 += [(attn.format(1, "rotary_emb.inv_freq"), "F32", np.ones(HEAD_DIM // 2))]
        self.shards = [self.checkpoint / "model-00001-of-00002.safetensors",
                       self.checkpoint / "model-00002-of-00002.safetensors"]
        for path, tensors in zip(self.shards, (shard1, shard2)):
            write_shard(path, tensors)
        weight_map = {name: path.name for path, tensors in zip(self.shards, (shard1, shard2))
                      for name, _, _ in tensors}
        (self.checkpoint / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
        (self.checkpoint / "config.json").write_text(json.dumps(CONFIG, indent=2))
        self.repository = self.work / "repository"
        self.repository.mkdir()

    def run_tool(self, *args):
        return subprocess.run([sys.executable, str(TOOL), *map(str, args)],
                              capture_output=True, text=True, timeout=120)

    def write(self, name, *args):
        """Runs the tool to write repository/<name>.safetensors; its path."""
        out = self.repository / f"{name}.safetensors"
        result = self.run_tool(*args, "--out", out)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn(str(out), result.stdout)
        return out

    def refused(self, *args):
        """Runs the tool, expecting a refusal; its message."""
        result = self.run_tool(*args, "--out", self.work / "refused.safetensors")
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertFalse((self.work / "refused.safetensors").exists())
        return result.stderr

    def check_layer_file(self, path, layer, layer_index, config=CONFIG):
        metadata, tensors = read_safetensors(path)
        self.assertEqual(sorted(tensors), sorted(layer))
        for name, (dtype, shape, values) in tensors.items():
            self.assertEqual(shape, list(layer[name].shape), name)
            np.testing.assert_array_equal(values, layer[name], err_msg=name)
        self.assertEqual(metadata["kind"], "multi_head")
        self.assertEqual(json.loads(metadata["config"]), config)
        self.assertEqual(metadata.get("layer_index"), layer_index)
        self.assertEqual(sorted(metadata), sorted(["kind", "config"] +
                                                  (["layer_index"] if layer_index else [])))
        self.assertEqual(list(path.parent.glob("*.tmp")), [], "temporary file left behind")

    def test_from_a_checkpoint_directory(self):
        for index in (0, 1):
            out = self.write(f"layer{index}", "--checkpoint", self.checkpoint,
                             "--prefix", f"model.layers.{index}.self_attn.")
            self.check_layer_file(out, self.layers[index], str(index))

    def test_from_the_index_or_the_shards_the_same_bytes(self):
        from_dir = self.write("a", "--checkpoint", self.checkpoint,
                              "--prefix", "model.layers.1.self_attn.")
        from_index = self.write("b", "--checkpoint",
                                self.checkpoint / "model.safetensors.index.json",
                                "--prefix", "model.layers.1.self_attn.")
        from_shards = self.write("c", "--checkpoint", *self.shards,
                                 "--config", self.checkpoint / "config.json",
                                 "--prefix", "model.layers.1.self_attn.")
        self.assertEqual(from_dir.read_bytes(), from_index.read_bytes())
        self.assertEqual(from_dir.read_bytes(), from_shards.read_bytes())

    def test_flags_become_metadata(self):
        out = self.write("flags", "--checkpoint", self.checkpoint, "--prefix",
                         "model.layers.0.self_attn.", "--rope-interleaved", "--alibi")
        metadata, _ = read_safetensors(out)
        self.assertEqual((metadata["rope_interleaved"], metadata["alibi"]), ("true", "true"))
        out = self.write("index", "--checkpoint", self.checkpoint, "--prefix",
                         "model.layers.1.self_attn.", "--layer-index", "1")
        self.assertEqual(read_safetensors(out)[0]["layer_index"], "1")

    def test_refusals_name_the_reason(self):
        def expect(fragment, *args):
            self.assertIn(fragment, self.refused(*args))

        expect("no tensor in", "--checkpoint", self.checkpoint, "--prefix", "model.layers.9.attn.")
        expect("e.g. model.layers.0.self_attn.q_proj.weight", "--checkpoint", self.checkpoint,
               "--prefix", "model.layers.9.attn.")
        expect("--layer-index 3, but the prefix 'model.layers.1.self_attn.' says layer 1",
               "--checkpoint", self.checkpoint, "--prefix", "model.layers.1.self_attn.",
               "--layer-index", "3")
        message = self.refused("--checkpoint", self.checkpoint, "--prefix", "model.layers.0.")
        self.assertIn("model.layers.0.mlp.up_proj.weight", message)
        self.assertIn("have no place in Hugging Face's attention layout", message)
        self.assertIn("is the prefix model.layers.0.self_attn.?", message)
        expect("config.json: No such file or directory", "--checkpoint", self.shards[0],
               "--config", self.work / "config.json", "--prefix", "model.layers.0.self_attn.")

        odd = self.work / "odd"
        odd.mkdir()
        (odd / "config.json").write_text(json.dumps(dict(CONFIG, model_type="gemma3_text")))
        layer = [(f"model.layers.0.self_attn.{name}", "F32", values)
                 for name, values in self.layers[0].items()]
        write_shard(odd / "model.safetensors", layer)
        expect("Gemma 3's q_norm and k_norm multiply by (1 + weight)", "--checkpoint", odd,
               "--prefix", "model.layers.0.self_attn.")
        (odd / "config.json").write_text("{not json")
        expect("config is not JSON", "--checkpoint", odd, "--prefix", "model.layers.0.self_attn.")
        (odd / "config.json").write_text(json.dumps(CONFIG))
        write_shard(odd / "model.safetensors", layer + [
            ("model.layers.0.self_attn.query_key_value.weight", "F32", np.ones((2, 2)))])
        expect("model.layers.0.self_attn.query_key_value.weight have no place", "--checkpoint",
               odd, "--prefix", "model.layers.0.self_attn.")
        write_shard(odd / "model.safetensors",
                    layer + [("model.layers.0.self_attn.qkv_proj.weight", "F32", np.ones((2, 2)))])
        expect("qkv_proj.weight and q/k/v_proj.weight both present", "--checkpoint", odd,
               "--prefix", "model.layers.0.self_attn.")
        write_shard(odd / "model.safetensors", [
            ("model.layers.0.self_attn.qkv_proj.weight", "F32", np.ones((60, HIDDEN))),
            ("model.layers.0.self_attn.o_proj.weight", "F32", self.layers[0]["o_proj.weight"])])
        expect("tensor 'model.layers.0.self_attn.qkv_proj.weight' has 60 rows, expected "
               "(num_attention_heads 4 + 2 * num_key_value_heads 2) * head_dim 8 = 64",
               "--checkpoint", odd, "--prefix", "model.layers.0.self_attn.")
        write_shard(odd / "model.safetensors",
                    layer + [("model.layers.0.self_attn.sinks", "I32", np.ones(HEADS))])
        expect("tensor 'model.layers.0.self_attn.sinks': dtype I32, expected a float",
               "--checkpoint", odd, "--prefix", "model.layers.0.self_attn.")
        write_shard(odd / "model.safetensors", [entry for entry in layer
                                                if not entry[0].endswith("o_proj.weight")])
        expect("missing tensor(s) model.layers.0.self_attn.o_proj.weight", "--checkpoint", odd,
               "--prefix", "model.layers.0.self_attn.")
        infinite = [(name, dtype, values * np.inf if name.endswith("k_proj.bias") else values)
                    for name, dtype, values in layer]
        write_shard(odd / "model.safetensors", infinite)
        expect("tensor 'model.layers.0.self_attn.k_proj.bias' has non-finite values", "--checkpoint", odd,
               "--prefix", "model.layers.0.self_attn.")

    def test_splits_phi3_fused_qkv_proj(self):
        phi3 = self.work / "phi3"
        phi3.mkdir()
        config = dict(CONFIG, model_type="phi3", architectures=["Phi3ForCausalLM"])
        (phi3 / "config.json").write_text(json.dumps(config))
        layer = self.layers[0]
        fused = np.concatenate([layer["q_proj.weight"], layer["k_proj.weight"],
                                layer["v_proj.weight"]])
        write_shard(phi3 / "model.safetensors", [
            ("model.layers.3.self_attn.qkv_proj.weight", "BF16", fused),
            ("model.layers.3.self_attn.o_proj.weight", "BF16", layer["o_proj.weight"])])
        out = self.write("phi3", "--checkpoint", phi3, "--prefix", "model.layers.3.self_attn.")
        expected = {name: values for name, values in layer.items() if name.endswith("weight")}
        self.check_layer_file(out, expected, "3", config)

    def test_from_a_state_dict_with_a_prefix(self):
        state_dict = {f"model.layers.5.self_attn.{name}": values
                      for name, values in self.layers[1].items()}
        state_dict["model.layers.4.self_attn.q_proj.weight"] = np.zeros((1, 1), np.float32)
        multimodal = {"model_type": "some_vlm", "text_config": CONFIG, "vision_config": {}}
        out = self.repository / "from_state_dict.safetensors"
        metadata = write_layer.write_layer(out, state_dict, json.dumps(multimodal),
                                           prefix="model.layers.5.self_attn.")
        self.assertEqual(metadata["layer_index"], "5")
        self.check_layer_file(out, self.layers[1], "5")
        # A transformers config object: what its to_json_string() writes.

        class PretrainedConfig:
            def to_json_string(self):
                return json.dumps(CONFIG, indent=2) + "\n"

        write_layer.write_layer(out, state_dict, PretrainedConfig(),
                                prefix="model.layers.5.self_attn.")
        self.check_layer_file(out, self.layers[1], "5")
        # Without a prefix, no layer_index is written: the server takes 0.
        module = {name: values.astype(np.float64) for name, values in self.layers[0].items()}
        write_layer.write_layer(out, module, CONFIG)
        self.check_layer_file(out, self.layers[0], None)

    def test_from_a_torch_module(self):
        try:
            import torch
        except ImportError:
            self.skipTest("torch is not installed")

        class RMSNorm(torch.nn.Module):
            def __init__(self, size):
                super().__init__()
                self.weight = torch.nn.Parameter(1 + torch.randn(size) / 8)

        class Attention(torch.nn.Module):
            """The state dict of a Qwen 3 attention module: qk-norm per head."""

            def __init__(self):
                super().__init__()
                self.q_proj = torch.nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
                self.k_proj = torch.nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
                self.v_proj = torch.nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
                self.o_proj = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
                self.q_norm, self.k_norm = RMSNorm(HEAD_DIM), RMSNorm(HEAD_DIM)

        torch.manual_seed(0)
        module = Attention().to(torch.bfloat16)
        out = self.repository / "qwen3_torch.safetensors"
        write_layer.write_layer(out, module.state_dict(), dict(CONFIG, model_type="qwen3"))
        expected = {name: tensor.float().numpy() for name, tensor in module.state_dict().items()}
        self.check_layer_file(out, expected, None, dict(CONFIG, model_type="qwen3"))

    def test_the_server_serves_what_it_writes_and_computes_the_layer(self):
        for index in (0, 1):
            self.write(f"qwen_layer{index}", "--checkpoint", self.checkpoint,
                       "--prefix", f"model.layers.{index}.self_attn.")
        fused = np.concatenate([self.layers[1][name] for name in ("q_proj.weight", "k_proj.weight",
                                                                  "v_proj.weight")])
        write_layer.write_layer(self.repository / "phi3_layer1.safetensors",
                                {"qkv_proj.weight": fused,
                                 "o_proj.weight": self.layers[1]["o_proj.weight"]},
                                dict(CONFIG, model_type="phi3"), layer_index=1)
        shutil.copy(SOURCE_DIR / "models" / "mh_hf_llama_e64_h8_kv2.safetensors", self.repository)
        server = Server(self.repository)
        self.addCleanup(lambda: server.process.poll() is None and server.stop())
        for name, hidden in (("qwen_layer0", HIDDEN), ("qwen_layer1", HIDDEN),
                             ("phi3_layer1", HIDDEN), ("mh_hf_llama_e64_h8_kv2", 64)):
            described = server.rest(f"/v2/models/{name}")
            shapes = {tensor["name"]: tensor["shape"] for tensor in described["inputs"]}
            self.assertEqual(shapes["queries"][-1], hidden, described)

        # Layer 0 is below max_window_layers: no window; n = 6 > the window 4
        # would show one.
        x = (np.random.default_rng(3).standard_normal((6, HIDDEN)) / 4).astype(np.float32)
        answer = server.rest("/v2/models/qwen_layer0/infer", {
            "parameters": {"causal": True},
            "inputs": [{"name": "queries", "datatype": "FP32", "shape": [1, 6, HIDDEN],
                        "data": x.ravel().tolist()}]})
        output = answer["outputs"][0]
        self.assertEqual(output["shape"], [1, 6, HIDDEN])
        np.testing.assert_allclose(np.array(output["data"]).reshape(6, HIDDEN),
                                   hf_attention(x, self.layers[0], np.arange(6)),
                                   atol=1e-4, rtol=1e-4)
        self.assertEqual(server.stop(), 0)

    def test_a_layer_the_engine_cannot_compute_is_skipped_with_its_reason(self):
        good = self.write("good", "--checkpoint", self.checkpoint,
                          "--prefix", "model.layers.0.self_attn.")
        bad = {"dynamic": dict(CONFIG, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
               "kv_heads": dict(CONFIG, num_key_value_heads=3)}
        for name, config in bad.items():
            write_layer.write_layer(self.repository / f"{name}.safetensors", self.layers[0], config)
        server = Server(self.repository, strict=False)
        self.addCleanup(lambda: server.process.poll() is None and server.stop())
        log = server.log()
        for name, reason in (
                ("dynamic", 'config "rope_scaling.rope_type" is "dynamic", expected default, '
                            'linear, llama3 or yarn'),
                ("kv_heads", 'config "num_attention_heads" 4 is not a multiple of '
                             '"num_key_value_heads" 3')):
            self.assertIn(f"model skipped: {self.repository / name}.safetensors: {reason}", log)
        self.assertEqual(server.rest(f"/v2/models/{good.stem}")["name"], good.stem)
        self.assertEqual(server.stop(), 0)


if __name__ == "__main__":
    unittest.main()
