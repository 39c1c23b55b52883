// wire_fault.h: where a message's bytes stop being protobuf, named as a field
// path, so that the error for a request that does not parse says which
// tensor or field is broken (e.g. a packed `data` whose length is not a
// whole number of float32 values) instead of only which message it is.
//
// Only the failure path runs it: it walks the bytes once more, following the
// message's descriptor, without copying them.
#pragma once

#include <string>

#include "google/protobuf/descriptor.h"
#include "grpcpp/grpcpp.h"

namespace attention::server {

// "queries.data: 4003 bytes of packed float32 values, not a multiple of 4",
// or "" when the walk finds no fault (the bytes parse as far as it checks).
std::string FindWireFault(const google::protobuf::Descriptor& type, const grpc::ByteBuffer& bytes);

}  // namespace attention::server
