// layer_terms.h: what the attention layers of today's decoder models add to
// multi-head attention (docs/api.md 5.6): rotary positions, qk-norm, a
// sliding window, logit soft-capping, sink logits, ALiBi and their own
// scale. A model in Hugging Face's layout holds them (layer_config.h reads
// them from its config.json); the older layouts leave them all off.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace attention {

// Rotary position embedding as Hugging Face computes it: the first `dims`
// columns of each head turn by position * inv_freq[f], as halves
// (rotate_half: column f pairs with f + dims/2) or adjacent pairs (2f,
// 2f + 1) when interleaved; cos and sin are scaled by attention_factor
// (yarn's); the remaining columns pass through.
struct RotaryEmbedding {
  int64_t dims = 0;  // even; 0: no rotary
  bool interleaved = false;
  std::vector<double> inv_freq;  // dims / 2 frequencies
  double attention_factor = 1.0;
  // As the config named them, for ListModels and the model metadata.
  std::string type;
  double theta = 0;
};

struct LayerTerms {
  RotaryEmbedding rotary;
  // RMSNorm weights of the projected queries and keys, applied before
  // rotary over consecutive spans of their size: [head_size] normalises each
  // head on its own, the projection's whole width the row; empty: none.
  std::vector<float> q_norm, k_norm;
  double norm_eps = 1e-6;
  // Key j is allowed for query i only if i - j < sliding_window; 0: none.
  int64_t sliding_window = 0;
  // Scores become softcap * tanh(score / softcap); 0: none.
  float softcap = 0;
  // One more logit per query head in each softmax, whose weight is dropped;
  // empty: none.
  std::vector<float> sinks;
  // ALiBi: head h adds alibi_slopes[h] * (j - i) to its scores; empty: none.
  std::vector<float> alibi_slopes;
  // The heads' scale; 0: 1/sqrt(head_size).
  float scale = 0;

  // Terms that differ between heads or change the scores (ALiBi, sinks,
  // soft-cap): a group's heads are then not one problem.
  bool has_head_terms() const { return !alibi_slopes.empty() || !sinks.empty() || softcap != 0; }
};

}  // namespace attention
