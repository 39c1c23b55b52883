"""attention_client: call attention-server from Python, numpy arrays in and out.

    from attention_client import AttentionClient

    with AttentionClient("127.0.0.1:50051") as client:
        result = client.attend(queries, keys, values, model="dot_product",
                               valid_lens=[2, 6], return_attention_weights=True)
        result.output             # numpy float32, (B, n_q, d_v)
        result.attention_weights  # numpy float32, (B, n_q, n_k), or None

The gRPC stubs are generated from the repository's proto/ on first use (with
Debian's protoc and grpc_python_plugin; see generate_stubs). A failed call
raises grpc.RpcError; its .code() is the server's status code.
"""

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import NamedTuple, Optional

import grpc
import numpy as np

PROTO_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto")
PROTO_FILE = "attention/v1/attention.proto"


def generate_stubs(out_dir, proto_root=PROTO_ROOT):
    """Writes attention/v1/attention_pb2{,_grpc}.py under out_dir.

    Uses protoc itself rather than grpc_tools.protoc: Debian's grpc_tools
    bundles a protoc too old for the `optional` field the proto declares.
    """
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc is None or plugin is None:
        raise RuntimeError("generating the gRPC stubs needs protoc and grpc_python_plugin "
                           "(Debian: protobuf-compiler protobuf-compiler-grpc)")
    os.makedirs(out_dir, exist_ok=True)
    subprocess.run([protoc, f"-I{proto_root}", f"--python_out={out_dir}", f"--grpc_out={out_dir}",
                    f"--plugin=protoc-gen-grpc={plugin}", PROTO_FILE], check=True)


def _load_stubs():
    """Imports the stubs from $ATTENTION_PY_STUBS (generating them there if
    missing), or from a fresh temporary directory."""
    out_dir = os.environ.get("ATTENTION_PY_STUBS")
    if not out_dir:
        out_dir = tempfile.mkdtemp(prefix="attention-stubs-")
        atexit.register(shutil.rmtree, out_dir, ignore_errors=True)
    if not os.path.exists(os.path.join(out_dir, "attention", "v1", "attention_pb2_grpc.py")):
        generate_stubs(out_dir)
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)
    from attention.v1 import attention_pb2, attention_pb2_grpc  # noqa: E402 (generated)
    return attention_pb2, attention_pb2_grpc


pb2, pb2_grpc = _load_stubs()


class AttendResult(NamedTuple):
    output: np.ndarray                        # (B, n_q, d_v), or (B, n_q, E) for multi_head
    attention_weights: Optional[np.ndarray]   # (B, n_q, n_k) / (B, H, n_q, n_k), when asked


def to_tensor(array, name="tensor"):
    """A numpy array (any real dtype) as a float32 attention.v1.Tensor."""
    array = np.asarray(array, dtype=np.float32)
    if array.ndim != 3:
        raise ValueError(f"{name} must have 3 dimensions (B, n, d); got shape {array.shape}")
    return pb2.Tensor(shape=list(array.shape), data=array.ravel().tolist())


def from_tensor(tensor):
    """An attention.v1.Tensor as a float32 numpy array of its shape."""
    return np.asarray(tensor.data, dtype=np.float32).reshape(tuple(tensor.shape))


def _service_config(max_attempts):
    """round_robin over every address, and retries with backoff on UNAVAILABLE."""
    config = {"loadBalancingConfig": [{"round_robin": {}}]}
    if max_attempts > 1:
        config["methodConfig"] = [{
            "name": [{"service": "attention.v1.AttentionService"}],
            "retryPolicy": {"maxAttempts": max_attempts, "initialBackoff": "0.05s",
                            "maxBackoff": "1s", "backoffMultiplier": 2,
                            "retryableStatusCodes": ["UNAVAILABLE"]}}]
    return json.dumps(config)


def _channel_target(target):
    """A comma-separated list of IPv4 HOST:PORT becomes one ipv4: target, so the
    channel balances over all of them; anything else goes to gRPC as is."""
    entries = [t.strip() for t in target.split(",")]
    return "ipv4:" + ",".join(entries) if len(entries) > 1 else target


class AttentionClient:
    """One channel to one or more servers; calls are thread-safe.

    target: "HOST:PORT", or several comma-separated (IPv4 literals), balanced
      round-robin. timeout: seconds per call. token: sent as
      `authorization: Bearer <token>`. root_certificates (PEM bytes) or
      tls=True: use TLS; certificate_chain/private_key: mutual TLS.
    """

    def __init__(self, target="127.0.0.1:50051", *, timeout=30.0, token=None, tls=False,
                 root_certificates=None, certificate_chain=None, private_key=None,
                 max_attempts=4):
        options = [("grpc.service_config", _service_config(max_attempts)),
                   ("grpc.max_receive_message_length", -1),
                   # Requests up to 64 MiB stay retryable (gRPC's default: 256 KiB).
                   ("grpc.per_rpc_retry_buffer_size", 64 << 20)]
        if tls or root_certificates or certificate_chain:
            credentials = grpc.ssl_channel_credentials(root_certificates, private_key,
                                                       certificate_chain)
            self._channel = grpc.secure_channel(_channel_target(target), credentials, options)
        else:
            self._channel = grpc.insecure_channel(_channel_target(target), options)
        self._stub = pb2_grpc.AttentionServiceStub(self._channel)
        self._timeout = timeout
        self._metadata = [("authorization", f"Bearer {token}")] if token else []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._channel.close()

    def list_models(self):
        """The served models, as a list of attention.v1.ModelInfo."""
        response = self._stub.ListModels(pb2.ListModelsRequest(), timeout=self._timeout,
                                         metadata=self._metadata)
        return list(response.models)

    def attend(self, queries, keys=None, values=None, *, model="dot_product", valid_lens=None,
               causal=False, scale=None, return_attention_weights=False, request_id=""):
        """Runs `model` on numpy inputs: queries (B, n_q, d_q), keys (B, n_k, d_k),
        values (B, n_k, d_v); keys omitted = queries, values omitted = keys.
        valid_lens: None, B values, or (B, n_q) values (one per query)."""
        request = pb2.AttendRequest(model=model, queries=to_tensor(queries, "queries"),
                                    causal=causal,
                                    return_attention_weights=return_attention_weights,
                                    request_id=request_id)
        if keys is not None:
            request.keys.CopyFrom(to_tensor(keys, "keys"))
        if values is not None:
            request.values.CopyFrom(to_tensor(values, "values"))
        if valid_lens is not None:
            request.valid_lens.extend(int(v) for v in np.asarray(valid_lens).ravel())
        if scale is not None:
            request.scale = scale
        response = self._stub.Attend(request, timeout=self._timeout, metadata=self._metadata)
        weights = from_tensor(response.attention_weights) if return_attention_weights else None
        return AttendResult(from_tensor(response.output), weights)


def attend(queries, keys=None, values=None, *, target="127.0.0.1:50051", **kwargs):
    """One call with a client made for it: AttentionClient(target).attend(...)."""
    with AttentionClient(target) as client:
        return client.attend(queries, keys, values, **kwargs)
