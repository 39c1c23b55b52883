"""AttendError: one refused request of a stream, or one refused session
step, as the server answered it in place. SessionLost: a session whose
stream broke and that could not be opened again."""

import grpc

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _StatusError(grpc.RpcError):
    """A grpc.RpcError made by the client: like the one a failed call
    raises, .code() is a grpc.StatusCode and .details() the message."""

    def __init__(self, code, details):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self):
        return self._code

    def details(self):
        return self._details


class AttendError(_StatusError):
    """Why one request of an AttendStream call (or one message of a session)
    failed, as the server answered it (the stream went on); .details() is
    the server's message."""

    def __init__(self, code, details, request_id=""):
        super().__init__(code, details)
        self.request_id = request_id


class SessionLost(_StatusError):
    """A session's stream broke (.code(): the break's, e.g. UNAVAILABLE) and
    the session could not be replayed on a new stream; .details() says why
    (replay off, its rows past replay_limit_bytes, the reopening refused or
    unreachable). The session is unusable after it."""


def status_error(code, message, request_id=""):
    """An answer's error (code, message) as an AttendError. A code that is not
    an error code (0, or beyond the known ones) is still an error: UNKNOWN,
    naming it."""
    status = _STATUS_CODES.get(code)
    if status is None or status == grpc.StatusCode.OK:
        return AttendError(grpc.StatusCode.UNKNOWN,
                           f"the server answered with error code {code}: {message}",
                           request_id)
    return AttendError(status, message, request_id)
