// request_json_fuzzer.cc: libFuzzer entry for FuzzAttendRequest on proto3
// JSON, what `attention-client attend` reads.
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attention::fuzz::FuzzAttendRequest({data, size}, attention::fuzz::RequestEncoding::kProtoJson);
  return 0;
}
