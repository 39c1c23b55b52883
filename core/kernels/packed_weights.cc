// packed_weights.cc: packing projection weights into panels (packed_weights.h).
#include "core/kernels/packed_weights.h"

#include <cstring>
#include <new>
#include <utility>

#include "core/huge_pages.h"

namespace attention {
namespace {

// Panels are read with aligned loads: 64 bytes, an AVX-512 vector and a
// cache line.
constexpr std::align_val_t kPanelAlignment{64};

// A large model's panels go on huge pages: a projection streams all of
// them on every call, and 2 MiB pages need 512 times fewer TLB entries.
template <typename T>
std::shared_ptr<T[]> Allocate(int64_t count) {
  const size_t bytes = static_cast<size_t>(count) * sizeof(T);
  auto* data = static_cast<T*>(::operator new[](bytes, kPanelAlignment));
  if (bytes >= kHugePageAdviceBytes) AdviseHugePages(data, bytes);
  return std::shared_ptr<T[]>(data, [](T* p) { ::operator delete[](p, kPanelAlignment); });
}

}  // namespace

uint16_t RoundToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float Bf16ToFloat(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

PackedWeights PackedWeights::Pack(const float* weight, int64_t out_cols, int64_t in_cols,
                                  const float* bias, Precision precision) {
  PackedWeights packed;
  packed.out_cols_ = out_cols;
  packed.in_cols_ = in_cols;
  packed.precision_ = precision;
  const int64_t padded = packed.panels() * kPanelWidth;
  const auto at = [&](int64_t n, int64_t k) {
    return n < out_cols && k < in_cols ? weight[n * in_cols + k] : 0.0f;
  };
  if (precision == Precision::kFp32) {
    std::shared_ptr<float[]> panels = Allocate<float>(padded * in_cols);
    for (int64_t n = 0; n < padded; ++n) {
      float* panel = panels.get() + (n / kPanelWidth) * in_cols * kPanelWidth + n % kPanelWidth;
      for (int64_t k = 0; k < in_cols; ++k) panel[k * kPanelWidth] = at(n, k);
    }
    packed.panels_ = std::reinterpret_pointer_cast<const std::byte[]>(std::move(panels));
  } else {
    const int64_t pairs = packed.k_pairs();
    std::shared_ptr<uint32_t[]> panels = Allocate<uint32_t>(padded * pairs);
    for (int64_t n = 0; n < padded; ++n) {
      uint32_t* panel = panels.get() + (n / kPanelWidth) * pairs * kPanelWidth + n % kPanelWidth;
      for (int64_t i = 0; i < pairs; ++i) {
        panel[i * kPanelWidth] = RoundToBf16(at(n, 2 * i)) |
                                 static_cast<uint32_t>(RoundToBf16(at(n, 2 * i + 1))) << 16;
      }
    }
    packed.panels_ = std::reinterpret_pointer_cast<const std::byte[]>(std::move(panels));
  }
  std::shared_ptr<float[]> biases = Allocate<float>(padded);
  for (int64_t n = 0; n < padded; ++n) {
    biases[n] = bias != nullptr && n < out_cols ? bias[n] : 0.0f;
  }
  packed.bias_ = std::move(biases);
  return packed;
}

size_t PackedWeights::bytes() const {
  const int64_t padded = panels() * kPanelWidth;
  const int64_t panel_bytes = precision_ == Precision::kFp32 ? padded * in_cols_ * 4
                                                             : padded * k_pairs() * 4;
  return static_cast<size_t>(panel_bytes + padded * 4);
}

void PackedWeights::Unpack(float* weight, float* bias) const {
  for (int64_t n = 0; n < out_cols_; ++n) {
    const int64_t p = n / kPanelWidth, j = n % kPanelWidth;
    for (int64_t k = 0; k < in_cols_; ++k) {
      if (precision_ == Precision::kFp32) {
        weight[n * in_cols_ + k] = panel(p)[k * kPanelWidth + j];
      } else {
        const uint32_t pair = bf16_panel(p)[(k / 2) * kPanelWidth + j];
        weight[n * in_cols_ + k] = Bf16ToFloat(static_cast<uint16_t>(pair >> (16 * (k % 2))));
      }
    }
    bias[n] = this->bias(p)[j];
  }
}

}  // namespace attention
