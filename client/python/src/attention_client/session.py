"""Session: one decoding session over an AttendSession stream (docs/api.md
section 11): opened once, then stepped with the new rows only; the server
keeps the keys and values. A step's request carries the rows' memory as it
is and its answer's output is a view of the received bytes (wire.py).

A session lives in one server process, so a replica that restarts or dies
takes it along. The session therefore keeps what it sent (the opening, and
for self memory every step's rows), and when its stream breaks it opens a
new stream through the same channel, replays the rows as one prefill step
(self memory equals causal attention on the whole prefix, so the state is
the same) and sends the broken step again (docs/api.md section 11.6).
"""

import queue
import time
from typing import NamedTuple, Optional

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from . import wire
from .errors import AttendError, SessionLost, status_error

# SessionRequest: open = 1, step = 2; SessionStep: queries = 1,
# return_attention_weights = 2, keys = 3, values = 4; SessionResponse:
# output = 1, attention_weights = 2.
_OPEN, _STEP = 1, 2
_STEP_QUERIES, _STEP_KEYS, _STEP_VALUES = 1, 3, 4
_OUTPUT, _WEIGHTS = 1, 2
# SessionMemory by the name session() takes.
MEMORY = {"self": 0, "cross": 1}
# What a session keeps for a replay unless told otherwise.
REPLAY_LIMIT_BYTES = 64 << 20
# How a stream ends when its server went away: UNAVAILABLE (a connection
# lost, a replica's shutdown: section 6.5 and 11.5), CANCELLED (a stream
# reset by a proxy or a server that stopped without gRPC's shutdown),
# UNKNOWN (a stream a proxy ended without its status: attention-server never
# answers UNKNOWN).
_BREAKS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
# The pauses between tries, at opening the stream again here and at resending
# a cut-off Attend (client.py), as the channel's own retry policy waits: from
# 50 ms, doubling, at most 1 s.
RETRY_BACKOFF_SECONDS = (0.05, 1.0)


class StepResult(NamedTuple):
    output: np.ndarray                       # (B, n_new, d_v), (B, n_new, E) or (B, n_new, H, d_v)
    attention_weights: Optional[np.ndarray]  # (B, [H,] n_new, length), when asked
    length: int                              # tokens the session holds after the step


class _Rows:
    """A self session's rows so far, (B, n, d) or (B, n, H, d) float32, in one
    buffer that grows by doubling along n, so a step costs one copy of its
    rows and the replay's prefill is a slice."""

    def __init__(self):
        self.buffer = None
        self.count = 0

    def nbytes(self, extra=None):
        """Bytes of the rows kept, and of `extra` rows appended."""
        rows = self.count + (extra.shape[1] if extra is not None else 0)
        sample = self.buffer if self.buffer is not None else extra
        if sample is None:
            return 0
        return rows * sample.shape[0] * int(np.prod(sample.shape[2:])) * 4

    def append(self, rows):
        need = self.count + rows.shape[1]
        if self.buffer is None or need > self.buffer.shape[1]:
            grown = np.empty((rows.shape[0], max(need, 2 * self.count)) + rows.shape[2:],
                             dtype=wire.FLOAT32)
            if self.buffer is not None:
                grown[:, :self.count] = self.buffer[:, :self.count]
            self.buffer = grown
        self.buffer[:, self.count:need] = rows
        self.count = need

    def all(self):
        return np.ascontiguousarray(self.buffer[:, :self.count])


class Session:
    """A decoding session; made by AttentionClient.session(). Steps go one
    at a time (each waits for its answer); use it from one thread.

    step(rows, keys=None, values=None): self memory: rows (B, n_new, d_q) are
      the new tokens, appended and attended causally; cross memory: the
      step's queries. A dot_product self session over grouped heads takes
      4-D rows (B, n_new, H, d) and the step's own keys (B, n_new, H_kv, d)
      and values (B, n_new, H_kv, d_v), appended instead of the rows.
      Returns a StepResult; raises AttendError for a step the server refused
      (the session is as before it and can go on). When the stream breaks
      (UNAVAILABLE, CANCELLED, UNKNOWN) the session is replayed on a new stream and
      the step sent again (`replays` counts them); without replay, or when
      it cannot be done, SessionLost (replay on, its reason in .details())
      or the stream's grpc.RpcError (replay off).
    close(): ends the session (also on leaving a `with` block).
    """

    def __init__(self, call, pb2, open_request, *, timeout, metadata, memory="self",
                 replay=True, replay_limit_bytes=REPLAY_LIMIT_BYTES, reopen_timeout=30.0):
        self._call = call
        self._pb2 = pb2
        self._metadata = metadata
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._open_request = open_request if replay else None
        self._replay = replay
        self._replay_limit_bytes = replay_limit_bytes
        self._reopen_timeout = reopen_timeout
        # Cross memory is all in the opening: steps change nothing to replay.
        self._rows = _Rows() if memory == "self" and replay else None
        # A self session's steps' own keys and values, when they carry them:
        # the replay's prefill carries them too.
        self._keys, self._values = _Rows(), _Rows()
        self._unreplayable = None  # why a break can no longer be replayed
        self._forget_past(len(open_request))
        self.replays = 0
        self._closed = False
        self._start()
        opened = self._exchange(open_request)
        if isinstance(opened, AttendError):
            self.close()
            raise opened
        self._opened(opened)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def step(self, rows, *, keys=None, values=None, return_attention_weights=False):
        array = _step_array(rows, "rows")
        own = [None if given is None else _step_array(given, name)
               for name, given in (("keys", keys), ("values", values))]
        answer = self._send(_step_request(array, return_attention_weights, *own))
        if isinstance(answer, AttendError):
            raise answer
        header, view, tensors = answer
        self.length = header.length
        if self._rows is not None and self._unreplayable is None:
            self._keep_for_replay(array, *own)
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
        self._end_call()

    def _start(self):
        """Opens a new AttendSession call; the requests go through a queue."""
        timeout = None if self._deadline is None else max(self._deadline - time.monotonic(), 0)
        self._requests = queue.SimpleQueue()
        self._responses = self._call(iter(self._requests.get, None), timeout=timeout,
                                     metadata=self._metadata)

    def _end_call(self):
        self._requests.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:  # the stream had failed already; step() said so
            pass

    def _opened(self, answer):
        header, _, _ = answer
        self.session_id = header.session_id
        self.model = header.model
        self.model_version = header.model_version
        self.length = header.length

    def _keep_for_replay(self, rows, keys, values):
        """Appends a step's rows (and its own keys and values) to what the
        replay's prefill sends. A prefill is one step, so steps that differ
        in which of keys and values they carry cannot be replayed as one."""
        kept = [(self._rows, rows), (self._keys, keys), (self._values, values)]
        if self._rows.count and any((part is None) != (store.count == 0)
                                    for store, part in kept[1:]):
            self._forget_past(None, "its steps differ in whether they carry keys and values")
            return
        self._forget_past(len(self._open_request) +
                          sum(store.nbytes(part) for store, part in kept))
        if self._unreplayable is None:
            for store, part in kept:
                if part is not None:
                    store.append(part)

    def _forget_past(self, nbytes, reason=None):
        """Drops what the session keeps for a replay once it needs `nbytes`,
        more than the limit, or for `reason`: a later break then fails, saying
        why."""
        if reason is None and self._replay and nbytes > self._replay_limit_bytes:
            reason = (f"its opening and rows take {nbytes} bytes, more than "
                      f"replay_limit_bytes={self._replay_limit_bytes}")
        if reason is not None:
            self._unreplayable = reason
            if self._rows is not None:
                self._rows = _Rows()
            self._keys, self._values = _Rows(), _Rows()

    def _send(self, request):
        """Sends one message; its answer as (header, bytes, tensors), or the
        AttendError it carries. A broken stream is replayed, then `request`
        sent again; the new stream may break too before it is answered (a
        server short of session memory preempts the session again), and is
        replayed again, until reopen_timeout after the first break."""
        if self._closed:
            raise ValueError("the session is closed")
        give_up = None
        while True:
            try:
                return self._exchange(request)
            except AttendError:
                raise
            except grpc.RpcError as error:
                if error.code() not in _BREAKS or not self._replay:
                    raise
                if give_up is None:
                    give_up = time.monotonic() + self._reopen_timeout
                elif time.monotonic() > give_up:
                    self._closed = True
                    self._responses.cancel()
                    raise SessionLost(error.code(), f"the session's stream broke again and again "
                                                    f"for {self._reopen_timeout} s, the last: "
                                                    f"{error.code().name}: {error.details()}"
                                      ) from error
                self._replay_on_new_stream(error)

    def _replay_on_new_stream(self, error):
        """After `error` broke the stream: a new stream holding the session as
        it was, or SessionLost."""
        self._responses.cancel()
        self._requests.put(None)
        broke = f"the session's stream broke ({error.code().name}: {error.details()})"
        if self._unreplayable is not None:
            self._closed = True
            raise SessionLost(error.code(), f"{broke} and cannot be replayed: "
                                            f"{self._unreplayable}") from error
        length = self.length
        # A target that is restarting fails the tries (UNAVAILABLE) until the
        # channel connects again.
        give_up = time.monotonic() + self._reopen_timeout
        backoff, tries = RETRY_BACKOFF_SECONDS[0], 0
        while True:
            tries += 1
            try:
                self._start()
                opened = self._exchange(self._open_request)
                refused = opened if isinstance(opened, AttendError) else None
                if refused is None and self._rows is not None and self._rows.count:
                    prefill = self._exchange(_step_request(
                        self._rows.all(), False,
                        *(store.all() if store.count else None
                          for store in (self._keys, self._values))))
                    refused = prefill if isinstance(prefill, AttendError) else None
                if refused is not None:
                    if refused.code() in _BREAKS:  # a server draining: another may take it
                        raise refused
                    self._closed = True
                    self._end_call()
                    raise SessionLost(refused.code(), f"{broke}; replaying it on a new stream "
                                                      f"was refused: {refused.details()}")
                self._opened(opened)
                self.length = length
                self.replays += 1
                return
            except grpc.RpcError as again:
                if isinstance(again, SessionLost) or again.code() not in _BREAKS:
                    raise
                self._responses.cancel()  # a stream that broke too, or a refusal in place
                self._requests.put(None)
                last = f"{again.code().name}: {again.details()}"
            if time.monotonic() + backoff > give_up:
                break
            time.sleep(backoff)
            backoff = min(2 * backoff, RETRY_BACKOFF_SECONDS[1])
        self._closed = True
        raise SessionLost(error.code(), f"{broke}; {tries} tries at opening it again in "
                                        f"{self._reopen_timeout} s failed, the last: {last}"
                                        ) from error

    def _exchange(self, request):
        """Sends one message on the current stream; its answer as (header,
        bytes, tensors), or the AttendError it carries."""
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


def _step_array(array, name):
    """A step's tensor as C-contiguous float32, (B, n_new, ...): the server
    names a rank its model does not take."""
    array = np.ascontiguousarray(array, dtype=wire.FLOAT32)
    if array.ndim < 2:
        raise ValueError(f"{name} must have the dimensions (B, n_new, d) or (B, n_new, H, d); "
                         f"got shape {array.shape}")
    return array


def _step_request(array, return_attention_weights, keys=None, values=None):
    """A SessionRequest's bytes stepping with `array` (float32, C-contiguous)
    and the step's own keys and values when given."""
    step = wire.tensor_parts(_STEP_QUERIES, array)
    for number, tensor in ((_STEP_KEYS, keys), (_STEP_VALUES, values)):
        if tensor is not None:
            step += wire.tensor_parts(number, tensor)
    if return_attention_weights:
        step.insert(0, b"\x10\x01")  # field 2, true
    return b"".join(wire.message_field(_STEP, step))


def open_request(header, tensors):
    """A SessionRequest's bytes opening a session: `header` (a SessionOpen
    without its tensors) and `tensors`, each the parts wire.tensor_parts made."""
    parts = [header.SerializeToString()] + [part for tensor in tensors for part in tensor]
    return b"".join(wire.message_field(_OPEN, parts))
