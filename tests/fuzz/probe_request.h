// probe_request.h: small valid requests and the checks every answer must
// pass, shared by the fuzz targets.
//
// A ProbeRequest is the request a correct model must always be able to
// answer: sizes taken from the model (2 where it accepts any), values from a
// fixed pattern in [-1, 1]. CheckAnswer holds what docs/api.md promises of
// any valid request, whatever its values: the validated output shape, weight
// rows that sum to 1, finite numbers in every answer with status OK (a refusal
// only for an answer with no float32 form, never for moderate inputs), and
// the same answer alone as inside a batch.
#pragma once

#include <cstdint>
#include <vector>

#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/engine/request.h"

namespace attention::fuzz {

class ProbeRequest {
 public:
  // (batch, num_queries, d_q) queries and (batch, num_keys, d_k/d_v) keys and
  // values, with every example's valid length set.
  ProbeRequest(const Model& model, int64_t batch, int64_t num_queries, int64_t num_keys);
  ProbeRequest(const ProbeRequest&) = delete;
  ProbeRequest& operator=(const ProbeRequest&) = delete;

  const AttentionRequest& request() const { return request_; }

 private:
  std::vector<float> queries_, keys_, values_;  // viewed by request_
  std::vector<int32_t> valid_lens_;
  AttentionRequest request_;
};

// Largest absolute value of `values` (0 when empty).
float MaxAbs(std::span<const float> values);

// Runs `request`, which passed Validate() with `dims`, through `engine`
// alone and batched after `companion` (a valid request for the same model),
// and aborts if the answer breaks a promise. `moderate` says the request's
// values, scale and the model's weights are small enough (|x| <= 1e3) that
// the answer must not be refused and batching must change it by at most the
// 1e-5 of docs/api.md (scores of larger inputs depend on summation order).
void CheckAnswer(Engine& engine, const Model& model, const AttentionRequest& request,
                 const AttentionDims& dims, const AttentionRequest& companion, bool moderate);

}  // namespace attention::fuzz
