// errors.js: the errors the client makes itself, shaped like grpc-js's call
// errors (.code is the gRPC status code, .details the message): a refused
// request or session step answered in place (AttendError), and a session
// that could not be replayed after its stream broke (SessionLost).
'use strict';

const grpc = require('@grpc/grpc-js');

// Why one request of an AttendStream call (or one message of a session)
// failed, as the server answered it (the stream went on).
class AttendError extends Error {
  constructor(code, details, requestId = '') {
    super(`${code} ${grpc.status[code]}: ${details}`);
    this.name = 'AttendError';
    this.code = code;
    this.details = details;
    this.request_id = requestId;
  }
}

// A session whose stream broke and that could not be replayed on a new
// stream: .code is the break's (e.g. UNAVAILABLE), .details says why (replay
// off, its rows past replayLimitBytes, the reopening refused or unreachable).
// The session is unusable after it.
class SessionLost extends Error {
  constructor(code, details) {
    super(`${code} ${grpc.status[code]}: ${details}`);
    this.name = 'SessionLost';
    this.code = code;
    this.details = details;
  }
}

// A response's AttendError as an AttendError. A code that is not an error
// code (0, or beyond the known ones) is still an error: UNKNOWN, naming it.
function streamError(response) {
  const { code = 0, message = '' } = response.error;
  if (code <= grpc.status.OK || code > grpc.status.UNAUTHENTICATED) {
    return new AttendError(grpc.status.UNKNOWN,
      `the server answered with error code ${code}: ${message}`, response.request_id);
  }
  return new AttendError(code, message, response.request_id);
}

module.exports = { AttendError, SessionLost, streamError };
