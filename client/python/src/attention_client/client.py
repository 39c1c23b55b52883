"""The client: AttentionClient, its results and errors (see __init__.py).

Attend and AttendStream carry bytes that wire.py writes and reads, so a
tensor goes from numpy memory to the wire and back without a Python float
per value; the wire is exactly what the generated classes would write
(docs/api.md, "Tensors from memory"). ListModels uses the generated stub.
"""

import json
import random
import time
from typing import NamedTuple, Optional

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from . import session as session_module
from . import wire
from .errors import AttendError, status_error

try:
    from . import attention_pb2 as pb2
    from . import attention_pb2_grpc as pb2_grpc
except ModuleNotFoundError as error:  # a source tree, where the stubs were never built
    raise ImportError(
        "attention_client: the generated stubs (attention_pb2) are missing; they are "
        "made when the package is built: pip install client/python") from error

_SERVICE = "/attention.v1.AttentionService/"
# AttendRequest's tensor fields, and AttendResponse's.
_REQUEST_TENSORS = (("queries", 2), ("keys", 3), ("values", 4))
_OUTPUT, _WEIGHTS = 1, 2


class AttendResult(NamedTuple):
    # (B, n_q, d_v); (B, n_q, E) for multi_head; (B, n_q, H, d_v) for 4-D dot_product
    output: np.ndarray
    # (B, n_q, n_k) / (B, H, n_q, n_k), when asked
    attention_weights: Optional[np.ndarray]


def _float32(array, name):
    """`array` (any real dtype, any layout) as C-contiguous little-endian
    float32: the array itself when it already is one. Any rank goes: the
    server says which ranks the model takes (3, or 4 for dot_product's
    grouped heads), naming the tensor."""
    if np.ndim(array) == 0:  # ascontiguousarray would make it 1-D
        raise ValueError(f"{name} must be an array (B, n, d) or (B, n, H, d); got a scalar")
    return np.ascontiguousarray(array, dtype=wire.FLOAT32)


def to_tensor(array, name="tensor"):
    """A numpy array (any real dtype) as a float32 attention.v1.Tensor."""
    parts = wire.tensor_parts(1, _float32(array, name))
    return pb2.Tensor.FromString(b"".join(parts[2:]))  # the field's body: the Tensor itself


def from_tensor(tensor):
    """An attention.v1.Tensor as a float32 numpy array of its shape."""
    encoded = memoryview(tensor.SerializeToString())
    return wire.tensor_array(encoded, [(0, len(encoded))], "Tensor")


# grpc.health.v1.HealthCheckResponse.ServingStatus.
_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _stream_error(response):
    """A response's AttendError as an AttendError."""
    return status_error(response.error.code, response.error.message, response.request_id)


def _answer(data):
    """One AttendResponse's bytes as an AttendResult, or as the AttendError it
    carries. The arrays are read-only views of `data`."""
    view = memoryview(data)
    try:
        tensors, rest = wire.split_message(view, (_OUTPUT, _WEIGHTS), "AttendResponse")
        header = pb2.AttendResponse.FromString(rest)
        if header.HasField("error"):
            return _stream_error(header)
        if not tensors[_OUTPUT]:
            raise wire.WireError("AttendResponse.output: absent, in an answer without error")
        weights = tensors[_WEIGHTS]
        return AttendResult(
            wire.tensor_array(view, tensors[_OUTPUT], "AttendResponse.output"),
            wire.tensor_array(view, weights, "AttendResponse.attention_weights")
            if weights else None)
    except (wire.WireError, DecodeError) as error:
        raise AttendError(grpc.StatusCode.INTERNAL,
                          f"the server's answer is not a valid AttendResponse: {error}") from None


def _service_config(max_attempts):
    """round_robin over every address, and retries with backoff on UNAVAILABLE,
    except for AttendStream: gRPC replaying a stream loses or duplicates
    requests, so a stream is never retried (its own, more specific entry, with
    no retry policy, wins over the service's)."""
    config = {"loadBalancingConfig": [{"round_robin": {}}]}
    if max_attempts > 1:
        config["methodConfig"] = [
            {"name": [{"service": "attention.v1.AttentionService", "method": "AttendStream"},
                      {"service": "attention.v1.AttentionService", "method": "AttendSession"}]},
            {"name": [{"service": "attention.v1.AttentionService"}],
             "retryPolicy": {"maxAttempts": max_attempts, "initialBackoff": "0.05s",
                             "maxBackoff": "1s", "backoffMultiplier": 2,
                             "retryableStatusCodes": ["UNAVAILABLE"]}}]
    return json.dumps(config)


# An answer cut off on its way (a replica killed while the edge relayed it:
# the stream ends without its status) reaches gRPC as UNKNOWN, which
# attention-server itself never answers. gRPC's retry policy cannot resend it
# (the call is committed once headers arrived), so attend() does, with the
# policy's back-off (session.RETRY_BACKOFF_SECONDS), jittered.
_CUT_OFF = grpc.StatusCode.UNKNOWN


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
      max_attempts: tries of a unary call, again on UNAVAILABLE (gRPC's
      retry policy) and, for attend(), on an answer cut off on its way
      (UNKNOWN); 1 turns retries off.
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
        # Attend and AttendStream carry the bytes wire.py writes and reads.
        self._attend = self._channel.unary_unary(_SERVICE + "Attend")
        self._attend_stream = self._channel.stream_stream(_SERVICE + "AttendStream")
        self._attend_session = self._channel.stream_stream(_SERVICE + "AttendSession")
        self._timeout = timeout
        self._max_attempts = max_attempts
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

    def health(self, service=""):
        """The serving status of `service` ("": the whole server) from the
        standard grpc.health.v1 Check: "SERVING", "NOT_SERVING", "UNKNOWN"
        or "SERVICE_UNKNOWN"."""
        check = self._channel.unary_unary("/grpc.health.v1.Health/Check")
        name = service.encode()
        data = memoryview(check(b"\x0a" + wire.varint(len(name)) + name if name else b"",
                                timeout=self._timeout, metadata=self._metadata))
        status = 0
        for number, wire_type, value, _, _ in wire.fields(data, 0, len(data),
                                                          "HealthCheckResponse"):
            if number == 1 and wire_type == wire.VARINT:
                status = value
        return _HEALTH_STATUS.get(status, f"status {status}")

    def attend(self, queries, keys=None, values=None, *, model="dot_product", valid_lens=None,
               causal=False, scale=None, return_attention_weights=False, request_id="",
               version=None, position_ids=None, sliding_window=None, softcap=None):
        """Runs `model` on numpy inputs: queries (B, n_q, d_q), keys (B, n_k, d_k),
        values (B, n_k, d_v); keys omitted = queries, values omitted = keys.
        dot_product also takes grouped heads as 4-D arrays: queries (B, n_q, H, d),
        keys (B, n_k, H_kv, d), values (B, n_k, H_kv, d_v).
        valid_lens: None, B values, or (B, n_q) values (one per query).
        version: the model version to use; None: the newest ready one.
        position_ids: None (0..n_q-1), n_q values (every example) or (B, n_q)
          values: the queries' positions for a model with rotary positions or
          ALiBi (docs/api.md section 5.6).
        sliding_window, softcap: dot_product only; None or 0: none."""
        request = _request_bytes(queries, keys, values, model=model, valid_lens=valid_lens,
                                 causal=causal, scale=scale,
                                 return_attention_weights=return_attention_weights,
                                 request_id=request_id, version=version,
                                 position_ids=position_ids, sliding_window=sliding_window,
                                 softcap=softcap)
        answer = _answer(self._attend_resending_cut_offs(request))
        if isinstance(answer, AttendError):  # only streams carry errors in answers
            raise AttendError(grpc.StatusCode.INTERNAL,
                              f"Attend: the server answered with an error in the message: "
                              f"{answer}")
        return answer

    def _attend_resending_cut_offs(self, request):
        """One Attend, sent again while its answer is cut off (_CUT_OFF), up to
        max_attempts tries in all and within the call's timeout."""
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        backoff, most = session_module.RETRY_BACKOFF_SECONDS
        attempt = 1
        while True:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                return self._attend(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as error:
                pause = random.uniform(0.8, 1.2) * backoff
                if error.code() != _CUT_OFF or attempt >= self._max_attempts or (
                        deadline is not None and time.monotonic() + pause >= deadline):
                    raise
            time.sleep(pause)
            attempt += 1
            backoff = min(backoff * 2, most)

    def session(self, model, *, memory="self", batch=1, keys=None, values=None,
                valid_lens=None, scale=None, version=None, timeout=None, replay=True,
                replay_limit_bytes=session_module.REPLAY_LIMIT_BYTES, sliding_window=None,
                softcap=None):
        """Opens a decoding session of `model` (docs/api.md section 11) over one
        AttendSession stream and returns its Session, whose step(rows) sends
        only the new rows: the server keeps the keys and values.

        memory: "self" (multi_head, dot_product): every step's rows are
          appended and attended causally, `batch` examples side by side;
          "cross" (every kind): keys (B, n_k, d_k), values (omitted: keys) and
          valid_lens (None or B values) stay, and steps bring queries.
        scale: replaces the kind's default scale. version: None: the newest.
        sliding_window, softcap: a dot_product self session's, for every step.
        timeout: seconds for the whole session (default: no limit, since a
          session lives as long as its decoding).
        replay: when the stream breaks (UNAVAILABLE, CANCELLED, UNKNOWN: its server
          died or shut down), open the session again through this client's
          target, replay its rows as one prefill and resend the step
          (Session.replays counts it). The session keeps its opening and
          rows for that, up to replay_limit_bytes (default 64 MiB); past it
          they are dropped, and a later break raises SessionLost saying so.
        Raises AttendError when the server refuses to open it (its code:
        NOT_FOUND, INVALID_ARGUMENT, RESOURCE_EXHAUSTED naming the limit).
        """
        if memory not in session_module.MEMORY:
            raise ValueError(f"memory must be 'self' or 'cross'; got {memory!r}")
        header = _with_options(pb2.SessionOpen(model=model, memory=session_module.MEMORY[memory],
                                               batch=batch), valid_lens, scale, version)
        if sliding_window is not None:
            header.sliding_window = sliding_window
        if softcap is not None:
            header.softcap = softcap
        request = session_module.open_request(header, [
            wire.tensor_parts(number, _float32(array, name))
            for name, number, array in (("keys", 5, keys), ("values", 6, values))
            if array is not None])
        return session_module.Session(self._attend_session, pb2, request, timeout=timeout,
                                      metadata=self._metadata, memory=memory, replay=replay,
                                      replay_limit_bytes=replay_limit_bytes,
                                      reopen_timeout=self._timeout)

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
                    request = _request_bytes(**arguments)
                    sent += 1
                    yield request
            except Exception as error:  # raised to the caller once the others are answered
                # Raised inside gRPC's sending thread it would only cancel the
                # call as UNKNOWN; ending the requests here lets the ones
                # before it be answered.
                refused = error

        responses = self._attend_stream(
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
                yield _answer(response)
        finally:
            responses.cancel()  # no-op once the call has ended
        if refused is not None:
            raise refused
        if answered != sent:
            raise AttendError(grpc.StatusCode.INTERNAL,
                              f"AttendStream: the server answered {answered} of {sent} requests")


def _request_bytes(queries, keys=None, values=None, *, model="dot_product", valid_lens=None,
                   causal=False, scale=None, return_attention_weights=False, request_id="",
                   version=None, position_ids=None, sliding_window=None, softcap=None):
    """attend's arguments as the bytes of an attention.v1.AttendRequest: the
    small fields from the generated class, then the tensors from the arrays'
    memory (protobuf lets fields come in any order)."""
    if queries is None:
        raise ValueError("queries is required: an array (B, n_q, d_q)")
    request = _with_options(pb2.AttendRequest(model=model, causal=causal,
                                              return_attention_weights=return_attention_weights,
                                              request_id=request_id),
                            valid_lens, scale, version)
    if position_ids is not None:
        request.position_ids.extend(_integers(position_ids, "position_ids"))
    if sliding_window is not None:
        request.sliding_window = sliding_window
    if softcap is not None:
        request.softcap = softcap
    parts = [request.SerializeToString()]
    for (name, number), array in zip(_REQUEST_TENSORS, (queries, keys, values)):
        if array is not None:
            parts += wire.tensor_parts(number, _float32(array, name))
    return b"".join(parts)


def _integers(values, name):
    """`values` (a list or an integer array of any shape) as a flat list of
    ints; ValueError naming `name` for anything but whole numbers, which the
    wire's integers would otherwise truncate."""
    array = np.asarray(values)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{name} must be integers; got dtype {array.dtype}")
    return array.ravel().astype(np.int64).tolist()


def _with_options(request, valid_lens, scale, version):
    """`request` (an AttendRequest or a SessionOpen) with the optional fields
    both share set."""
    if valid_lens is not None:
        request.valid_lens.extend(np.asarray(valid_lens).ravel().astype(np.int64).tolist())
    if scale is not None:
        request.scale = scale
    if version is not None:
        request.version = version
    return request


def attend_request(queries, keys=None, values=None, **kwargs):
    """attend's arguments as an attention.v1.AttendRequest."""
    return pb2.AttendRequest.FromString(_request_bytes(queries, keys, values, **kwargs))


def attend(queries, keys=None, values=None, *, target="127.0.0.1:50051", **kwargs):
    """One call with a client made for it: AttentionClient(target).attend(...)."""
    with AttentionClient(target) as client:
        return client.attend(queries, keys, values, **kwargs)
