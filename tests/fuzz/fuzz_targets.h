// fuzz_targets.h: the bodies of the fuzz targets, shared by the libFuzzer
// binaries (tests/fuzz/*_fuzzer.cc, clang only) and by fuzz_regression_test,
// which replays the committed seeds and every input that once crashed a
// target through the same code in the ordinary build.
//
// A target returns normally on any input the code under test handles as
// docs/api.md says (an answer, or an error status with the right code); on
// anything else it prints what broke and aborts, which libFuzzer reports as a
// crash and the regression test as a failed death-free run.
#pragma once

#include <cstdint>
#include <span>

namespace attention::fuzz {

// Bytes as a safetensors model file: ParseModel must return a model or
// INVALID_ARGUMENT; a model it returns must then answer a small request.
void FuzzModelFile(std::span<const uint8_t> bytes);

enum class RequestEncoding { kBinaryProto, kProtoJson };

// Bytes as an AttendRequest (binary protobuf or proto3 JSON), converted by the
// server's proto adapter, validated against tiny models of every kind and run
// by the engine when valid: the answer must have the validated shape and
// equal the answer the same request gets when batched with another one.
void FuzzAttendRequest(std::span<const uint8_t> bytes, RequestEncoding encoding);

}  // namespace attention::fuzz
