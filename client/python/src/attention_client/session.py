"""Session: one decoding session over an AttendSession stream (docs/api.md
section 11): opened once, then stepped with the new rows only; the server
keeps the keys and values. A step's request carries the rows' memory as it
is and its answer's output is a view of the received bytes (wire.py).
"""

import queue
from typing import NamedTuple, Optional

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from . import wire
from .errors import AttendError, status_error

# SessionRequest: open = 1, step = 2; SessionStep: queries = 1,
# return_attention_weights = 2; SessionResponse: output = 1, attention_weights = 2.
_OPEN, _STEP = 1, 2
_STEP_QUERIES = 1
_OUTPUT, _WEIGHTS = 1, 2
# SessionMemory by the name session() takes.
MEMORY = {"self": 0, "cross": 1}


class StepResult(NamedTuple):
    output: np.ndarray                       # (B, n_new, d_v), or (B, n_new, E)
    attention_weights: Optional[np.ndarray]  # (B, [H,] n_new, length), when asked
    length: int                              # tokens the session holds after the step


class Session:
    """A decoding session; made by AttentionClient.session(). Steps go one
    at a time (each waits for its answer); use it from one thread.

    step(rows): self memory: rows (B, n_new, d_q) are the new tokens,
      appended and attended causally; cross memory: the step's queries.
      Returns a StepResult; raises AttendError for a step the server refused
      (the session is as before it and can go on), grpc.RpcError when the
      stream itself ends (e.g. UNAVAILABLE at a server's shutdown).
    close(): ends the session (also on leaving a `with` block).
    """

    def __init__(self, call, pb2, open_request, *, timeout, metadata):
        self._pb2 = pb2
        self._requests = queue.SimpleQueue()
        self._responses = call(iter(self._requests.get, None), timeout=timeout,
                               metadata=metadata)
        self._closed = False
        opened = self._send(open_request)
        if isinstance(opened, AttendError):
            self.close()
            raise opened
        header, _, _ = opened
        self.session_id = header.session_id
        self.model = header.model
        self.model_version = header.model_version
        self.length = header.length

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def step(self, rows, *, return_attention_weights=False):
        array = np.ascontiguousarray(rows, dtype=wire.FLOAT32)
        if array.ndim != 3:
            raise ValueError(f"rows must have 3 dimensions (B, n_new, d); got shape {array.shape}")
        step = wire.tensor_parts(_STEP_QUERIES, array)
        if return_attention_weights:
            step.insert(0, b"\x10\x01")  # field 2, true
        answer = self._send(b"".join(wire.message_field(_STEP, step)))
        if isinstance(answer, AttendError):
            raise answer
        header, view, tensors = answer
        self.length = header.length
        weights = tensors[_WEIGHTS]
        return StepResult(
            wire.tensor_array(view, tensors[_OUTPUT], "SessionResponse.output"),
            wire.tensor_array(view, weights, "SessionResponse.attention_weights")
            if weights else None,
            header.length)

    def close(self):
        """Ends the session: the server frees its keys and values."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:  # the stream had failed already; step() said so
            pass

    def _send(self, request):
        """Sends one message; its answer as (header, bytes, tensors), or the
        AttendError it carries."""
        if self._closed:
            raise ValueError("the session is closed")
        self._requests.put(request)
        try:
            data = next(self._responses)
        except StopIteration:
            raise AttendError(grpc.StatusCode.INTERNAL,
                              "AttendSession: the stream ended without an answer") from None
        view = memoryview(data)
        try:
            tensors, rest = wire.split_message(view, (_OUTPUT, _WEIGHTS), "SessionResponse")
            header = self._pb2.SessionResponse.FromString(rest)
        except (wire.WireError, DecodeError) as error:
            raise AttendError(grpc.StatusCode.INTERNAL,
                              f"the server's answer is not a valid SessionResponse: {error}"
                              ) from None
        if header.HasField("error"):
            self.length = header.length
            return status_error(header.error.code, header.error.message, header.request_id)
        return header, view, tensors


def open_request(header, tensors):
    """A SessionRequest's bytes opening a session: `header` (a SessionOpen
    without its tensors) and `tensors`, each the parts wire.tensor_parts made."""
    parts = [header.SerializeToString()] + [part for tensor in tensors for part in tensor]
    return b"".join(wire.message_field(_OPEN, parts))
