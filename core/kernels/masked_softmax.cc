// masked_softmax.cc: MaskedSoftmaxRow.
#include "core/kernels/masked_softmax.h"

#include <algorithm>
#include <cmath>

namespace attention {

int64_t MaskedSoftmaxRow(std::span<float> row, int64_t bound) {
  const int64_t num_keys = static_cast<int64_t>(row.size());
  bound = std::clamp<int64_t>(bound, 0, num_keys);
  const int64_t num_masked = num_keys - bound;
  // Subtract the row maximum (masked scores included) so exp never overflows.
  float max_score = num_masked > 0 ? kMaskedScore : row[0];
  for (int64_t j = 0; j < bound; ++j) max_score = std::max(max_score, row[j]);

  const float masked_weight = num_masked > 0 ? std::exp(kMaskedScore - max_score) : 0.0f;
  double sum = static_cast<double>(masked_weight) * static_cast<double>(num_masked);
  for (int64_t j = 0; j < bound; ++j) {
    row[j] = std::exp(row[j] - max_score);
    sum += row[j];
  }
  const float inverse = static_cast<float>(1.0 / sum);
  for (int64_t j = 0; j < bound; ++j) row[j] *= inverse;
  std::fill(row.begin() + bound, row.end(), masked_weight * inverse);
  return masked_weight > 0.0f ? num_keys : bound;
}

}  // namespace attention
