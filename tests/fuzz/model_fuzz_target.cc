// model_fuzz_target.cc: FuzzModelFile, bytes as a safetensors model file.
//
// Model files come from operators' repositories, so the loader is the first
// thing hostile bytes reach. Besides "no crash", a model the loader accepts
// must be self-consistent (weights shaped as its sizes say) and must answer a
// request of those sizes: a loader that accepts what the engine cannot run
// would take the server down at the first request instead of at load time.
#include <algorithm>
#include <cstdint>
#include <span>
#include <string>

#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/model/model_loader.h"
#include "core/engine/request.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/fuzz_targets.h"
#include "tests/fuzz/probe_request.h"

namespace attention::fuzz {
namespace {

// Larger sizes are valid but make each input slow; the loader has run by then.
constexpr int64_t kMaxProbeSize = 4096;
constexpr float kModerate = 1e3f;

bool Shaped(const RowMatrix& m, int64_t rows, int64_t cols) {
  return m.rows() == rows && m.cols() == cols;
}

void CheckModel(const Model& model) {
  switch (model.kind) {
    case Kind::kDotProduct:
    case Kind::kDistance:
      FUZZ_CHECK(model.query_size == 0 && model.key_size == 0 && model.w_q.size() == 0 &&
                     model.w_k.size() == 0,
                 "a weightless kind came with sizes or weights");
      break;
    case Kind::kAdditive: {
      const int64_t hidden = model.w_q.rows();
      FUZZ_CHECK(hidden > 0 && model.query_size > 0 && model.key_size > 0, "additive sizes");
      FUZZ_CHECK(Shaped(model.w_q, hidden, model.query_size) &&
                     Shaped(model.w_k, hidden, model.key_size) && Shaped(model.w_v, 1, hidden),
                 "additive weights [%lld, %lld] [%lld, %lld] [%lld, %lld] for d_q %lld, d_k %lld",
                 (long long)model.w_q.rows(), (long long)model.w_q.cols(),
                 (long long)model.w_k.rows(), (long long)model.w_k.cols(),
                 (long long)model.w_v.rows(), (long long)model.w_v.cols(),
                 (long long)model.query_size, (long long)model.key_size);
      break;
    }
    case Kind::kBilinear:
      FUZZ_CHECK(model.query_size > 0 && model.key_size > 0 &&
                     Shaped(model.w_k, model.query_size, model.key_size),
                 "bilinear W_k [%lld, %lld] for d_q %lld, d_k %lld", (long long)model.w_k.rows(),
                 (long long)model.w_k.cols(), (long long)model.query_size,
                 (long long)model.key_size);
      break;
    case Kind::kMultiHead: {
      const int64_t width = model.output_size;
      FUZZ_CHECK(model.num_heads > 0 && width > 0 && width % model.num_heads == 0,
                 "multi_head with %lld heads and width %lld", (long long)model.num_heads,
                 (long long)width);
      FUZZ_CHECK(Shaped(model.w_q, width, model.query_size) &&
                     Shaped(model.w_k, width, model.key_size) &&
                     Shaped(model.w_v, width, model.value_size) && Shaped(model.w_o, width, width),
                 "multi_head projections do not match E %lld, d_q %lld, d_k %lld, d_v %lld",
                 (long long)width, (long long)model.query_size, (long long)model.key_size,
                 (long long)model.value_size);
      FUZZ_CHECK(model.b_q.size() == width && model.b_k.size() == width &&
                     model.b_v.size() == width && model.b_o.size() == width,
                 "multi_head biases are not of size E %lld", (long long)width);
      break;
    }
  }
}

float MaxAbsWeight(const Model& model) {
  float max = 0;
  for (const RowMatrix* m : {&model.w_q, &model.w_k, &model.w_v, &model.w_o}) {
    max = std::max(max, MaxAbs({m->data(), static_cast<size_t>(m->size())}));
  }
  for (const Vector* v : {&model.b_q, &model.b_k, &model.b_v, &model.b_o}) {
    max = std::max(max, MaxAbs({v->data(), static_cast<size_t>(v->size())}));
  }
  return max;
}

}  // namespace

void FuzzModelFile(std::span<const uint8_t> bytes) {
  absl::StatusOr<Model> model = ParseModel("fuzz", bytes);
  if (!model.ok()) {
    const std::string message(model.status().message());
    FUZZ_CHECK(model.status().code() == absl::StatusCode::kInvalidArgument,
               "a bad file gave code %d (%s), expected INVALID_ARGUMENT",
               static_cast<int>(model.status().code()), message.c_str());
    FUZZ_CHECK(message.starts_with("fuzz.safetensors: ") && message.size() > 18,
               "error does not name the file: %s", message.c_str());
    return;
  }
  // A multi_head model holds its weights only packed; the checks read them
  // row-major, rebuilt.
  Model unpacked = *model;
  UnpackProjections(unpacked);
  CheckModel(unpacked);
  for (int64_t size : {model->query_size, model->key_size, model->value_size, model->output_size}) {
    if (size > kMaxProbeSize) return;
  }

  static Engine engine(EngineOptions{.num_threads = 1});
  const ProbeRequest probe(*model, 2, 3, 4);
  const ProbeRequest companion(*model, 1, 2, 2);
  absl::StatusOr<AttentionDims> dims = Validate(*model, probe.request());
  FUZZ_CHECK(dims.ok(), "a loaded model rejects a request of its own sizes: %s",
             std::string(dims.status().message()).c_str());
  CheckAnswer(engine, *model, probe.request(), *dims, companion.request(),
              MaxAbsWeight(unpacked) <= kModerate);
}

}  // namespace attention::fuzz
