// positions.cc: qk-norm and rotary positions on projected rows (positions.h).
#include "core/engine/positions.h"

#include <algorithm>
#include <cmath>

#include "core/thread_pool.h"

namespace attention::internal {
namespace {

// Rows per task: enough that a task's sines and cosines are worth a thread.
constexpr int64_t kRowsPerTask = 64;

// x / sqrt(mean(x^2) + eps) * weight over consecutive spans of the weight's
// size, as transformers' RMSNorm computes in float32.
void Normalise(float* row, int64_t width, const std::vector<float>& weight, double eps) {
  const int64_t span = static_cast<int64_t>(weight.size());
  for (int64_t first = 0; first + span <= width; first += span) {
    float* x = row + first;
    float square_sum = 0;
    for (int64_t c = 0; c < span; ++c) square_sum += x[c] * x[c];
    const float inverse =
        1.0f / std::sqrt(square_sum / static_cast<float>(span) + static_cast<float>(eps));
    for (int64_t c = 0; c < span; ++c) x[c] = weight[c] * (x[c] * inverse);
  }
}

// Turns the rotary columns of every head of one row by the angles whose
// cosines and sines are given (dims / 2 each).
void Rotate(float* row, int64_t heads, int64_t head_size, const RotaryEmbedding& rotary,
            const std::vector<double>& cos, const std::vector<double>& sin) {
  const int64_t half = rotary.dims / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x = row + h * head_size;
    for (int64_t f = 0; f < half; ++f) {
      float& first = rotary.interleaved ? x[2 * f] : x[f];
      float& second = rotary.interleaved ? x[2 * f + 1] : x[f + half];
      const double a = first, b = second;
      first = static_cast<float>(a * cos[f] - b * sin[f]);
      second = static_cast<float>(b * cos[f] + a * sin[f]);
    }
  }
}

}  // namespace

bool TransformsRows(const LayerTerms& terms) {
  return terms.rotary.dims > 0 || !terms.q_norm.empty() || !terms.k_norm.empty();
}

void PositionRows(ThreadPool& pool, const LayerTerms& terms, int64_t head_size,
                  std::span<const ProjectedRows> parts, std::span<const int64_t> positions) {
  const RotaryEmbedding& rotary = terms.rotary;
  const int64_t count = static_cast<int64_t>(positions.size());
  const int64_t tasks = (count + kRowsPerTask - 1) / kRowsPerTask;
  pool.ParallelFor(tasks, [&](int64_t task) {
    std::vector<double> cos(rotary.dims / 2), sin(rotary.dims / 2);
    const int64_t end = std::min(count, (task + 1) * kRowsPerTask);
    for (int64_t r = task * kRowsPerTask; r < end; ++r) {
      for (int64_t f = 0; f < rotary.dims / 2; ++f) {
        const double angle = static_cast<double>(positions[r]) * rotary.inv_freq[f];
        cos[f] = std::cos(angle) * rotary.attention_factor;
        sin[f] = std::sin(angle) * rotary.attention_factor;
      }
      for (const ProjectedRows& part : parts) {
        if (r >= part.count) continue;
        float* row = part.rows + r * part.stride;
        if (part.norm != nullptr && !part.norm->empty()) {
          Normalise(row, part.heads * head_size, *part.norm, terms.norm_eps);
        }
        if (rotary.dims > 0) Rotate(row, part.heads, head_size, rotary, cos, sin);
      }
    }
  });
}

ScoreTerms HeadTerms(const LayerTerms& terms, int64_t h) {
  ScoreTerms head;
  head.softcap = terms.softcap;
  if (!terms.alibi_slopes.empty()) head.alibi_slope = terms.alibi_slopes[h];
  if (!terms.sinks.empty()) {
    head.has_sink = true;
    head.sink = terms.sinks[h];
  }
  return head;
}

void AppendPositions(const AttentionRequest& request, int64_t b, int64_t n,
                     std::vector<int64_t>& positions) {
  const std::span<const int64_t> ids = request.position_ids;
  if (ids.empty()) {
    for (int64_t i = 0; i < n; ++i) positions.push_back(i);
    return;
  }
  const int64_t first = static_cast<int64_t>(ids.size()) == n ? 0 : b * n;
  positions.insert(positions.end(), ids.begin() + first, ids.begin() + first + n);
}

}  // namespace attention::internal
