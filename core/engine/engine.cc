// engine.cc: the Engine: a batch shaped into results, cut into groups of
// bounded size, each group run by its kind's runner, and each answer
// checked.
//
// A batch runs as consecutive groups of requests (kGroupFloats); every kind
// runs a group in at most three parallel phases over all its requests
// (core/engine/runners.h):
//   1. projections: row blocks of x W^T (+ b) for every request at once
//      (multi_head, additive, bilinear; core/engine/projection.h); no padding, rows
//      are all real tokens;
//   2. attention: one task per (request, example, head, query block), each
//      bounded by its queries' allowed keys (core/engine/attention_tasks.h);
//   3. output projection (multi_head).
// Tasks are handed out dynamically, so short or causal rows balance out.
// A request with a StopCheck is polled between blocks of its work (its
// RequestStop, core/engine/request_stop.h); once stopped, its remaining tasks
// return at once.
#include "core/engine/engine.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/kernels/blas.h"
#include "core/kernels/finite.h"
#include "core/engine/group_scratch.h"
#include "core/huge_pages.h"
#include "core/engine/request_stop.h"
#include "core/engine/runners.h"
#include "core/thread_pool.h"

namespace attention {
namespace {

using internal::RequestStop;
using internal::Stops;

// Most floats of token rows one group holds (GroupFloats: query + key rows
// times the widest row): 2 MiB, 2,048 token rows of multi_head E=256, i.e. 32
// small (B=1 n=32) or one large (B=8 n=128) request. Scratch then stays a few
// MiB whatever the batch (about four buffers of this size: stacked inputs,
// projections, concatenated heads, stacked output), in cache between phases
// and reused run after run, where one execution over the whole batch would
// grow every buffer with it. This bound keeps a large request whole, whose
// 1,024 query rows already fill 256-row GEMM blocks, so merging more only
// adds copies, and 32 small ones fill four such blocks (BENCHMARKS.md,
// "Memory").
constexpr int64_t kGroupFloats = int64_t{1} << 19;

// Work below which a group runs on the calling thread (EngineOptions::
// serial_work): 2^21 units, about an eighth of kStopPollWork's millisecond.
// A one-token step of E=512 (about 2^20 units) fits, and so does a batch of
// trivial requests; a token of E=1024 (2^22) still spreads over the pool.
// Each parallel phase wakes a worker and waits for it, a few microseconds
// of CPU on each side, which below this is a large part of the compute.
constexpr double kSerialWork = double{1 << 21};

// A request's share of a group's bound: its query and key rows times the
// widest row any stacked buffer holds for it (inputs, a projection to E or to
// additive's h, or the output).
int64_t GroupFloats(const Model& model, const AttentionDims& d) {
  const int64_t widest = std::max({d.query_size, d.key_size, d.value_size, d.output_size,
                                   static_cast<int64_t>(model.w_q.rows())});
  return d.batch * (d.num_queries + d.num_keys) * widest;
}

void RunGroup(ThreadPool& pool, const Model& model, std::span<const ValidatedRequest> requests,
              std::span<AttentionResult> results, Stops stops) {
  switch (model.kind) {
    case Kind::kDotProduct:
    case Kind::kDistance:
    case Kind::kBilinear:
      internal::RunDotProductFamily(pool, model, requests, results, stops);
      break;
    case Kind::kAdditive:
      internal::RunAdditive(pool, model, requests, results, stops);
      break;
    case Kind::kMultiHead:
      internal::RunMultiHead(pool, model, requests, results, stops);
      break;
  }
}

// A zero output of the request's shape, and zero weights if it asks for them.
void ShapeResult(const Model& model, const ValidatedRequest& v, AttentionResult& result) {
  const AttentionDims& d = v.dims;
  result.output.shape = d.grouped ? std::vector<int64_t>{d.batch, d.num_queries, d.num_heads,
                                                         d.value_size}
                                   : std::vector<int64_t>{d.batch, d.num_queries, d.output_size};
  AssignOnHugePages(result.output.data, static_cast<size_t>(d.output_elements()), 0.0f);
  result.status = absl::OkStatus();
  if (!v.request->return_attention_weights) {
    result.attention_weights = {};
    return;
  }
  result.attention_weights.shape =
      model.kind == Kind::kMultiHead || d.grouped
          ? std::vector<int64_t>{d.batch, d.num_heads, d.num_queries, d.num_keys}
          : std::vector<int64_t>{d.batch, d.num_queries, d.num_keys};
  AssignOnHugePages(result.attention_weights.data, static_cast<size_t>(d.weight_elements()), 0.0f);
}

float LargestMagnitude(const TensorView& t) {
  float largest = 0;
  for (float x : t.data) largest = std::max(largest, std::abs(x));
  return largest;
}

// OK when the answer is finite. The kernels recompute overflowing score
// rows in double, so what is left is a finite request whose answer itself
// overflows float32 (projections or sums of huge weights and inputs):
// refused rather than answered with inf or NaN.
absl::Status CheckFinite(const Model& model, const ValidatedRequest& v,
                         const AttentionResult& result) {
  for (const auto& [name, tensor] : {std::pair<const char*, const Tensor*>{"output", &result.output},
                                    {"attention_weights", &result.attention_weights}}) {
    if (const int64_t at = FirstNonFinite(tensor->data); at >= 0) {
      const AttentionRequest& request = *v.request;
      const float largest = std::max({LargestMagnitude(request.queries),
                                      LargestMagnitude(ResolvedKeys(request)),
                                      LargestMagnitude(ResolvedValues(request))});
      return absl::InvalidArgumentError(absl::StrCat(
          name, "[", at, "]: expected a finite value, got ", tensor->data[at],
          ": the request overflows float32 on model '", model.name, "' (scale ", v.dims.scale,
          ", largest input magnitude ", largest, "); send a smaller scale or smaller values"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Engine::Engine(EngineOptions options)
    : pool_(std::make_unique<ThreadPool>(options.num_threads)),
      serial_(std::make_unique<ThreadPool>(1)),
      scratch_(std::make_unique<internal::ScratchPool>()),
      max_group_floats_(options.max_group_floats > 0 ? options.max_group_floats : kGroupFloats),
      serial_work_(options.serial_work != 0 ? options.serial_work : kSerialWork),
      split_keys_(options.split_keys) {
  RunBlasOnCallingThread();
}

Engine::~Engine() = default;

int Engine::num_threads() const { return pool_->num_threads(); }

int64_t Engine::kept_scratch_bytes() const { return scratch_->Bytes(); }

ThreadPool& Engine::PoolFor(double work) const { return work < serial_work_ ? *serial_ : *pool_; }

absl::StatusOr<AttentionResult> Engine::Attend(const Model& model, const AttentionRequest& request,
                                               const Limits& limits) {
  absl::StatusOr<AttentionDims> dims = Validate(model, request, limits);
  if (!dims.ok()) return dims.status();
  const ValidatedRequest validated{&request, *dims, {}};
  AttentionResult result;
  Run(model, {&validated, 1}, {&result, 1});
  if (!result.status.ok()) return result.status;
  return result;
}

void Engine::Run(const Model& model, std::span<const ValidatedRequest> requests,
                 std::span<AttentionResult> results) {
  for (size_t r = 0; r < requests.size(); ++r) ShapeResult(model, requests[r], results[r]);
  // A stop only for requests long enough to be polled at all.
  std::deque<RequestStop> stop_storage;
  std::vector<RequestStop*> stops(requests.size(), nullptr);
  for (size_t r = 0; r < requests.size(); ++r) {
    if (requests[r].stop && RequestWork(model, requests[r].dims) >= kStopPollWork) {
      stops[r] = &stop_storage.emplace_back(requests[r].stop);
    }
  }
  // Each group as one execution over the whole pool, in the engine's kept
  // buffers; a request over the bound is a group of its own.
  const internal::ScratchPool::Lease lease(*scratch_);
  for (size_t begin = 0; begin < requests.size();) {
    int64_t floats = GroupFloats(model, requests[begin].dims);
    double work = RequestWork(model, requests[begin].dims);
    size_t end = begin + 1;
    while (end < requests.size() &&
           floats + GroupFloats(model, requests[end].dims) <= max_group_floats_) {
      floats += GroupFloats(model, requests[end].dims);
      work += RequestWork(model, requests[end++].dims);
    }
    RunGroup(PoolFor(work), model, requests.subspan(begin, end - begin),
             results.subspan(begin, end - begin), Stops(stops).subspan(begin, end - begin));
    begin = end;
  }
  for (size_t r = 0; r < requests.size(); ++r) {
    absl::Status status = stops[r] != nullptr ? stops[r]->why() : absl::OkStatus();
    if (status.ok()) status = CheckFinite(model, requests[r], results[r]);
    if (!status.ok()) results[r] = {.output = {}, .attention_weights = {}, .status = status};
  }
}

}  // namespace attention
