// float16.h: widening of the two 16-bit float formats to float32.
//
// Model files (safetensors F16/BF16) and Open Inference Protocol requests
// (FP16/BF16 tensors) both carry them; both conversions are exact for every
// input, so a value means the same whichever way it arrives.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

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

}  // namespace attention
