"""attention_client: call attention-server from Python, numpy arrays in and out.

    from attention_client import AttentionClient

    with AttentionClient("127.0.0.1:50051") as client:
        result = client.attend(queries, keys, values, model="dot_product",
                               valid_lens=[2, 6], return_attention_weights=True)
        result.output             # numpy float32, (B, n_q, d_v)
        result.attention_weights  # numpy float32, (B, n_q, n_k), or None

        # Many requests over one AttendStream call: one item per request, in order.
        for item in client.attend_stream([dict(queries=q1, model="dot_product"),
                                          dict(queries=q2, keys=k2, model="additive_toy")]):
            if isinstance(item, AttendError):   # this request failed; the others go on
                print(item.code(), item.details())
            else:
                print(item.output.shape)

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


class AttendError(grpc.RpcError):
    """Why one request of an AttendStream call failed, as the server answered it
    (the stream went on). Like the grpc.RpcError a failed attend raises:
    .code() is a grpc.StatusCode, .details() the server's message."""

    def __init__(self, code, details, request_id=""):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self.request_id = request_id

    def code(self):
        return self._code

    def details(self):
        return self._details


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _stream_error(response):
    """A response's AttendError as an AttendError. A code that is not an error
    code (0, or beyond the known ones) is still an error: UNKNOWN, naming it."""
    code, message = response.error.code, response.error.message
    status = _STATUS_CODES.get(code)
    if status is None or status == grpc.StatusCode.OK:
        return AttendError(grpc.StatusCode.UNKNOWN,
                           f"the server answered with error code {code}: {message}",
                           response.request_id)
    return AttendError(status, message, response.request_id)


def _service_config(max_attempts):
    """round_robin over every address, and retries with backoff on UNAVAILABLE,
    except for AttendStream: gRPC replaying a stream loses or duplicates
    requests, so a stream is never retried (its own, more specific entry, with
    no retry policy, wins over the service's)."""
    config = {"loadBalancingConfig": [{"round_robin": {}}]}
    if max_attempts > 1:
        config["methodConfig"] = [
            {"name": [{"service": "attention.v1.AttentionService", "method": "AttendStream"}]},
            {"name": [{"service": "attention.v1.AttentionService"}],
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
        request = attend_request(queries, keys, values, model=model, valid_lens=valid_lens,
                                 causal=causal, scale=scale,
                                 return_attention_weights=return_attention_weights,
                                 request_id=request_id)
        response = self._stub.Attend(request, timeout=self._timeout, metadata=self._metadata)
        weights = from_tensor(response.attention_weights) if return_attention_weights else None
        return AttendResult(from_tensor(response.output), weights)

    def attend_stream(self, requests, *, timeout=None):
        """Sends every request of `requests` over one AttendStream call and
        yields one item per request, in order, as the answers come.

        requests: an iterable (it may be lazy) of dicts of attend's arguments,
          e.g. dict(queries=q, keys=k, model="additive_toy", valid_lens=[2, 6]).
          Requests are sent while answers are read.
        Yields an AttendResult, or an AttendError (yielded, not raised) for a
          request the server refused; the stream goes on after it.
        timeout: seconds for the whole stream (default: the client's timeout).

        Raises grpc.RpcError when the call itself fails (UNAUTHENTICATED,
        DEADLINE_EXCEEDED, UNAVAILABLE...), after the items already answered;
        the error of a request that cannot be built (ValueError...) once the
        requests before it are answered; AttendError(INTERNAL) when the server
        answers more or fewer times than it was asked. A stream is never
        retried (see _service_config): resending is the caller's choice.
        Stopping the iteration early cancels the call.
        """
        sent = 0
        refused = None  # what stopped the requests from being built

        def wire_requests():
            nonlocal sent, refused
            try:
                for arguments in requests:
                    request = attend_request(**arguments)
                    sent += 1
                    yield request
            except Exception as error:  # raised to the caller once the others are answered
                # Raised inside gRPC's sending thread it would only cancel the
                # call as UNKNOWN; ending the requests here lets the ones
                # before it be answered.
                refused = error

        responses = self._stub.AttendStream(
            wire_requests(), timeout=self._timeout if timeout is None else timeout,
            metadata=self._metadata)
        answered = 0
        try:
            for response in responses:
                if answered >= sent:
                    raise AttendError(grpc.StatusCode.INTERNAL,
                                      f"AttendStream: the server sent answer {answered + 1} "
                                      f"with only {sent} requests sent")
                answered += 1
                if response.HasField("error"):
                    yield _stream_error(response)
                    continue
                weights = (from_tensor(response.attention_weights)
                           if response.HasField("attention_weights") else None)
                yield AttendResult(from_tensor(response.output), weights)
        finally:
            responses.cancel()  # no-op once the call has ended
        if refused is not None:
            raise refused
        if answered != sent:
            raise AttendError(grpc.StatusCode.INTERNAL,
                              f"AttendStream: the server answered {answered} of {sent} requests")


def attend_request(queries, keys=None, values=None, *, model="dot_product", valid_lens=None,
                   causal=False, scale=None, return_attention_weights=False, request_id=""):
    """attend's arguments as an attention.v1.AttendRequest."""
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
    return request


def attend(queries, keys=None, values=None, *, target="127.0.0.1:50051", **kwargs):
    """One call with a client made for it: AttentionClient(target).attend(...)."""
    with AttentionClient(target) as client:
        return client.attend(queries, keys, values, **kwargs)
