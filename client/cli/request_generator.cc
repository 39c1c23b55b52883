// request_generator.cc: synthetic requests for `bench` (see request_generator.h).
#include "client/cli/request_generator.h"

#include <algorithm>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attention::client {
namespace {

// Large enough for any sensible benchmark, small enough to fit in memory twice.
constexpr int64_t kMaxFloats = int64_t{1} << 28;
constexpr uint32_t kSeed = 20240601;

// The values are drawn straight into the message's float array (one
// allocation, no per-value append), which protobuf writes to the wire as
// the packed field's bytes in one copy.
void FillTensor(attention::v1::Tensor& tensor, int64_t b, int64_t n, int64_t d,
                std::mt19937& random) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  tensor.add_shape(b);
  tensor.add_shape(n);
  tensor.add_shape(d);
  google::protobuf::RepeatedField<float>& data = *tensor.mutable_data();
  data.Resize(static_cast<int>(b * n * d), 0.0f);
  std::generate(data.begin(), data.end(), [&] { return normal(random); });
}

}  // namespace

absl::StatusOr<attention::v1::AttendRequest> GenerateRequest(
    const GeneratedRequestShape& shape, const attention::v1::ModelInfo& model) {
  for (const auto& [name, value] : {std::pair{"--batch", shape.batch},
                                    std::pair{"--n", shape.n}, std::pair{"--dim", shape.dim}}) {
    if (value < 1 || value > kMaxFloats) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " must be 1..", kMaxFloats, "; was ", value));
    }
  }
  const int64_t d_q = model.query_size() > 0 ? model.query_size() : shape.dim;
  const int64_t d_k = model.key_size() > 0 ? model.key_size() : shape.dim;
  const int64_t d_v = model.value_size() > 0 ? model.value_size() : shape.dim;
  const int64_t rows = shape.batch * shape.n;  // both <= 2^28: no overflow
  // Checked factor by factor so that no product can overflow int64.
  if (rows > kMaxFloats || d_q > kMaxFloats || d_k > kMaxFloats || d_v > kMaxFloats ||
      rows * (d_q + d_k + d_v) > kMaxFloats) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request of --batch ", shape.batch, " --n ", shape.n, " with sizes (d_q ", d_q,
        ", d_k ", d_k, ", d_v ", d_v, ") is above the limit of ", kMaxFloats, " floats"));
  }
  if (shape.self_attention && (d_k != d_q || d_v != d_q)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--self-attention: model '", shape.model, "' takes inputs of different sizes (d_q ", d_q,
        ", d_k ", d_k, ", d_v ", d_v, "); the queries can stand in for keys and values only "
        "when all three are equal"));
  }
  std::mt19937 random(kSeed);
  attention::v1::AttendRequest request;
  request.set_model(shape.model);
  request.set_causal(shape.causal);
  FillTensor(*request.mutable_queries(), shape.batch, shape.n, d_q, random);
  if (shape.self_attention) return request;
  FillTensor(*request.mutable_keys(), shape.batch, shape.n, d_k, random);
  FillTensor(*request.mutable_values(), shape.batch, shape.n, d_v, random);
  return request;
}

}  // namespace attention::client
