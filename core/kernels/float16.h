// float16.h: the two 16-bit float formats: widening to float32, rounding
// from it, and the dtypes a decoding session may hold its keys and values in.
//
// Model files (safetensors F16/BF16) and Open Inference Protocol requests
// (FP16/BF16 tensors) both carry them; both widenings are exact for every
// input, so a value means the same whichever way it arrives. Sessions round
// their rows once, when appended (core/sessions/session_state.h), as
// PyTorch's .to(torch.bfloat16) and .to(torch.float16) do.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>

namespace attention {

// IEEE binary16 (1 sign, 5 exponent bits with bias 15, 10 mantissa bits) to
// binary32 (bias 127), subnormals, infinities and NaN payloads included.
inline float HalfToFloat(uint16_t half) {
  const uint32_t sign = uint32_t{half & 0x8000u} << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, a normal float32 (or zero).
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 0x1f) {
    // Infinity (mantissa 0) or NaN, keeping its payload.
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  }
  return std::bit_cast<float>(sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13));
}

// BF16 is the upper half of a float32.
inline float BFloat16ToFloat(uint16_t bf16) { return std::bit_cast<float>(uint32_t{bf16} << 16); }

// float32 to BF16, rounded to nearest even; NaN stays a (quiet) NaN.
inline uint16_t FloatToBFloat16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// float32 to IEEE binary16, rounded to nearest even: magnitudes past the
// largest half (65504, and what rounds beyond it) become infinities, tiny
// ones subnormals or zero, as F16C's vcvtps2ph and PyTorch round.
inline uint16_t FloatToHalf(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half (2^-14): a multiple of 2^-24, which
    // float's own rounding of the sum to that ulp rounds to nearest even.
    const float scaled = std::bit_cast<float>(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(scaled) - 0x3f000000u));
  }
  // Rebias the exponent and round the 13 dropped mantissa bits to nearest
  // even; a carry into the exponent is the right result.
  const uint32_t rebiased = magnitude - ((127u - 15u) << 23);
  return static_cast<uint16_t>(sign | ((rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13));
}

// What a decoding session's blocks hold per key and value element
// (--kv-cache-dtype, docs/api.md section 11).
enum class KvDtype { kFloat32, kBfloat16, kFloat16 };

inline int64_t KvDtypeBytes(KvDtype dtype) { return dtype == KvDtype::kFloat32 ? 4 : 2; }

inline std::string_view KvDtypeName(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kBfloat16:
      return "bfloat16";
    case KvDtype::kFloat16:
      return "float16";
    case KvDtype::kFloat32:
      break;
  }
  return "float32";
}

// The dtype `name` names (float32, bfloat16, float16), or none.
inline std::optional<KvDtype> ParseKvDtype(std::string_view name) {
  for (KvDtype dtype : {KvDtype::kFloat32, KvDtype::kBfloat16, KvDtype::kFloat16}) {
    if (name == KvDtypeName(dtype)) return dtype;
  }
  return std::nullopt;
}

// The accepted names, for error messages.
inline constexpr std::string_view kKvDtypeNames = "float32, bfloat16 or float16";

// One element rounded into `dtype`'s 16 bits (bfloat16 or float16).
inline uint16_t RoundKv(KvDtype dtype, float value) {
  return dtype == KvDtype::kBfloat16 ? FloatToBFloat16(value) : FloatToHalf(value);
}
inline float WidenKv(KvDtype dtype, uint16_t bits) {
  return dtype == KvDtype::kBfloat16 ? BFloat16ToFloat(bits) : HalfToFloat(bits);
}

}  // namespace attention
