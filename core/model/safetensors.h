// safetensors.h: a strict reader for the safetensors tensor file format.
//
// A safetensors file is, in order: a u64 little-endian header length N; N
// bytes of UTF-8 JSON, an object mapping each tensor name to
// {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]} plus an
// optional "__metadata__" object of string values; then the data section,
// where each tensor is little-endian, row-major and contiguous at
// [begin, end) (offsets relative to the start of the data section).
//
// Model files come from outside the server, so every byte is checked before it
// is trusted: a file that is truncated, whose header is not the expected JSON,
// whose shapes overflow, whose offsets fall outside the data, overlap, leave
// gaps, or disagree with shape × dtype size is an INVALID_ARGUMENT status
// naming the tensor and the fault, never a crash. As in the reference
// implementation, the tensors must tile the data section exactly; unknown
// fields inside a tensor entry are ignored. Duplicate JSON keys are an error
// (otherwise one of two tensors of the same name would be silently dropped).
//
// Only the floating-point dtypes an attention model needs are read: F32, F16
// (IEEE binary16) and BF16, all widened to float32 exactly (F16 subnormals,
// infinities and NaNs included).
//
// Usage:
//   absl::StatusOr<SafetensorsFile> file = ParseSafetensors(bytes);
//   if (!file.ok()) return file.status();
//   const Tensor& w = file->tensors.at("W_q.weight");
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "core/tensor.h"

namespace attention {

struct SafetensorsFile {
  // The header's "__metadata__" (empty when the file has none).
  std::map<std::string, std::string> metadata;
  // Every tensor of the file by name, converted to float32.
  std::map<std::string, Tensor> tensors;
};

// Parses the bytes of a whole safetensors file. Error messages name the fault
// but not the file; callers add the file name.
absl::StatusOr<SafetensorsFile> ParseSafetensors(std::span<const uint8_t> bytes);

}  // namespace attention
