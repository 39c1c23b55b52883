// requests.h: the requests the server and client tests send, and the check
// that an answer is the right one.
#pragma once

#include <chrono>
#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "attention.grpc.pb.h"

namespace attention::testing {

// dot_product self-attention over (batch, n, dim) queries with values from
// `seed`, so every request of a test differs. request_id is the seed.
v1::AttendRequest SelfAttentionRequest(int batch, int n, int dim, int seed);

// dot_product with (1, n_q, d) queries and (1, n_k, d) keys filled from
// `seed`, asking for the attention weights.
v1::AttendRequest CrossAttentionRequest(int n_q, int n_k, int d, int seed);

// A small request for `model` (dot_product or gate): (1, 3, 2) queries as
// self-attention, each value plus `shift`, asking for the weights.
v1::AttendRequest SmallRequest(const std::string& model, const std::string& id, float shift = 0);

// One Attend call that gives up `timeout` from now; the answer goes to
// `response` when it is not null.
grpc::Status AttendWithin(v1::AttentionService::Stub& stub, std::chrono::milliseconds timeout,
                          const v1::AttendRequest& request,
                          v1::AttendResponse* response = nullptr);

// The "request" object of a conformance case (tests/conformance/cases) or
// error entry, in the proto's JSON mapping.
absl::StatusOr<v1::AttendRequest> RequestFromJson(const nlohmann::json& json);

// "" when `response` is the right answer to `request` (recomputed with the
// engine, within 1e-5), else what is wrong with it. Knows dot_product and
// the test model gate, which computes as dot_product.
std::string CheckAnswer(const v1::AttendRequest& request, const v1::AttendResponse& response);

}  // namespace attention::testing
