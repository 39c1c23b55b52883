// packed_weights.cc: packing projection weights into panels (packed_weights.h).
#include "core/packed_weights.h"

#include <cstddef>
#include <new>
#include <utility>

namespace attention {
namespace {

// Panels are read with aligned loads: 64 bytes, an AVX-512 vector and a
// cache line.
constexpr std::align_val_t kPanelAlignment{64};

std::shared_ptr<float[]> AllocatePanels(int64_t floats) {
  auto* data = static_cast<float*>(
      ::operator new[](static_cast<size_t>(floats) * sizeof(float), kPanelAlignment));
  return std::shared_ptr<float[]>(
      data, [](float* f) { ::operator delete[](f, kPanelAlignment); });
}

}  // namespace

PackedWeights PackedWeights::Pack(const float* weight, int64_t out_cols, int64_t in_cols,
                                  const float* bias) {
  PackedWeights packed;
  packed.out_cols_ = out_cols;
  packed.in_cols_ = in_cols;
  const int64_t padded = packed.panels() * kPanelWidth;
  std::shared_ptr<float[]> panels = AllocatePanels(padded * in_cols);
  std::shared_ptr<float[]> biases = AllocatePanels(padded);
  for (int64_t p = 0; p < packed.panels(); ++p) {
    float* panel = panels.get() + p * in_cols * kPanelWidth;
    for (int64_t k = 0; k < in_cols; ++k) {
      for (int64_t j = 0; j < kPanelWidth; ++j) {
        const int64_t n = p * kPanelWidth + j;
        panel[k * kPanelWidth + j] = n < out_cols ? weight[n * in_cols + k] : 0.0f;
      }
    }
  }
  for (int64_t n = 0; n < padded; ++n) {
    biases[n] = bias != nullptr && n < out_cols ? bias[n] : 0.0f;
  }
  packed.panels_ = std::move(panels);
  packed.bias_ = std::move(biases);
  return packed;
}

}  // namespace attention
