// request_fuzz_target.cc: FuzzAttendRequest, bytes as an AttendRequest.
//
// The path a request takes inside the server, without the network: wire
// bytes -> AttendRequest -> proto adapter -> Validate -> Engine. The tiny
// models are the conformance ones (one of every kind and multi-head layout)
// plus the built-ins; Limits are small so each input runs in microseconds,
// which is also what a server with tight limits does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "attention.pb.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/model/model_loader.h"
#include "core/engine/request.h"
#include "google/protobuf/util/json_util.h"
#include "server/api/attention/attention_adapter.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_targets.h"
#include "tests/fuzz/probe_request.h"

namespace attention::fuzz {
namespace {

constexpr Limits kFuzzLimits{.max_request_elements = 1 << 14};
constexpr float kModerate = 1e3f;

// Validation errors start with the field they are about.
constexpr std::string_view kFields[] = {"queries",      "keys",           "values",
                                        "valid_lens",   "scale",          "request",
                                        "position_ids", "sliding_window", "softcap"};

struct TinyModel {
  Model model;
  std::unique_ptr<ProbeRequest> companion;  // views nothing of model
};

std::map<std::string, TinyModel> LoadTinyModels() {
  std::map<std::string, TinyModel> models;
  const auto add = [&](Model model) {
    auto companion = std::make_unique<ProbeRequest>(model, 1, 2, 3);
    const std::string name = model.name;
    models.emplace(name, TinyModel{std::move(model), std::move(companion)});
  };
  add(DotProductModel());
  add(DistanceModel());
  const std::filesystem::path directory =
      std::filesystem::path(ATTENTION_SOURCE_DIR) / "tests" / "conformance" / "models";
  for (const auto& entry : std::filesystem::directory_iterator(directory)) {
    absl::StatusOr<Model> model = LoadModel(entry.path());
    FUZZ_CHECK(model.ok(), "conformance model does not load: %s",
               std::string(model.status().message()).c_str());
    add(*std::move(model));
  }
  return models;
}

// Below this, every allowed score exceeds the -1e6 given to disallowed ones
// by more than 104, so a disallowed key's weight exp(-1e6 - max) / sum is
// exactly 0 in float32 (the smallest denormal is exp(-103.3)).
constexpr double kScoreBoundForZeroMaskedWeight = 9e5;

// Keys query `i` of example `b` may attend to, [first, end), by the rule
// of docs/api.md, computed here apart from the engine: valid lengths and
// causal bound the end, a sliding window the first.
struct AllowedRange {
  int64_t first = 0, end = 0;
};

AllowedRange AllowedKeys(const AttentionRequest& request, const AttentionDims& dims, int64_t b,
                         int64_t i) {
  int64_t end = dims.num_keys;
  const int64_t num_lens = static_cast<int64_t>(request.valid_lens.size());
  if (num_lens == dims.batch) end = std::min<int64_t>(end, request.valid_lens[b]);
  if (num_lens != dims.batch && num_lens == dims.batch * dims.num_queries) {
    end = std::min<int64_t>(end, request.valid_lens[b * dims.num_queries + i]);
  }
  if (request.causal) end = std::min(end, i + 1);
  const int64_t window = request.sliding_window.value_or(0);
  const int64_t first = window > 0 ? std::max<int64_t>(0, i - window + 1) : 0;
  return {.first = first, .end = end};
}

// An upper bound of |score| for the weightless kinds; infinity for the rest.
double ScoreBound(const Model& model, const AttentionRequest& request, const AttentionDims& dims) {
  const double q = MaxAbs(request.queries.data), k = MaxAbs(ResolvedKeys(request).data);
  const double scale = std::abs(dims.scale), d = static_cast<double>(dims.query_size);
  switch (model.kind) {
    case Kind::kDotProduct:
      return scale * d * q * k;
    case Kind::kDistance:
      return scale * d * (q + k) * (q + k) / 2;
    default:
      return std::numeric_limits<double>::infinity();
  }
}

// Row i of head h of example b of (B, H, n_q, n_k) weights: every key
// outside `allowed` weighs exactly 0.
void CheckMaskedRow(const Tensor& weights, const AttentionDims& dims, int64_t b, int64_t h,
                    int64_t i, AllowedRange allowed) {
  const int64_t row_index = (b * dims.num_heads + h) * dims.num_queries + i;
  const float* row = weights.data.data() + row_index * dims.num_keys;
  for (int64_t j = 0; j < dims.num_keys; ++j) {
    if (j >= allowed.first && j < allowed.end) continue;
    FUZZ_CHECK(row[j] == 0.0f,
               "example %lld head %lld query %lld: disallowed key %lld weighs %g (allowed keys: "
               "[%lld, %lld))",
               (long long)b, (long long)h, (long long)i, (long long)j, row[j],
               (long long)allowed.first, (long long)allowed.end);
  }
}

// Disallowed keys weigh exactly 0 in every row that has an allowed key and
// scores far above -1e6, whatever the values (found by fuzzing: a denormal
// weight times a masked value of 1e37 moved an output by 0.07).
void CheckMaskedWeightsAreZero(const Model& model, const AttentionRequest& request,
                               const AttentionDims& dims, const Tensor& weights) {
  if (ScoreBound(model, request, dims) >= kScoreBoundForZeroMaskedWeight) return;
  for (int64_t b = 0; b < dims.batch; ++b) {
    for (int64_t i = 0; i < dims.num_queries; ++i) {
      const AllowedRange allowed = AllowedKeys(request, dims, b, i);
      if (allowed.first >= allowed.end) continue;  // uniform over all keys instead
      for (int64_t h = 0; h < dims.num_heads; ++h) {
        CheckMaskedRow(weights, dims, b, h, i, allowed);
      }
    }
  }
}

bool Parse(std::span<const uint8_t> bytes, RequestEncoding encoding, v1::AttendRequest* proto) {
  if (encoding == RequestEncoding::kBinaryProto) {
    return proto->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
  }
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return google::protobuf::util::JsonStringToMessage(text, proto).ok();
}

}  // namespace

void FuzzAttendRequest(std::span<const uint8_t> bytes, RequestEncoding encoding) {
  static const std::map<std::string, TinyModel>* const models =
      new std::map<std::string, TinyModel>(LoadTinyModels());
  static Engine engine(EngineOptions{.num_threads = 1});

  v1::AttendRequest proto;
  if (!Parse(bytes, encoding, &proto)) return;  // the gRPC/JSON layer's error
  const auto found = models->find(proto.model());
  if (found == models->end()) return;  // NOT_FOUND before any validation
  const TinyModel& tiny = found->second;

  const AttentionRequest request = server::ToAttentionRequest(proto);
  absl::StatusOr<AttentionDims> dims = Validate(tiny.model, request, kFuzzLimits);
  if (!dims.ok()) {
    const std::string message(dims.status().message());
    FUZZ_CHECK(dims.status().code() == absl::StatusCode::kInvalidArgument,
               "a bad request gave code %d (%s), expected INVALID_ARGUMENT",
               static_cast<int>(dims.status().code()), message.c_str());
    bool names_field = false;
    for (std::string_view field : kFields) names_field |= message.starts_with(field);
    FUZZ_CHECK(names_field, "error does not start with the field: %s", message.c_str());
    return;
  }

  const bool moderate = MaxAbs(request.queries.data) <= kModerate &&
                        MaxAbs(ResolvedKeys(request).data) <= kModerate &&
                        MaxAbs(ResolvedValues(request).data) <= kModerate &&
                        (!request.scale || std::abs(*request.scale) <= kModerate);
  CheckAnswer(engine, tiny.model, request, *dims, tiny.companion->request(), moderate);
  if (request.return_attention_weights && tiny.model.kind != Kind::kMultiHead) {
    absl::StatusOr<AttentionResult> result = engine.Attend(tiny.model, request);
    CheckMaskedWeightsAreZero(tiny.model, request, *dims, result->attention_weights);
  }
}

}  // namespace attention::fuzz
