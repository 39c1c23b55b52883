// safetensors_builder.h: writes safetensors files in tests, valid or broken.
//
// Independent of core/model/safetensors.cc on purpose: the bytes are laid out here
// by hand (u64 little-endian header length, JSON header, data), so the parser
// is checked against the format, not against itself.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace attention::testing {

// One tensor to write: its dtype name, shape and raw little-endian bytes.
struct TensorBytes {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

inline void AppendLittleEndian(uint64_t value, int num_bytes, std::vector<uint8_t>& out) {
  for (int i = 0; i < num_bytes; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

inline TensorBytes F32Tensor(std::string name, std::vector<int64_t> shape, const std::vector<float>& values) {
  TensorBytes tensor{std::move(name), "F32", std::move(shape), {}};
  for (float value : values) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    AppendLittleEndian(bits, 4, tensor.data);
  }
  return tensor;
}

// F16 or BF16 from raw 16-bit patterns.
inline TensorBytes HalfTensor(std::string name, std::string dtype, std::vector<int64_t> shape,
                              const std::vector<uint16_t>& bits) {
  TensorBytes tensor{std::move(name), std::move(dtype), std::move(shape), {}};
  for (uint16_t pattern : bits) AppendLittleEndian(pattern, 2, tensor.data);
  return tensor;
}

// Length prefix + header text (used verbatim, so it can be broken) + data.
inline std::vector<uint8_t> FileBytes(const std::string& header, const std::vector<uint8_t>& data = {}) {
  std::vector<uint8_t> bytes;
  AppendLittleEndian(header.size(), 8, bytes);
  bytes.insert(bytes.end(), header.begin(), header.end());
  bytes.insert(bytes.end(), data.begin(), data.end());
  return bytes;
}

// A well-formed file: tensors laid out back to back in the given order, the
// header padded with spaces to a multiple of 8 bytes as the reference writer
// does.
inline std::vector<uint8_t> BuildFile(const std::vector<TensorBytes>& tensors,
                                      const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<uint8_t> data;
  for (const TensorBytes& tensor : tensors) {
    const uint64_t begin = data.size();
    data.insert(data.end(), tensor.data.begin(), tensor.data.end());
    header[tensor.name] = {
        {"dtype", tensor.dtype}, {"shape", tensor.shape}, {"data_offsets", {begin, data.size()}}};
  }
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  return FileBytes(text, data);
}

}  // namespace attention::testing
