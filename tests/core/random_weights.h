// random_weights.h: random model weights for the core tests that build
// models by hand (engine_test.cc, session_test.cc).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>

#include "core/model/model.h"

namespace attention::testing {

// Entries with standard deviation 1/sqrt(cols), as PyTorch's initialisation
// scales them, so products of any width stay near 1.
inline RowMatrix RandomMatrix(std::mt19937& rng, int64_t rows, int64_t cols) {
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(cols)));
  RowMatrix m(rows, cols);
  for (int64_t i = 0; i < m.size(); ++i) m.data()[i] = normal(rng);
  return m;
}

inline Vector RandomVector(std::mt19937& rng, int64_t size) {
  std::normal_distribution<float> normal(0.0f, 0.5f);
  Vector v(size);
  for (int64_t i = 0; i < size; ++i) v[i] = normal(rng);
  return v;
}

}  // namespace attention::testing
