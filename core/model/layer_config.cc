// layer_config.cc: ReadHfLayerConfig: a Hugging Face config.json and a layer's
// metadata to its sizes and terms, with the formulas of transformers'
// modeling_rope_utils (default, linear, llama3, yarn) and BLOOM's ALiBi.
#include "core/model/layer_config.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/status_macros.h"

namespace attention {
namespace {

using Json = nlohmann::json;

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

// A config key's value as the message shows it, cut short.
std::string Shown(const Json& value) {
  std::string text = value.dump();
  if (text.size() > 80) text = text.substr(0, 77) + "...";
  return text;
}

absl::Status BadValue(absl::string_view key, const Json& value, absl::string_view expected) {
  return Invalid(absl::StrCat("config \"", key, "\" is ", Shown(value), ", expected ", expected));
}

// The member `key` of `object`, or null when absent or JSON null.
const Json* Member(const Json& object, absl::string_view key) {
  const auto it = object.find(std::string(key));
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::StatusOr<double> NumberOr(const Json& object, absl::string_view key, double fallback) {
  const Json* value = Member(object, key);
  if (value == nullptr) return fallback;
  if (!value->is_number() || !std::isfinite(value->get<double>())) {
    return BadValue(key, *value, "a finite number");
  }
  return value->get<double>();
}

absl::StatusOr<int64_t> CountOr(const Json& object, absl::string_view key, int64_t fallback,
                                int64_t least = 1) {
  const Json* value = Member(object, key);
  if (value == nullptr) return fallback;
  if (!value->is_number_integer() || value->get<int64_t>() < least) {
    return BadValue(key, *value, absl::StrCat("an integer >= ", least));
  }
  return value->get<int64_t>();
}

absl::StatusOr<bool> FlagOr(const Json& object, absl::string_view key, bool fallback) {
  const Json* value = Member(object, key);
  if (value == nullptr) return fallback;
  if (!value->is_boolean()) return BadValue(key, *value, "true or false");
  return value->get<bool>();
}

// A metadata key holding "true" or "false"; absent: false.
absl::StatusOr<bool> MetadataFlag(const std::map<std::string, std::string>& metadata,
                                  absl::string_view key) {
  const auto it = metadata.find(std::string(key));
  if (it == metadata.end() || it->second == "false") return false;
  if (it->second == "true") return true;
  return Invalid(absl::StrCat("__metadata__ \"", key, "\" is \"", absl::CHexEscape(it->second),
                              "\", expected true or false"));
}

// A metadata key holding a decimal integer >= least; absent: nullopt.
absl::StatusOr<std::optional<int64_t>> MetadataCount(
    const std::map<std::string, std::string>& metadata, absl::string_view key, int64_t least) {
  const auto it = metadata.find(std::string(key));
  if (it == metadata.end()) return std::optional<int64_t>();
  int64_t value = 0;
  const bool digits = !it->second.empty() &&
                      std::all_of(it->second.begin(), it->second.end(), absl::ascii_isdigit);
  if (!digits || !absl::SimpleAtoi(it->second, &value) || value < least) {
    return Invalid(absl::StrCat("__metadata__ \"", key, "\" is \"", absl::CHexEscape(it->second),
                                "\", expected a decimal integer >= ", least));
  }
  return std::optional<int64_t>(value);
}

// The rope parameters and the config key they are under: transformers v5's
// "rope_parameters" (the layer type's own entry where it has one per type)
// or v4's "rope_scaling"; null when neither.
struct RopeParameters {
  const Json* parameters = nullptr;
  std::string key = "rope_scaling";
};

RopeParameters FindRopeParameters(const Json& config, const std::string& layer_type) {
  if (const Json* parameters = Member(config, "rope_parameters"); parameters != nullptr) {
    if (const Json* of_type = Member(*parameters, layer_type);
        of_type != nullptr && of_type->is_object()) {
      return {of_type, "rope_parameters." + layer_type};
    }
    return {parameters, "rope_parameters"};
  }
  return {Member(config, "rope_scaling"), "rope_scaling"};
}

// 1 / theta^(2f / dims) for f < dims / 2.
std::vector<double> DefaultFrequencies(double theta, int64_t dims) {
  std::vector<double> inv_freq(dims / 2);
  for (int64_t f = 0; f < dims / 2; ++f) {
    inv_freq[f] = 1.0 / std::pow(theta, static_cast<double>(2 * f) / static_cast<double>(dims));
  }
  return inv_freq;
}

absl::Status ScaleLlama3(const Json& rope, const std::string& key, RotaryEmbedding& rotary) {
  ASSIGN_OR_RETURN(const double factor, NumberOr(rope, "factor", 8.0));
  ASSIGN_OR_RETURN(const double low_factor, NumberOr(rope, "low_freq_factor", 1.0));
  ASSIGN_OR_RETURN(const double high_factor, NumberOr(rope, "high_freq_factor", 4.0));
  ASSIGN_OR_RETURN(const double old_context,
                   NumberOr(rope, "original_max_position_embeddings", 8192.0));
  if (factor <= 0 || high_factor == low_factor) {
    return BadValue(key, rope, "factor > 0 and high_freq_factor != low_freq_factor");
  }
  const double low_wavelen = old_context / low_factor, high_wavelen = old_context / high_factor;
  for (double& inv_freq : rotary.inv_freq) {
    const double wavelen = 2 * std::numbers::pi / inv_freq;
    const double scaled = wavelen > low_wavelen ? inv_freq / factor : inv_freq;
    if (wavelen < high_wavelen || wavelen > low_wavelen) {
      inv_freq = scaled;
      continue;
    }
    const double smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor);
    inv_freq = (1 - smooth) * scaled / factor + smooth * scaled;
  }
  return absl::OkStatus();
}

absl::Status ScaleYarn(const Json& rope, const std::string& key, double theta,
                       int64_t max_positions, RotaryEmbedding& rotary) {
  ASSIGN_OR_RETURN(const double factor, NumberOr(rope, "factor", 1.0));
  if (factor <= 0) return BadValue(key + ".factor", rope["factor"], "a number > 0");
  ASSIGN_OR_RETURN(const double mscale, NumberOr(rope, "mscale", 0.0));
  ASSIGN_OR_RETURN(const double mscale_all_dim, NumberOr(rope, "mscale_all_dim", 0.0));
  const auto get_mscale = [&](double m) { return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1; };
  ASSIGN_OR_RETURN(
      rotary.attention_factor,
      NumberOr(rope, "attention_factor",
               mscale != 0 && mscale_all_dim != 0 ? get_mscale(mscale) / get_mscale(mscale_all_dim)
                                                  : get_mscale(1.0)));
  ASSIGN_OR_RETURN(double beta_fast, NumberOr(rope, "beta_fast", 32.0));
  ASSIGN_OR_RETURN(double beta_slow, NumberOr(rope, "beta_slow", 1.0));
  if (beta_fast == 0) beta_fast = 32;  // transformers: `or 32`, `or 1`
  if (beta_slow == 0) beta_slow = 1;
  ASSIGN_OR_RETURN(const double original,
                   NumberOr(rope, "original_max_position_embeddings", max_positions));
  ASSIGN_OR_RETURN(const bool truncate, FlagOr(rope, "truncate", true));
  const double dims = static_cast<double>(rotary.dims);
  const auto correction_dim = [&](double rotations) {
    return dims * std::log(original / (rotations * 2 * std::numbers::pi)) / (2 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dims - 1);
  if (low == high) high += 0.001;
  for (size_t f = 0; f < rotary.inv_freq.size(); ++f) {
    const double ramp = std::clamp((static_cast<double>(f) - low) / (high - low), 0.0, 1.0);
    const double extrapolation = 1 - ramp;
    const double inv_freq = rotary.inv_freq[f];
    rotary.inv_freq[f] = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation;
  }
  return absl::OkStatus();
}

// The rotary embedding of a layer with `head_size` columns per head.
absl::StatusOr<RotaryEmbedding> ReadRotary(const Json& config, const std::string& layer_type,
                                           int64_t head_size, bool interleaved) {
  const RopeParameters rope = FindRopeParameters(config, layer_type);
  const Json empty = Json::object();
  if (rope.parameters != nullptr && !rope.parameters->is_object()) {
    return BadValue(rope.key, *rope.parameters, "an object");
  }
  const Json& parameters = rope.parameters != nullptr ? *rope.parameters : empty;
  RotaryEmbedding rotary;
  rotary.interleaved = interleaved;
  ASSIGN_OR_RETURN(const double theta_in_config, NumberOr(config, "rope_theta", 10000.0));
  ASSIGN_OR_RETURN(rotary.theta, NumberOr(parameters, "rope_theta", theta_in_config));
  if (rotary.theta <= 1) return BadValue("rope_theta", rotary.theta, "a number > 1");
  ASSIGN_OR_RETURN(const double partial_in_config, NumberOr(config, "partial_rotary_factor", 1.0));
  ASSIGN_OR_RETURN(const double partial,
                   NumberOr(parameters, "partial_rotary_factor", partial_in_config));
  if (partial <= 0 || partial > 1) {
    return BadValue("partial_rotary_factor", partial, "a number in (0, 1]");
  }
  rotary.dims = static_cast<int64_t>(static_cast<double>(head_size) * partial);
  if (rotary.dims < 2 || rotary.dims % 2 != 0) {
    return Invalid(absl::StrCat("config: rotary dims head_dim * partial_rotary_factor = ",
                                rotary.dims, ", expected an even number >= 2"));
  }
  const Json* type = Member(parameters, "rope_type");
  if (type == nullptr) type = Member(parameters, "type");
  rotary.type = type == nullptr ? "default" : type->is_string() ? type->get<std::string>() : "";
  rotary.inv_freq = DefaultFrequencies(rotary.theta, rotary.dims);
  ASSIGN_OR_RETURN(const int64_t max_positions,
                   CountOr(config, "max_position_embeddings", 2048));
  if (rotary.type == "default") return rotary;
  if (rotary.type == "linear") {
    ASSIGN_OR_RETURN(const double factor, NumberOr(parameters, "factor", 1.0));
    if (factor <= 0) return BadValue(rope.key + ".factor", factor, "a number > 0");
    for (double& inv_freq : rotary.inv_freq) inv_freq /= factor;
    return rotary;
  }
  if (rotary.type == "llama3") {
    RETURN_IF_ERROR(ScaleLlama3(parameters, rope.key, rotary));
    return rotary;
  }
  if (rotary.type == "yarn") {
    RETURN_IF_ERROR(ScaleYarn(parameters, rope.key, rotary.theta, max_positions, rotary));
    return rotary;
  }
  return BadValue(rope.key + (Member(parameters, "rope_type") != nullptr ? ".rope_type" : ".type"),
                  type == nullptr ? Json() : *type,
                  "default, linear, llama3 or yarn (dynamic and longrope scale with the "
                  "sequence's length, which this engine does not compute)");
}

// Whether the config's sliding_window applies to layer `index`.
absl::StatusOr<bool> LayerSlides(const Json& config, int64_t index, std::string& layer_type) {
  layer_type = "full_attention";
  if (const Json* types = Member(config, "layer_types"); types != nullptr) {
    if (!types->is_array() || index >= static_cast<int64_t>(types->size()) ||
        !(*types)[index].is_string()) {
      return BadValue("layer_types", *types,
                      absl::StrCat("an array of strings with an entry for layer_index ", index));
    }
    layer_type = (*types)[index].get<std::string>();
    return layer_type == "sliding_attention";
  }
  const Json* model_type = Member(config, "model_type");
  const std::string type = model_type != nullptr && model_type->is_string()
                               ? model_type->get<std::string>()
                               : std::string();
  bool slides = true;
  if (type.rfind("qwen", 0) == 0) {
    ASSIGN_OR_RETURN(const bool use, FlagOr(config, "use_sliding_window", false));
    ASSIGN_OR_RETURN(const int64_t first, CountOr(config, "max_window_layers", 0, 0));
    slides = use && index >= first;
  } else if (type == "gemma2") {
    slides = index % 2 == 0;
  }
  if (slides) layer_type = "sliding_attention";
  return slides;
}

absl::Status ReadSizes(const Json& config, const std::map<std::string, std::string>& metadata,
                       HfLayerConfig& layer) {
  const Json* heads = Member(config, "num_attention_heads");
  if (heads == nullptr) return Invalid("config has no \"num_attention_heads\"");
  ASSIGN_OR_RETURN(layer.num_heads, CountOr(config, "num_attention_heads", 0));
  ASSIGN_OR_RETURN(layer.num_kv_heads, CountOr(config, "num_key_value_heads", layer.num_heads));
  if (layer.num_heads % layer.num_kv_heads != 0) {
    return Invalid(absl::StrCat("config \"num_attention_heads\" ", layer.num_heads,
                                " is not a multiple of \"num_key_value_heads\" ",
                                layer.num_kv_heads));
  }
  ASSIGN_OR_RETURN(layer.hidden_size, CountOr(config, "hidden_size", 0));
  ASSIGN_OR_RETURN(layer.head_size,
                   CountOr(config, "head_dim", layer.hidden_size / layer.num_heads));
  if (layer.head_size == 0) return Invalid("config has neither \"head_dim\" nor \"hidden_size\"");
  ASSIGN_OR_RETURN(const std::optional<int64_t> num_heads, MetadataCount(metadata, "num_heads", 1));
  if (num_heads && *num_heads != layer.num_heads) {
    return Invalid(absl::StrCat("__metadata__ \"num_heads\" is ", *num_heads,
                                ", but config \"num_attention_heads\" is ", layer.num_heads));
  }
  ASSIGN_OR_RETURN(const std::optional<int64_t> index, MetadataCount(metadata, "layer_index", 0));
  layer.layer_index = index.value_or(0);
  return absl::OkStatus();
}

absl::Status ReadTerms(const Json& config, const std::map<std::string, std::string>& metadata,
                       HfLayerConfig& layer) {
  LayerTerms& terms = layer.terms;
  std::string layer_type;
  ASSIGN_OR_RETURN(const bool slides, LayerSlides(config, layer.layer_index, layer_type));
  ASSIGN_OR_RETURN(const int64_t window, CountOr(config, "sliding_window", 0, 0));
  terms.sliding_window = slides ? window : 0;
  ASSIGN_OR_RETURN(const double softcap, NumberOr(config, "attn_logit_softcapping", 0.0));
  if (softcap < 0) return BadValue("attn_logit_softcapping", softcap, "a number >= 0");
  terms.softcap = static_cast<float>(softcap);
  ASSIGN_OR_RETURN(const double scalar, NumberOr(config, "query_pre_attn_scalar", 0.0));
  if (scalar < 0) return BadValue("query_pre_attn_scalar", scalar, "a number > 0");
  terms.scale = scalar > 0 ? static_cast<float>(1.0 / std::sqrt(scalar)) : 0.0f;
  ASSIGN_OR_RETURN(terms.norm_eps, NumberOr(config, "rms_norm_eps", 1e-6));
  ASSIGN_OR_RETURN(const bool alibi, MetadataFlag(metadata, "alibi"));
  ASSIGN_OR_RETURN(const bool interleaved, MetadataFlag(metadata, "rope_interleaved"));
  if (alibi) {
    terms.alibi_slopes = AlibiSlopes(layer.num_heads);
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(terms.rotary, ReadRotary(config, layer_type, layer.head_size, interleaved));
  return absl::OkStatus();
}

}  // namespace

std::vector<float> AlibiSlopes(int64_t heads) {
  int64_t power = 1;
  while (power * 2 <= heads) power *= 2;
  const auto slopes_of = [](int64_t count, int64_t first, int64_t step, int64_t n) {
    const double base = std::pow(2.0, -std::pow(2.0, -(std::log2(static_cast<double>(count)) - 3)));
    std::vector<float> slopes;
    for (int64_t i = 0; i < n; ++i) {
      slopes.push_back(static_cast<float>(std::pow(base, static_cast<double>(first + i * step))));
    }
    return slopes;
  };
  std::vector<float> slopes = slopes_of(power, 1, 1, power);
  if (power < heads) {
    const std::vector<float> extra = slopes_of(2 * power, 1, 2, std::min(power, heads - power));
    slopes.insert(slopes.end(), extra.begin(), extra.end());
  }
  return slopes;
}

absl::StatusOr<HfLayerConfig> ReadHfLayerConfig(
    const std::map<std::string, std::string>& metadata) {
  const auto text = metadata.find("config");
  if (text == metadata.end()) {
    return Invalid(
        "a multi_head model in Hugging Face's layout (q_proj.weight, ...) needs __metadata__ "
        "\"config\": the model's config.json as a string");
  }
  Json config;
  try {
    config = Json::parse(text->second);
  } catch (const Json::parse_error& error) {
    return Invalid(absl::StrCat("__metadata__ \"config\" is not a JSON object (expected the "
                                "model's config.json): ", error.what()));
  }
  if (!config.is_object()) {
    return Invalid(absl::StrCat("__metadata__ \"config\" is not a JSON object (expected the "
                                "model's config.json): it is ", Shown(config)));
  }
  if (const Json* type = Member(config, "model_type");
      type != nullptr && type->is_string() && type->get<std::string>().rfind("gemma3", 0) == 0) {
    return BadValue("model_type", *type,
                    "a family this engine computes: Gemma 3 scales its qk-norm by (1 + weight) "
                    "and rotates its local layers with rope_local_base_freq, which it does not "
                    "read");
  }
  HfLayerConfig layer;
  RETURN_IF_ERROR(ReadSizes(config, metadata, layer));
  RETURN_IF_ERROR(ReadTerms(config, metadata, layer));
  return layer;
}

}  // namespace attention
