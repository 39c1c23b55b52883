"""AttendError: one refused request of a stream, or one refused session
step, as the server answered it in place."""

import grpc

_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class AttendError(grpc.RpcError):
    """Why one request of an AttendStream call (or one message of a session)
    failed, as the server answered it (the stream went on). Like the
    grpc.RpcError a failed attend raises: .code() is a grpc.StatusCode,
    .details() the server's message."""

    def __init__(self, code, details, request_id=""):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        self.request_id = request_id

    def code(self):
        return self._code

    def details(self):
        return self._details


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
