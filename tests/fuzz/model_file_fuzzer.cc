// model_file_fuzzer.cc: libFuzzer entry for FuzzModelFile (safetensors loader).
#include <cstddef>
#include <cstdint>

#include "tests/fuzz/fuzz_targets.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attention::fuzz::FuzzModelFile({data, size});
  return 0;
}
