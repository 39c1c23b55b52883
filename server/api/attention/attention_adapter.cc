// attention_adapter.cc: AttendRequest <-> engine types, absl::Status -> grpc::Status.
#include "server/api/attention/attention_adapter.h"

#include <span>
#include <string>
#include <vector>

namespace attention::server {
namespace {

TensorView View(const v1::Tensor& tensor) {
  return TensorView{std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end()),
                    std::span<const float>(tensor.data().data(), tensor.data().size())};
}

void ToProto(const Tensor& tensor, v1::Tensor* proto) {
  proto->mutable_shape()->Assign(tensor.shape.begin(), tensor.shape.end());
  proto->mutable_data()->Assign(tensor.data.begin(), tensor.data.end());
}

}  // namespace

AttentionRequest ToAttentionRequest(const v1::AttendRequest& proto) {
  AttentionRequest request;
  request.queries = View(proto.queries());
  if (proto.has_keys()) request.keys = View(proto.keys());
  if (proto.has_values()) request.values = View(proto.values());
  request.valid_lens =
      std::span<const int32_t>(proto.valid_lens().data(), proto.valid_lens().size());
  request.causal = proto.causal();
  request.return_attention_weights = proto.return_attention_weights();
  if (proto.has_scale()) request.scale = proto.scale();
  request.position_ids =
      std::span<const int64_t>(proto.position_ids().data(), proto.position_ids().size());
  if (proto.has_sliding_window()) request.sliding_window = proto.sliding_window();
  if (proto.has_softcap()) request.softcap = proto.softcap();
  return request;
}

SessionOpen ToSessionOpen(const v1::SessionOpen& proto) {
  SessionOpen open;
  open.memory = proto.memory() == v1::SESSION_MEMORY_CROSS ? SessionMemory::kCross
                                                            : SessionMemory::kSelf;
  open.batch = proto.batch() == 0 ? 1 : proto.batch();
  if (proto.has_keys()) open.keys = View(proto.keys());
  if (proto.has_values()) open.values = View(proto.values());
  open.valid_lens = std::span<const int32_t>(proto.valid_lens().data(), proto.valid_lens().size());
  if (proto.has_scale()) open.scale = proto.scale();
  open.sliding_window = proto.sliding_window();
  open.softcap = proto.softcap();
  return open;
}

SessionStep ToSessionStep(const v1::SessionStep& proto) {
  SessionStep step;
  step.queries = View(proto.queries());
  step.return_attention_weights = proto.return_attention_weights();
  if (proto.has_keys()) step.keys = View(proto.keys());
  if (proto.has_values()) step.values = View(proto.values());
  return step;
}

void ToSessionResponse(const AttentionResult& result, v1::SessionResponse* response) {
  ToProto(result.output, response->mutable_output());
  if (!result.attention_weights.shape.empty()) {
    ToProto(result.attention_weights, response->mutable_attention_weights());
  }
}

void ToAttendResponse(const AttentionResult& result, v1::AttendResponse* response) {
  ToProto(result.output, response->mutable_output());
  if (!result.attention_weights.shape.empty()) {
    ToProto(result.attention_weights, response->mutable_attention_weights());
  }
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

v1::ModelInfo ToModelInfo(const Model& model) {
  v1::ModelInfo info;
  info.set_name(model.name);
  info.set_kind(std::string(KindName(model.kind)));
  info.set_num_heads(model.num_heads);
  info.set_query_size(model.query_size);
  info.set_key_size(model.key_size);
  info.set_value_size(model.value_size);
  info.set_output_size(model.output_size);
  info.set_precision(std::string(PrecisionName(model.precision)));
  info.set_kv_cache_dtype(
      std::string(KvDtypeName(model.kv_cache_dtype.value_or(KvDtype::kFloat32))));
  if (model.kind == Kind::kMultiHead) {
    info.set_num_kv_heads(KvHeads(model));
    info.set_head_dim(HeadSize(model));
  }
  const LayerTerms& terms = model.terms;
  if (terms.rotary.dims > 0) {
    info.set_rope_type(terms.rotary.type);
    info.set_rope_theta(terms.rotary.theta);
    info.set_rope_interleaved(terms.rotary.interleaved);
    info.set_rotary_dim(terms.rotary.dims);
  }
  info.set_sliding_window(terms.sliding_window);
  info.set_softcap(terms.softcap);
  info.set_alibi(!terms.alibi_slopes.empty());
  info.set_sinks(!terms.sinks.empty());
  return info;
}

}  // namespace attention::server
