// random_weights.h: random model weights and inputs for the core tests that
// build models by hand (engine_test.cc, session_test.cc,
// prefix_sharing_test.cc).
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

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

// Inputs of standard deviation 1.
inline std::vector<float> RandomData(std::mt19937& rng, int64_t size) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> data(size);
  for (float& x : data) x = normal(rng);
  return data;
}

// A multi_head model of E = heads * head_size over inputs of the given sizes.
inline std::shared_ptr<Model> MultiHeadModel(std::mt19937& rng, int64_t heads,
                                             int64_t head_size, int64_t d_q, int64_t d_k,
                                             int64_t d_v, bool packed,
                                             Precision precision = Precision::kFp32) {
  auto m = std::make_shared<Model>();
  m->kind = Kind::kMultiHead;
  m->name = "multi_head";
  m->num_heads = heads;
  m->query_size = d_q;
  m->key_size = d_k;
  m->value_size = d_v;
  m->output_size = heads * head_size;
  m->precision = precision;
  const int64_t e = m->output_size;
  m->w_q = RandomMatrix(rng, e, d_q);
  m->w_k = RandomMatrix(rng, e, d_k);
  m->w_v = RandomMatrix(rng, e, d_v);
  m->w_o = RandomMatrix(rng, e, e);
  m->b_q = RandomVector(rng, e);
  m->b_k = RandomVector(rng, e);
  m->b_v = RandomVector(rng, e);
  m->b_o = RandomVector(rng, e);
  if (packed) PackProjections(*m);
  return m;
}

}  // namespace attention::testing
