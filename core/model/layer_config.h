// layer_config.h: a Hugging Face attention layer's sizes and terms, read from
// the model's config.json (a safetensors file's "config" metadata) and the
// layer's own metadata keys (docs/api.md 5.6).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "core/model/layer_terms.h"

namespace attention {

struct HfLayerConfig {
  int64_t num_heads = 0;     // num_attention_heads
  int64_t num_kv_heads = 0;  // num_key_value_heads, default num_heads
  int64_t head_size = 0;     // head_dim, default hidden_size / num_heads; 0 if neither
  int64_t hidden_size = 0;   // 0 when the config has none
  int64_t layer_index = 0;
  LayerTerms terms;          // without the tensors (q_norm, k_norm, sinks)
};

// The layer as `metadata` describes it: its "config" (JSON), "layer_index",
// "rope_interleaved", "alibi" and "num_heads". INVALID_ARGUMENT naming the
// key and value for anything the engine cannot compute: a rope type other
// than default, linear, llama3 and yarn, heads that are not a multiple of
// the kv heads, a missing or malformed size.
absl::StatusOr<HfLayerConfig> ReadHfLayerConfig(const std::map<std::string, std::string>& metadata);

// BLOOM's ALiBi slopes for `heads` heads, also when not a power of two.
std::vector<float> AlibiSlopes(int64_t heads);

}  // namespace attention
