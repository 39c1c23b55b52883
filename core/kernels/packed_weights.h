// packed_weights.h: projection weights packed once, at load, into the panels
// the packed GEMM reads (core/kernels/packed_gemm.h), with the bias beside them. A
// model holds its projection weights only in this form (core/model/model.h),
// without depending on the kernel or on the CPU's path.
//
// Two forms, by the model's precision (docs/api.md, "Precision"):
// - fp32: kPanelWidth output columns at a time, each panel in_cols x
//   kPanelWidth floats, row k holding W[n][k] for the panel's n.
// - bf16: the same panels in BF16 (rounded to nearest even), k taken in
//   pairs: panel row i holds, for each of its kPanelWidth columns n, the pair
//   (W[n][2i], W[n][2i + 1]) as one 32-bit word, the operand layout of
//   vdpbf16ps (the second of the last pair is zero when in_cols is odd).
//   Half the bytes of fp32; read as FP32 by widening where the CPU lacks
//   AVX512_BF16.
// The bias stays FP32 in both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace attention {

// Output columns per panel: two AVX-512 vectors, four AVX2 ones; 128 bytes
// (fp32 per k, bf16 per pair of k), two cache lines per step.
inline constexpr int64_t kPanelWidth = 32;

// What a model's products compute in (docs/api.md, "Precision").
enum class Precision { kFp32, kBf16 };

// `value` rounded to the nearest BF16 (ties to even): its upper 16 bits.
// For finite values (the loader refuses others).
uint16_t RoundToBf16(float value);
float Bf16ToFloat(uint16_t bits);

// Immutable once packed; copies share the storage.
class PackedWeights {
 public:
  PackedWeights() = default;

  // Packs W (out_cols x in_cols, row-major, as PyTorch stores it) and the
  // bias (out_cols floats, or null for none) in `precision`'s form. Columns
  // past out_cols in the last panel are zero.
  static PackedWeights Pack(const float* weight, int64_t out_cols, int64_t in_cols,
                            const float* bias, Precision precision = Precision::kFp32);

  bool empty() const { return out_cols_ == 0; }
  Precision precision() const { return precision_; }
  int64_t out_cols() const { return out_cols_; }
  int64_t in_cols() const { return in_cols_; }
  int64_t panels() const { return (out_cols_ + kPanelWidth - 1) / kPanelWidth; }
  // bf16: rows of a panel, pairs of k.
  int64_t k_pairs() const { return (in_cols_ + 1) / 2; }
  // fp32, panel p: in_cols rows of kPanelWidth floats, 64-byte aligned.
  const float* panel(int64_t p) const {
    return reinterpret_cast<const float*>(panels_.get()) + p * in_cols_ * kPanelWidth;
  }
  // bf16, panel p: k_pairs() rows of kPanelWidth pairs, 64-byte aligned.
  const uint32_t* bf16_panel(int64_t p) const {
    return reinterpret_cast<const uint32_t*>(panels_.get()) + p * k_pairs() * kPanelWidth;
  }
  // The bias of panel p's columns, kPanelWidth floats.
  const float* bias(int64_t p) const { return bias_.get() + p * kPanelWidth; }
  // Bytes of panels and bias held.
  size_t bytes() const;

  // The weights as held (BF16-rounded for bf16) back in PyTorch's row-major
  // [out_cols, in_cols], and the bias (out_cols floats): for tests and
  // tools, which need the row-major form the model no longer keeps.
  void Unpack(float* weight, float* bias) const;

 private:
  std::shared_ptr<const std::byte[]> panels_;
  std::shared_ptr<const float[]> bias_;
  int64_t out_cols_ = 0, in_cols_ = 0;
  Precision precision_ = Precision::kFp32;
};

}  // namespace attention
