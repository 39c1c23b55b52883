// packed_weights.h: projection weights packed once, at load, into the panels
// the packed GEMM reads (core/packed_gemm.h): kPanelWidth output columns at a
// time, each panel in_cols x kPanelWidth, row k holding W[n][k] for the
// panel's n, with the bias beside them. A model holds them (core/model.h)
// without depending on the kernel or on the CPU's path.
#pragma once

#include <cstdint>
#include <memory>

namespace attention {

// Output columns per panel: two AVX-512 vectors, four AVX2 ones; 128 bytes,
// two cache lines per k step.
inline constexpr int64_t kPanelWidth = 32;

// Immutable once packed; copies share the storage.
class PackedWeights {
 public:
  PackedWeights() = default;

  // Packs W (out_cols x in_cols, row-major, as PyTorch stores it) and the
  // bias (out_cols floats, or null for none). Columns past out_cols in the
  // last panel are zero.
  static PackedWeights Pack(const float* weight, int64_t out_cols, int64_t in_cols,
                            const float* bias);

  bool empty() const { return out_cols_ == 0; }
  int64_t out_cols() const { return out_cols_; }
  int64_t in_cols() const { return in_cols_; }
  int64_t panels() const { return (out_cols_ + kPanelWidth - 1) / kPanelWidth; }
  // Panel p: in_cols rows of kPanelWidth floats, 64-byte aligned.
  const float* panel(int64_t p) const { return panels_.get() + p * in_cols_ * kPanelWidth; }
  // The bias of panel p's columns, kPanelWidth floats.
  const float* bias(int64_t p) const { return bias_.get() + p * kPanelWidth; }

 private:
  std::shared_ptr<const float[]> panels_;
  std::shared_ptr<const float[]> bias_;
  int64_t out_cols_ = 0, in_cols_ = 0;
};

}  // namespace attention
