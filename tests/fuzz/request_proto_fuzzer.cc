// request_proto_fuzzer.cc: libFuzzer entry for FuzzAttendRequest on binary
// protobuf, the bytes gRPC hands the server.
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attention::fuzz::FuzzAttendRequest({data, size}, attention::fuzz::RequestEncoding::kBinaryProto);
  return 0;
}
