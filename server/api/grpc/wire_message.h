// wire_message.h: requests and answers as the bytes gRPC carries, parsed and
// written by the APIs themselves.
//
// Every method of both gRPC services is registered raw (its messages are
// grpc::ByteBuffers) so that a request whose bytes do not parse is answered
// INVALID_ARGUMENT naming the message type expected, in a stream in place of
// that request's answer, where gRPC's own parsing would answer UNIMPLEMENTED
// with no message, as if the method did not exist. Parsing and writing are
// gRPC's own (its zero-copy reader over the received slices, its writer), so
// no copy is added.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "server/api/attention/attention_adapter.h"
#include "server/api/grpc/wire_fault.h"

namespace attention::server {

// Parses `wire` into `message` and empties `wire`, so the received bytes are
// freed as soon as they are parsed. On failure `message` is left empty and
// the error is INVALID_ARGUMENT naming the message type and, where it can
// be found, the field whose bytes are broken (wire_fault.h).
template <typename Message>
absl::Status ParseWire(grpc::ByteBuffer* wire, Message* message) {
  bool parsed = false;
  {
    // What gRPC's own deserializer does, but the bytes stay until the
    // diagnosis below has read them.
    grpc::ProtoBufferReader reader(wire);
    parsed = reader.status().ok() && message->ParseFromZeroCopyStream(&reader);
  }
  const std::string fault = parsed ? "" : FindWireFault(*Message::descriptor(), *wire);
  wire->Clear();
  if (parsed) return absl::OkStatus();
  message->Clear();
  return absl::InvalidArgumentError(
      absl::StrCat("the request's bytes are not a valid ", Message::descriptor()->full_name(),
                   " message (protobuf wire format)", fault.empty() ? "" : ": ", fault));
}

// A unary handler's request: gRPC owns it for the call and hands it out as
// const, but nothing reads it after it is parsed, and parsing empties it.
template <typename Message>
absl::Status ParseWire(const grpc::ByteBuffer* wire, Message* message) {
  return ParseWire(const_cast<grpc::ByteBuffer*>(wire), message);
}

// Writes `message` into `wire`.
template <typename Message>
void WriteWire(const Message& message, grpc::ByteBuffer* wire) {
  bool own_buffer = false;
  grpc::SerializationTraits<Message>::Serialize(message, wire, &own_buffer);
}

}  // namespace attention::server
