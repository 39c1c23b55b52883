// probe_request.cc: ProbeRequest and CheckAnswer.
#include "tests/fuzz/probe_request.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/fuzz/fuzz_check.h"

namespace attention::fuzz {
namespace {

// A softmax row sums to 1 up to float rounding over at most a few thousand keys.
constexpr double kWeightSumTolerance = 1e-3;
// The bound (docs/api.md) between a batched and an unbatched answer, relative to
// the answer's magnitude when that is above 1.
constexpr float kBatchTolerance = 1e-5f;

std::vector<float> Pattern(int64_t count, int64_t seed) {
  std::vector<float> values(count);
  for (int64_t i = 0; i < count; ++i) {
    values[i] = static_cast<float>(((i * 7 + seed * 13) % 17) - 8) / 8.0f;
  }
  return values;
}

int64_t SizeOr(int64_t size, int64_t any) { return size != 0 ? size : any; }

std::string Shape(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

void CheckShapes(const AttentionResult& result, const AttentionDims& dims, bool multi_head,
                 bool want_weights) {
  const std::vector<int64_t> output_shape = {dims.batch, dims.num_queries, dims.output_size};
  FUZZ_CHECK(result.output.shape == output_shape, "output shape %s, validated %s",
             Shape(result.output.shape).c_str(), Shape(output_shape).c_str());
  FUZZ_CHECK(static_cast<int64_t>(result.output.data.size()) == dims.output_elements(),
             "output has %zu values for shape %s", result.output.data.size(),
             Shape(output_shape).c_str());
  if (!want_weights) {
    FUZZ_CHECK(result.attention_weights.data.empty(), "weights returned but not asked for");
    return;
  }
  const std::vector<int64_t> weights_shape =
      multi_head ? std::vector<int64_t>{dims.batch, dims.num_heads, dims.num_queries, dims.num_keys}
          : std::vector<int64_t>{dims.batch, dims.num_queries, dims.num_keys};
  FUZZ_CHECK(result.attention_weights.shape == weights_shape, "weights shape %s, validated %s",
             Shape(result.attention_weights.shape).c_str(), Shape(weights_shape).c_str());
  FUZZ_CHECK(static_cast<int64_t>(result.attention_weights.data.size()) == dims.weight_elements(),
             "weights have %zu values, expected %lld", result.attention_weights.data.size(),
             static_cast<long long>(dims.weight_elements()));
}

void CheckWeightRows(const AttentionResult& result, const AttentionDims& dims) {
  const std::vector<float>& weights = result.attention_weights.data;
  for (size_t row = 0; row + dims.num_keys <= weights.size(); row += dims.num_keys) {
    double sum = 0;
    bool finite = true;
    for (int64_t j = 0; j < dims.num_keys; ++j) {
      const float w = weights[row + j];
      finite &= std::isfinite(w);
      if (finite) FUZZ_CHECK(w >= 0.0f && w <= 1.0f + 1e-6f, "weight %g outside [0, 1]", w);
      sum += w;
    }
    if (finite) {
      FUZZ_CHECK(std::abs(sum - 1.0) <= kWeightSumTolerance, "weight row %zu sums to %.9g",
                 row / dims.num_keys, sum);
    }
  }
}

void CheckFinite(const Tensor& tensor, const char* what) {
  for (size_t i = 0; i < tensor.data.size(); ++i) {
    FUZZ_CHECK(std::isfinite(tensor.data[i]), "%s[%zu] = %g in an answer with status OK", what,
               i, tensor.data[i]);
  }
}

void CheckSame(const Tensor& alone, const Tensor& batched, const char* what) {
  FUZZ_CHECK(alone.shape == batched.shape, "%s shape %s alone, %s batched", what,
             Shape(alone.shape).c_str(), Shape(batched.shape).c_str());
  const float tolerance = kBatchTolerance * std::max(1.0f, MaxAbs(alone.data));
  for (size_t i = 0; i < alone.data.size(); ++i) {
    const float a = alone.data[i], b = batched.data[i];
    FUZZ_CHECK(std::abs(a - b) <= tolerance, "%s[%zu] = %.9g alone, %.9g batched", what, i, a, b);
  }
}

}  // namespace

ProbeRequest::ProbeRequest(const Model& model, int64_t batch, int64_t num_queries,
                           int64_t num_keys) {
  const int64_t query_size = SizeOr(model.query_size, 2);
  const int64_t key_size = SizeOr(model.key_size, query_size);
  const int64_t value_size = SizeOr(model.value_size, 3);
  queries_ = Pattern(batch * num_queries * query_size, 1);
  keys_ = Pattern(batch * num_keys * key_size, 2);
  values_ = Pattern(batch * num_keys * value_size, 3);
  for (int64_t b = 0; b < batch; ++b) valid_lens_.push_back(static_cast<int32_t>(1 + b % num_keys));
  request_.queries = {{batch, num_queries, query_size}, queries_};
  request_.keys = TensorView{{batch, num_keys, key_size}, keys_};
  request_.values = TensorView{{batch, num_keys, value_size}, values_};
  request_.valid_lens = valid_lens_;
  request_.causal = num_queries > 1;
  request_.return_attention_weights = true;
}

float MaxAbs(std::span<const float> values) {
  float max = 0;
  for (float v : values) max = std::max(max, std::abs(v));
  return max;
}

void CheckAnswer(Engine& engine, const Model& model, const AttentionRequest& request,
                 const AttentionDims& dims, const AttentionRequest& companion, bool moderate) {
  absl::StatusOr<AttentionResult> alone = engine.Attend(model, request);
  if (!alone.ok()) {
    // A valid request is refused only when its answer has no float32 form
    // (docs/api.md, section 3), which moderate values never reach.
    const std::string message(alone.status().message());
    FUZZ_CHECK(!moderate && alone.status().code() == absl::StatusCode::kInvalidArgument &&
                   message.find("expected a finite value") != std::string::npos,
               "a request that passed Validate failed in Attend: %s", message.c_str());
    return;
  }
  CheckShapes(*alone, dims, model.kind == Kind::kMultiHead, request.return_attention_weights);
  CheckWeightRows(*alone, dims);
  // An answer with status OK is finite, whatever the inputs.
  CheckFinite(alone->output, "output");
  CheckFinite(alone->attention_weights, "attention_weights");
  // Scores of inputs near the float range depend on summation order, so only
  // moderate ones are held to batch independence.
  if (!moderate) return;

  absl::StatusOr<AttentionDims> companion_dims = Validate(model, companion);
  FUZZ_CHECK(companion_dims.ok(), "companion request invalid: %s",
             std::string(companion_dims.status().message()).c_str());
  const ValidatedRequest batch[] = {{&companion, *companion_dims}, {&request, dims}};
  AttentionResult results[2];
  engine.Run(model, batch, results);
  FUZZ_CHECK(results[1].status.ok(), "refused in a batch, answered alone: %s",
             std::string(results[1].status.message()).c_str());
  CheckSame(alone->output, results[1].output, "output");
  CheckSame(alone->attention_weights, results[1].attention_weights, "attention_weights");
}

}  // namespace attention::fuzz
