// inference_request.cc: AttendRequest -> ModelInferRequest.
#include "client/cli/inference_request.h"

#include <bit>
#include <string>

namespace attention::client {
namespace {

static_assert(std::endian::native == std::endian::little,
              "raw tensor contents are little-endian and copied as they are");

template <typename Repeated>
std::string RawBytes(const Repeated& values) {
  return std::string(reinterpret_cast<const char*>(values.data()),
                     static_cast<size_t>(values.size()) * sizeof(values[0]));
}

void AddFloatInput(const char* name, const attention::v1::Tensor& tensor,
                   inference::ModelInferRequest* infer) {
  auto* input = infer->add_inputs();
  input->set_name(name);
  input->set_datatype("FP32");
  input->mutable_shape()->CopyFrom(tensor.shape());
  infer->add_raw_input_contents(RawBytes(tensor.data()));
}

}  // namespace

inference::ModelInferRequest ToModelInferRequest(const attention::v1::AttendRequest& request) {
  inference::ModelInferRequest infer;
  infer.set_model_name(request.model());
  infer.set_id(request.request_id());
  AddFloatInput("queries", request.queries(), &infer);
  if (request.has_keys()) AddFloatInput("keys", request.keys(), &infer);
  if (request.has_values()) AddFloatInput("values", request.values(), &infer);
  if (!request.valid_lens().empty()) {
    auto* input = infer.add_inputs();
    input->set_name("valid_lens");
    input->set_datatype("INT32");
    input->add_shape(request.valid_lens_size());
    infer.add_raw_input_contents(RawBytes(request.valid_lens()));
  }
  if (!request.position_ids().empty()) {
    auto* input = infer.add_inputs();
    input->set_name("position_ids");
    input->set_datatype("INT64");
    // [B, n_q] when there is one per query, else [n_q] (every example's).
    const auto& queries = request.queries().shape();
    const int64_t count = request.position_ids_size();
    if (queries.size() >= 2 && queries[0] * queries[1] == count) {
      for (int64_t size : {queries[0], queries[1]}) input->add_shape(size);
    } else {
      input->add_shape(count);
    }
    infer.add_raw_input_contents(RawBytes(request.position_ids()));
  }
  auto& parameters = *infer.mutable_parameters();
  if (request.causal()) parameters["causal"].set_bool_param(true);
  if (request.has_scale()) parameters["scale"].set_double_param(request.scale());
  if (request.has_sliding_window()) {
    parameters["sliding_window"].set_int64_param(request.sliding_window());
  }
  if (request.has_softcap()) parameters["softcap"].set_double_param(request.softcap());
  if (request.return_attention_weights()) {
    parameters["return_attention_weights"].set_bool_param(true);
  }
  return infer;
}

}  // namespace attention::client
