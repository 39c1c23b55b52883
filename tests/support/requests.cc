// requests.cc: request builders and the answer check of requests.h.
#include "tests/support/requests.h"

#include <algorithm>
#include <cmath>

#include <google/protobuf/util/json_util.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/engine/engine.h"
#include "server/api/attention/attention_adapter.h"

namespace attention::testing {
namespace {

constexpr float kTolerance = 1e-5f;

}  // namespace

v1::AttendRequest SelfAttentionRequest(int batch, int n, int dim, int seed) {
  v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_request_id(std::to_string(seed));
  v1::Tensor* queries = request.mutable_queries();
  for (int64_t s : {batch, n, dim}) queries->add_shape(s);
  for (int i = 0; i < batch * n * dim; ++i) {
    queries->add_data(static_cast<float>((i * 31 + seed * 17) % 23 - 11) / 11.0f);
  }
  return request;
}

v1::AttendRequest CrossAttentionRequest(int n_q, int n_k, int d, int seed) {
  v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_return_attention_weights(true);
  for (auto [tensor, n] : {std::pair{request.mutable_queries(), n_q},
                           std::pair{request.mutable_keys(), n_k}}) {
    tensor->add_shape(1);
    tensor->add_shape(n);
    tensor->add_shape(d);
    for (int i = 0; i < n * d; ++i) tensor->add_data(std::sin(0.37f * i + seed));
  }
  return request;
}

grpc::Status AttendWithin(v1::AttentionService::Stub& stub, std::chrono::milliseconds timeout,
                          const v1::AttendRequest& request, v1::AttendResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::AttendResponse ignored;
  return stub.Attend(&context, request, response != nullptr ? response : &ignored);
}

absl::StatusOr<v1::AttendRequest> RequestFromJson(const nlohmann::json& json) {
  v1::AttendRequest request;
  const auto status = google::protobuf::util::JsonStringToMessage(json.dump(), &request);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("not an AttendRequest: ", status.ToString()));
  }
  return request;
}

std::string CheckAnswer(const v1::AttendRequest& request, const v1::AttendResponse& response) {
  static Engine* const engine = new Engine(EngineOptions{.num_threads = 1});
  const Model model = DotProductModel();
  if (request.model() != model.name && request.model() != "gate") {
    return "CheckAnswer knows only dot_product and gate";
  }
  absl::StatusOr<AttentionResult> expected =
      engine->Attend(model, server::ToAttentionRequest(request));
  if (!expected.ok()) return absl::StrCat("the request is invalid: ", expected.status().message());
  if (response.request_id() != request.request_id()) {
    return absl::StrCat("request_id '", response.request_id(), "', sent '", request.request_id(),
                        "'");
  }
  const v1::Tensor& output = response.output();
  if (!std::equal(output.shape().begin(), output.shape().end(), expected->output.shape.begin(),
                  expected->output.shape.end())) {
    return "output shape differs";
  }
  if (output.data_size() != static_cast<int>(expected->output.data.size())) {
    return absl::StrCat("output has ", output.data_size(), " values, expected ",
                        expected->output.data.size());
  }
  for (int i = 0; i < output.data_size(); ++i) {
    if (!(std::abs(output.data(i) - expected->output.data[i]) <= kTolerance)) {
      return absl::StrCat("output[", i, "] = ", output.data(i), ", expected ",
                          expected->output.data[i]);
    }
  }
  return "";
}

v1::AttendRequest SmallRequest(const std::string& model, const std::string& id, float shift) {
  v1::AttendRequest request;
  request.set_model(model);
  request.set_request_id(id);
  request.set_return_attention_weights(true);
  for (int64_t s : {1, 3, 2}) request.mutable_queries()->add_shape(s);
  for (float v : {1.0f, -2.0f, 0.5f, 3.0f, 2.0f, 1.0f}) request.mutable_queries()->add_data(v + shift);
  return request;
}

}  // namespace attention::testing
