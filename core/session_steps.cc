// session_steps.cc: Engine::RunSteps (core/session.h): the steps of many
// decoding sessions of one model as one execution, as Engine::Run computes a
// group of requests:
//   1. every self session takes the blocks its step's rows need (all or none);
//   2. multi_head: one GEMM per projection over the new rows of every step
//      (queries of all steps; keys and values of the self steps), and the new
//      keys and values appended to their sessions' blocks;
//   3. attention: one task per (step, example, head, query tile), the keys
//      and values read from the blocks;
//   4. multi_head: one output projection over the heads of every step.
// Cross memory of the kinds whose scores do not read the held rows as they
// are (distance, bilinear, additive) runs as an Attend() request over a copy
// of them. A step that fails gives its blocks back and leaves its session's
// length as it was.
#include <algorithm>
#include <deque>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/attention_tasks.h"
#include "core/engine.h"
#include "core/finite.h"
#include "core/group_scratch.h"
#include "core/projection.h"
#include "core/request_stop.h"
#include "core/session_state.h"
#include "core/thread_pool.h"

namespace attention {
namespace {

using internal::AttentionTask;
using internal::Projection;
using internal::RequestStop;

// One step as this run sees it.
struct StepRun {
  const ValidatedStep* step;
  Session::State* state;
  AttentionResult* result;
  RequestStop* stop = nullptr;
  int64_t first_row = 0;  // of its query rows in the stacking of every paged step's
  // Self memory: query i of the step sees keys [0, length + i + 1).
  std::vector<int32_t> causal_lens;

  const TensorView& queries() const { return step->step->queries; }
  const AttentionDims& dims() const { return step->dims; }
  int64_t rows() const { return dims().batch * dims().num_queries; }
  bool self() const { return state->memory == SessionMemory::kSelf; }
};

// A zero output of the step's shape, and zero weights if it asks for them.
void ShapeResult(const Model& model, const ValidatedStep& step, AttentionResult& result) {
  const AttentionDims& d = step.dims;
  result = {};
  result.output.shape = {d.batch, d.num_queries, d.output_size};
  result.output.data.assign(d.output_elements(), 0.0f);
  if (!step.step->return_attention_weights) return;
  result.attention_weights.shape =
      model.kind == Kind::kMultiHead
          ? std::vector<int64_t>{d.batch, d.num_heads, d.num_queries, d.num_keys}
          : std::vector<int64_t>{d.batch, d.num_queries, d.num_keys};
  result.attention_weights.data.assign(d.weight_elements(), 0.0f);
}

// Self memory: the blocks for the step's rows (a dot_product session's
// first step also fixes its row width).
absl::Status BeginStep(StepRun& run) {
  Session::State& state = *run.state;
  if (!run.self()) return absl::OkStatus();
  if (state.key_width == 0) {
    state.key_width = state.value_width = state.key_size = state.value_size =
        run.dims().query_size;
  }
  const absl::Status status = state.Reserve(state.length + run.dims().num_queries);
  if (!status.ok()) state.Rollback();
  run.causal_lens.resize(run.dims().num_queries);
  for (size_t i = 0; i < run.causal_lens.size(); ++i) {
    run.causal_lens[i] = static_cast<int32_t>(state.length + static_cast<int64_t>(i) + 1);
  }
  return status;
}

// One example's keys and values gathered into contiguous rows.
struct GatheredMemory {
  std::vector<float> keys, values;
};

void GatherRows(const internal::BlockRows& memory, int64_t rows, int64_t width, float* out) {
  for (int64_t first = 0; first < rows; first += kKvBlockRows) {
    std::copy_n(memory.Row(first, width), std::min(kKvBlockRows, rows - first) * width,
                out + first * width);
  }
}

GatheredMemory& Gather(const Session::State& state, int64_t b, int64_t rows,
                       std::deque<GatheredMemory>& storage) {
  GatheredMemory& memory = storage.emplace_back();
  memory.keys.resize(rows * state.key_width);
  GatherRows(state.keys[b], rows, state.key_width, memory.keys.data());
  if (state.values_are_keys) return memory;
  memory.values.resize(rows * state.value_width);
  GatherRows(state.values[b], rows, state.value_width, memory.values.data());
  return memory;
}

// Keys and values of example b from column `column` of the session's rows.
void SetMemory(FlashProblem& p, const Session::State& state, int64_t b, int64_t column,
               std::deque<GatheredMemory>& storage) {
  const GatheredMemory& memory = Gather(state, b, p.num_keys, storage);
  p.keys = memory.keys.data() + column;
  p.values = (state.values_are_keys ? memory.keys : memory.values).data() + column;
  p.key_stride = state.key_width;
  p.value_stride = state.value_width;
}

// The bounds of example b: causal from the session's length (self), or its
// valid length (cross).
KeyBounds BoundsOf(const StepRun& run, int64_t b) {
  KeyBounds bounds;
  if (run.self()) {
    bounds.valid_lens = run.causal_lens.data();
  } else if (!run.state->valid_lens.empty()) {
    bounds.valid_len = run.state->valid_lens[b];
  }
  return bounds;
}

// The buffers of one run of paged steps: multi_head's projections, side by
// side per row (q, then k and v of self steps: rows of 3E), the heads
// concatenated, and the output before it is split into results.
struct PagedScratch {
  const float* inputs = nullptr;  // (rows x d_q), every step's queries stacked
  float* qkv = nullptr;
  float* concat = nullptr;
  float* output = nullptr;
  int64_t width = 0;  // E
};

PagedScratch PlanScratch(const Model& model, std::span<StepRun> runs, std::vector<float>& once) {
  int64_t rows = 0;
  for (StepRun& run : runs) {
    run.first_row = rows;
    rows += run.rows();
  }
  PagedScratch s;
  s.width = model.output_size;
  const bool stacked = runs.size() > 1;
  const int64_t d_q = runs[0].dims().query_size;
  const auto [inputs, qkv, concat, output] = internal::GroupScratch<4>(
      {stacked ? rows * d_q : 0, rows * 3 * s.width, rows * s.width, stacked ? rows * s.width : 0},
      once);
  s.qkv = qkv;
  s.concat = concat;
  s.output = output;
  s.inputs = stacked ? inputs : runs[0].queries().data.data();
  if (stacked) {
    for (const StepRun& run : runs) {
      std::copy(run.queries().data.begin(), run.queries().data.end(),
                inputs + run.first_row * d_q);
    }
  }
  return s;
}

// Queries of every step, keys and values of the self steps (consecutive
// self steps as one product), in one parallel phase.
void ProjectInputs(ThreadPool& pool, const Model& model, const PagedScratch& s,
                   std::span<const StepRun> runs) {
  const int64_t stride = 3 * s.width, d_q = runs[0].dims().query_size;
  int64_t rows = 0;
  for (const StepRun& run : runs) rows += run.rows();
  std::vector<Projection> projections = {
      {s.inputs, s.qkv, rows, &model.w_q, &model.b_q, true, &model.packed_q, stride}};
  for (size_t r = 0; r < runs.size();) {
    if (!runs[r].self()) {
      ++r;
      continue;
    }
    const int64_t first = runs[r].first_row;
    int64_t count = 0;
    for (; r < runs.size() && runs[r].self(); ++r) count += runs[r].rows();
    const float* in = s.inputs + first * d_q;
    float* out = s.qkv + first * stride;
    projections.push_back(
        {in, out + s.width, count, &model.w_k, &model.b_k, true, &model.packed_k, stride});
    projections.push_back(
        {in, out + 2 * s.width, count, &model.w_v, &model.b_v, true, &model.packed_v, stride});
  }
  internal::RunProjections(pool, projections, runs.size() == 1 ? runs[0].stop : nullptr);
}

// A self step's new keys and values into its blocks, after the session's
// length: `keys` and `values` (rows of the step, row stride `stride`).
void Append(const StepRun& run, const float* keys, const float* values, int64_t stride) {
  Session::State& state = *run.state;
  const int64_t n = run.dims().num_queries;
  for (int64_t b = 0; b < state.batch; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = (b * n + i) * stride;
      std::copy_n(keys + row, state.key_width, state.keys[b].Row(state.length + i,
                                                                  state.key_width));
      if (state.values_are_keys) continue;
      std::copy_n(values + row, state.value_width,
                  state.values[b].Row(state.length + i, state.value_width));
    }
  }
}

FlashProblem BaseProblem(const Model& model, const StepRun& run) {
  FlashProblem p;
  p.num_queries = run.dims().num_queries;
  p.num_keys = run.dims().num_keys;
  p.scale = run.dims().scale;
  p.precision = model.precision;
  p.stop = run.stop;
  return p;
}

// multi_head: one problem per (step, example, head), on the projections.
void AddHeadTasks(const Model& model, const PagedScratch& s, StepRun& run,
                  std::deque<FlashProblem>& problems, std::deque<GatheredMemory>& memory,
                  std::vector<AttentionTask>& tasks) {
  const int64_t heads = model.num_heads, head_size = s.width / heads;
  const int64_t n = run.dims().num_queries;
  for (int64_t b = 0; b < run.dims().batch; ++b) {
    const int64_t row = run.first_row + b * n;
    for (int64_t h = 0; h < heads; ++h) {
      FlashProblem& p = problems.emplace_back(BaseProblem(model, run));
      p.queries = s.qkv + row * 3 * s.width + h * head_size;
      p.query_stride = 3 * s.width;
      p.output = s.concat + row * s.width + h * head_size;
      p.output_stride = s.width;
      p.head_size = p.value_size = head_size;
      p.bounds = BoundsOf(run, b);
      SetMemory(p, *run.state, b, h * head_size, memory);
      internal::AddTasks(p, internal::WeightsOf(*run.result, b * heads + h, run.dims()), tasks);
    }
  }
}

// dot_product: one problem per (step, example), on the step's queries.
void AddExampleTasks(const Model& model, StepRun& run, std::deque<FlashProblem>& problems,
                     std::deque<GatheredMemory>& memory, std::vector<AttentionTask>& tasks) {
  const AttentionDims& d = run.dims();
  for (int64_t b = 0; b < d.batch; ++b) {
    FlashProblem& p = problems.emplace_back(BaseProblem(model, run));
    p.queries = run.queries().data.data() + b * d.num_queries * d.query_size;
    p.query_stride = d.query_size;
    p.output = run.result->output.data.data() + b * d.num_queries * d.value_size;
    p.output_stride = d.value_size;
    p.head_size = d.key_size;
    p.value_size = d.value_size;
    p.bounds = BoundsOf(run, b);
    SetMemory(p, *run.state, b, 0, memory);
    internal::AddTasks(p, internal::WeightsOf(*run.result, b, d), tasks);
  }
}

// The output projection of every step's heads, into its result.
void ProjectOutput(ThreadPool& pool, const Model& model, const PagedScratch& s,
                   std::span<const StepRun> runs) {
  int64_t rows = 0;
  for (const StepRun& run : runs) rows += run.rows();
  float* out = runs.size() == 1 ? runs[0].result->output.data.data() : s.output;
  internal::RunProjections(
      pool, {{s.concat, out, rows, &model.w_o, &model.b_o, true, &model.packed_o}},
      runs.size() == 1 ? runs[0].stop : nullptr);
  if (runs.size() == 1) return;
  for (const StepRun& run : runs) {
    std::copy_n(s.output + run.first_row * s.width, run.result->output.data.size(),
                run.result->output.data.begin());
  }
}

// multi_head and dot_product steps: every session's memory read from its
// blocks.
void RunPaged(ThreadPool& pool, const Model& model, std::span<StepRun> runs) {
  if (runs.empty()) return;
  const bool multi_head = model.kind == Kind::kMultiHead;
  std::vector<float> once;
  PagedScratch s;
  if (multi_head) {
    s = PlanScratch(model, runs, once);
    ProjectInputs(pool, model, s, runs);
  }
  for (const StepRun& run : runs) {
    if (!run.self()) continue;
    if (multi_head) {
      const float* row = s.qkv + run.first_row * 3 * s.width;
      Append(run, row + s.width, row + 2 * s.width, 3 * s.width);
    } else {
      Append(run, run.queries().data.data(), nullptr, run.dims().query_size);
    }
  }
  std::deque<FlashProblem> problems;
  std::deque<GatheredMemory> memory;
  std::vector<AttentionTask> tasks;
  for (StepRun& run : runs) {
    if (multi_head) {
      AddHeadTasks(model, s, run, problems, memory, tasks);
    } else {
      AddExampleTasks(model, run, problems, memory, tasks);
    }
  }
  internal::RunAttention(pool, tasks);
  if (multi_head) ProjectOutput(pool, model, s, runs);
}

// Cross memory of distance, bilinear and additive: an Attend() request over
// a copy of the keys and values held.
void RunGathered(Engine& engine, const Model& model, const StepRun& run) {
  const Session::State& state = *run.state;
  const AttentionDims& d = run.dims();
  std::vector<float> keys(d.batch * d.num_keys * state.key_width);
  std::vector<float> values(d.batch * d.num_keys * state.value_width);
  for (int64_t b = 0; b < d.batch; ++b) {
    GatherRows(state.keys[b], d.num_keys, state.key_width,
               keys.data() + b * d.num_keys * state.key_width);
    GatherRows(state.values[b], d.num_keys, state.value_width,
               values.data() + b * d.num_keys * state.value_width);
  }
  const AttentionRequest request{
      .queries = run.queries(),
      .keys = TensorView{{d.batch, d.num_keys, state.key_width}, keys},
      .values = TensorView{{d.batch, d.num_keys, state.value_width}, values},
      .valid_lens = state.valid_lens,
      .causal = false,
      .return_attention_weights = run.step->step->return_attention_weights,
      .scale = d.scale};
  const ValidatedRequest validated{&request, d, run.step->stop};
  engine.Run(model, {&validated, 1}, {run.result, 1});
}

// OK when the step's answer is finite (as Engine::Run checks its requests').
absl::Status CheckFinite(const Model& model, const StepRun& run) {
  for (const Tensor* tensor : {&run.result->output, &run.result->attention_weights}) {
    if (const int64_t at = FirstNonFinite(tensor->data); at >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          tensor == &run.result->output ? "output" : "attention_weights", "[", at,
          "]: expected a finite value, got ", tensor->data[at],
          ": the step overflows float32 on model '", model.name, "' (scale ", run.dims().scale,
          "); send a smaller scale or smaller values"));
    }
  }
  return absl::OkStatus();
}

// The step's status; its session grows by the step if OK, else is as before.
void FinishStep(const Model& model, StepRun& run) {
  absl::Status status = run.result->status;
  if (status.ok() && run.stop != nullptr) status = run.stop->why();
  if (status.ok()) status = CheckFinite(model, run);
  if (!status.ok()) {
    *run.result = {.output = {}, .attention_weights = {}, .status = status};
    run.state->Rollback();
    return;
  }
  if (run.self()) run.state->length += run.dims().num_queries;
}

}  // namespace

void Engine::RunSteps(std::span<const ValidatedStep> steps, std::span<AttentionResult> results) {
  if (steps.empty()) return;
  const Model& model = *steps[0].session->state_->model;
  std::deque<RequestStop> stop_storage;
  std::vector<StepRun> runs, paged;
  for (size_t s = 0; s < steps.size(); ++s) {
    StepRun run{&steps[s], steps[s].session->state_.get(), &results[s], nullptr, 0, {}};
    ShapeResult(model, steps[s], results[s]);
    if (steps[s].stop && RequestWork(model, steps[s].dims) >= kStopPollWork) {
      run.stop = &stop_storage.emplace_back(steps[s].stop);
    }
    results[s].status = BeginStep(run);
    if (results[s].status.ok() && run.state->paged()) paged.push_back(run);
    runs.push_back(std::move(run));
  }
  RunPaged(*pool_, model, paged);
  for (StepRun& run : runs) {
    if (run.result->status.ok() && !run.state->paged()) RunGathered(*this, model, run);
    FinishStep(model, run);
  }
}

}  // namespace attention
