// attend_session.h: attention.v1's AttendSession stream, a thin adapter over
// the session table (sessions/session_table.h) and the dispatcher: its first
// message opens a session (Dispatcher::SubmitOpening()), each later one is a step submitted through
// Dispatcher::SubmitStep(), one at a time (step_chain.h), answered in order
// (ordered_stream.h) with the session's length; a failed message is answered
// with its error and the stream goes on. The stream's end ends the session.
#pragma once

#include "grpcpp/grpcpp.h"
#include "server/dispatch/dispatcher.h"
#include "server/sessions/session_table.h"

namespace attention::server {

// A new reactor for one AttendSession call; it deletes itself when done.
// Both are not owned and outlive the call.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* NewAttendSession(
    Dispatcher* dispatcher, SessionTable* sessions, grpc::CallbackServerContext* context);

}  // namespace attention::server
