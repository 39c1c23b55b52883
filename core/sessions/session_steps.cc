// session_steps.cc: Engine::RunSteps (core/sessions/session.h): the steps of many
// decoding sessions of one model as one execution, as Engine::Run computes a
// group of requests:
//   1. every self session takes the blocks its step's rows need (all or none);
//   2. one GEMM per product over the new rows of every step: multi_head's
//      queries (and the keys and values of self steps, then appended to
//      their blocks), bilinear's q W_k, additive's W_q q;
//   3. attention: one task per (step, example, head, query tile), reading
//      the keys and values in place from the blocks;
//   4. multi_head: one output projection over the heads of every step.
// A step that fails gives its new blocks back and leaves its session's
// length as it was; the other steps go on. A long step may come in pieces
// (ValidatedStep::chunk_rows, chunked prefill): each piece is computed as a
// step of its own rows over the keys before them, its output gathered into
// the step's result, and the session's length grows only with the last.
#include <algorithm>
#include <deque>
#include <string>
#include <unordered_set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/engine/attention_tasks.h"
#include "core/engine/engine.h"
#include "core/kernels/finite.h"
#include "core/engine/group_scratch.h"
#include "core/huge_pages.h"
#include "core/engine/positions.h"
#include "core/kernels/masked_softmax.h"
#include "core/engine/projection.h"
#include "core/engine/request_stop.h"
#include "core/sessions/session_state.h"
#include "core/thread_pool.h"

namespace attention {
namespace {

using internal::AttentionTask;
using internal::Projection;
using internal::RequestStop;

// The rows of the step this run computes: all of them, or one piece.
struct Piece {
  int64_t offset = 0;  // rows of each example computed by earlier pieces
  AttentionDims dims;  // the piece as a step of its own
  TensorView queries;
  std::optional<TensorView> keys, values;  // a grouped step's own, if it has them
  // The piece's rows, when B > 1 spreads them.
  std::vector<float> copied_queries, copied_keys, copied_values;
};

// Rows [offset, offset + rows) of every example of `whole` (B, n, ...): in
// place for B = 1, else copied into `copied`.
TensorView RowsOf(const TensorView& whole, int64_t offset, int64_t rows,
                  std::vector<float>& copied) {
  const int64_t batch = whole.shape[0], n = whole.shape[1];
  const int64_t width = static_cast<int64_t>(whole.data.size()) / (batch * n);
  TensorView part;
  part.shape = whole.shape;
  part.shape[1] = rows;
  if (batch == 1) {
    part.data = whole.data.subspan(offset * width, rows * width);
    return part;
  }
  for (int64_t b = 0; b < batch; ++b) {
    const auto first = whole.data.begin() + (b * n + offset) * width;
    copied.insert(copied.end(), first, first + rows * width);
  }
  part.data = copied;
  return part;
}

Piece PieceOf(const ValidatedStep& step, const Session::State& state) {
  const AttentionDims& d = step.dims;
  const int64_t rest = d.num_queries - step.done_rows;
  Piece piece{step.done_rows, d, step.step->queries, step.step->keys, step.step->values, {}, {}, {}};
  const int64_t rows = step.chunk_rows > 0 ? std::min(step.chunk_rows, rest) : rest;
  if (rows == d.num_queries) return piece;
  piece.dims.num_queries = rows;
  if (state.memory == SessionMemory::kSelf) piece.dims.num_keys = state.length + piece.offset + rows;
  piece.queries = RowsOf(step.step->queries, piece.offset, rows, piece.copied_queries);
  if (piece.keys) piece.keys = RowsOf(*step.step->keys, piece.offset, rows, piece.copied_keys);
  if (piece.values) {
    piece.values = RowsOf(*step.step->values, piece.offset, rows, piece.copied_values);
  }
  return piece;
}

// One step (or piece of one) as this run sees it.
struct StepRun {
  StepRun(const ValidatedStep& step, Session::State& state, AttentionResult& answer)
      : step(&step), state(&state), answer(&answer), piece(PieceOf(step, state)) {}

  const ValidatedStep* step;
  Session::State* state;
  AttentionResult* answer;  // the whole step's, across its pieces
  Piece piece;
  // This run's rows, when not the whole step (mutable: the kernels write
  // into it through a const run, as into the step's own result).
  mutable AttentionResult piece_result;
  RequestStop* stop = nullptr;
  // Its outputs were copied from the pool's cache: nothing to compute.
  bool cached = false;
  int64_t first_row = 0;  // of its query rows in the stacking of every step's
  // Self memory: query i of the piece sees keys [0, length + offset + i + 1).
  std::vector<int32_t> causal_lens;
  std::vector<float> query_bias;  // distance: -scale/2 |q|^2 per query row

  const TensorView& queries() const { return piece.queries; }
  const AttentionDims& dims() const { return piece.dims; }
  bool whole() const { return dims().num_queries == step->dims.num_queries; }
  bool last() const { return piece.offset + dims().num_queries == step->dims.num_queries; }
  AttentionResult& result() const { return whole() ? *answer : piece_result; }
  int64_t rows() const { return dims().batch * dims().num_queries; }
  bool self() const { return state->memory == SessionMemory::kSelf; }
};

// A zero output of shape `d`, and zero weights if asked for.
void ShapeResult(const Model& model, const AttentionDims& d, bool weights,
                 AttentionResult& result) {
  result = {};
  result.output.shape =
      d.grouped ? std::vector<int64_t>{d.batch, d.num_queries, d.num_heads, d.value_size}
                : std::vector<int64_t>{d.batch, d.num_queries, d.output_size};
  AssignOnHugePages(result.output.data, static_cast<size_t>(d.output_elements()), 0.0f);
  if (!weights) return;
  result.attention_weights.shape =
      model.kind == Kind::kMultiHead || d.grouped
          ? std::vector<int64_t>{d.batch, d.num_heads, d.num_queries, d.num_keys}
          : std::vector<int64_t>{d.batch, d.num_queries, d.num_keys};
  AssignOnHugePages(result.attention_weights.data, static_cast<size_t>(d.weight_elements()), 0.0f);
}

// A dot_product session's first step fixes its rows: one key and value
// row of d_q per token, or over grouped heads H_kv key_size floats of keys
// and H_kv value_size of values (held once when they are the keys).
void FixRowWidths(const StepRun& run, Session::State& state) {
  const AttentionDims& d = run.dims();
  state.key_size = d.key_size;
  state.value_size = d.value_size;
  state.key_width = d.num_kv_heads * d.key_size;
  state.value_width = d.num_kv_heads * d.value_size;
  if (!d.grouped) return;
  state.heads = d.num_heads;
  state.kv_heads = d.num_kv_heads;
  state.values_are_keys = !run.piece.values.has_value();
}

// A later piece first asks its stop (a step stopped between its pieces
// gives its rows back). Self memory: the blocks for every row of the step,
// taken with its first piece (a dot_product session's first step also fixes
// its row width).
absl::Status BeginStep(StepRun& run) {
  Session::State& state = *run.state;
  absl::Status status;
  if (run.step->done_rows > 0 && run.step->stop) status = run.step->stop();
  if (status.ok() && run.self()) {
    if (state.key_width == 0) FixRowWidths(run, state);
    if (run.step->done_rows == 0) state.ShareHeldBlocks(*run.step->step);
    status = state.Reserve(state.length + run.step->dims.num_queries);
  }
  if (!status.ok()) {
    state.Rollback();
    return status;
  }
  const int64_t before = state.length + run.piece.offset;
  run.causal_lens.resize(run.self() ? run.dims().num_queries : 0);
  for (size_t i = 0; i < run.causal_lens.size(); ++i) {
    run.causal_lens[i] = static_cast<int32_t>(before + static_cast<int64_t>(i) + 1);
  }
  return status;
}

// Keys and values of example b's kv head `kv_head` (0 for rows of one
// head), read in place from the session's head-major blocks: the head's
// slices begin at its sub-block and follow each other (BlockRows::Head).
void SetMemory(FlashProblem& p, const Session::State& state, int64_t b, int64_t kv_head) {
  const int64_t heads = state.row_heads();
  const int64_t key_slice = state.key_width / heads, value_slice = state.value_width / heads;
  p.key_blocks = state.keys[b].blocks.data();
  p.value_blocks = (state.values_are_keys ? state.keys : state.values)[b].blocks.data();
  p.block_rows = kKvBlockRows;
  p.first_held_key = state.first_held_row();
  p.block_column = kv_head * kKvBlockRows * key_slice;
  p.value_block_column = kv_head * kKvBlockRows * value_slice;
  p.key_stride = key_slice;
  p.value_stride = value_slice;
  p.kv_dtype = state.kv_dtype;
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

// The buffers of one execution of steps: every step's queries stacked,
// their projections (multi_head: q, then k and v of self steps, rows of 3E;
// bilinear: q W_k; additive: W_q q), and for multi_head the heads
// concatenated and the output before it is split into results.
struct StepScratch {
  const float* inputs = nullptr;
  float* projected = nullptr;
  int64_t projected_width = 0;  // 0: the queries are used as they are
  float* concat = nullptr;
  float* output = nullptr;
  int64_t width = 0;  // multi_head: E
  // multi_head: H hd and H_kv hd, the widths of the queries' and of the keys'
  // (and values') projections in a projected row.
  int64_t query_width = 0, kv_width = 0;
  int64_t rows = 0;   // of every step
};

int64_t ProjectedWidth(const Model& model) {
  switch (model.kind) {
    case Kind::kMultiHead:
      return QueryWidth(model) + 2 * KvWidth(model);
    case Kind::kBilinear:
      return model.w_k.cols();
    case Kind::kAdditive:
      return model.w_q.rows();
    case Kind::kDotProduct:
    case Kind::kDistance:
      break;
  }
  return 0;
}

StepScratch PlanScratch(const Model& model, std::span<StepRun> runs, std::vector<float>& once) {
  StepScratch s;
  for (StepRun& run : runs) {
    run.first_row = s.rows;
    s.rows += run.rows();
  }
  const bool multi_head = model.kind == Kind::kMultiHead;
  s.width = multi_head ? model.output_size : 0;
  s.query_width = multi_head ? QueryWidth(model) : 0;
  s.kv_width = multi_head ? KvWidth(model) : 0;
  s.projected_width = ProjectedWidth(model);
  const bool stacked = runs.size() > 1 && s.projected_width > 0;
  const int64_t d_q = runs[0].dims().query_size, rows = s.rows;
  const auto [inputs, projected, concat, output] =
      internal::GroupScratch<4>({stacked ? rows * d_q : 0, rows * s.projected_width,
                                 rows * s.query_width, runs.size() > 1 ? rows * s.width : 0},
                                once);
  s.projected = projected;
  s.concat = concat;
  s.output = output;
  s.inputs = stacked ? inputs : runs[0].queries().data.data();
  if (stacked) {
    for (const StepRun& run : runs) {
      std::copy(run.queries().data.begin(), run.queries().data.end(), inputs + run.first_row * d_q);
    }
  }
  return s;
}

// The leading rows of a self step (or piece) of one example whose keys and
// values are in blocks shared with other sessions (State::shared_until):
// not projected, as Append does not write them. With B > 1 an example's rows
// are not the step's leading rows, and all are projected.
int64_t SharedRows(const StepRun& run) {
  if (!run.self() || run.dims().batch != 1) return 0;
  const int64_t before = run.state->length + run.piece.offset;
  return std::clamp<int64_t>(run.state->shared_until - before, 0, run.dims().num_queries);
}

// multi_head: the queries of every step, and the keys and values of the
// self steps but their shared rows (consecutive self steps as one product,
// from the first one's rows past its shared ones), side by side.
std::vector<Projection> MultiHeadInputProjections(const Model& model, const StepScratch& s,
                                                  std::span<const StepRun> runs) {
  const int64_t stride = s.projected_width, d_q = runs[0].dims().query_size;
  std::vector<Projection> projections = {
      {s.inputs, s.projected, s.rows, &model.w_q, &model.b_q, true, &model.packed_q, stride}};
  for (size_t r = 0; r < runs.size();) {
    if (!runs[r].self()) {
      ++r;
      continue;
    }
    const int64_t shared = SharedRows(runs[r]);
    const int64_t first = runs[r].first_row + shared;
    int64_t count = runs[r].rows() - shared;
    for (++r; r < runs.size() && runs[r].self() && SharedRows(runs[r]) == 0; ++r) {
      count += runs[r].rows();
    }
    if (count == 0) continue;
    const float* in = s.inputs + first * d_q;
    float* out = s.projected + first * stride;
    projections.push_back(
        {in, out + s.query_width, count, &model.w_k, &model.b_k, true, &model.packed_k, stride});
    projections.push_back({in, out + s.query_width + s.kv_width, count, &model.w_v, &model.b_v,
                           true, &model.packed_v, stride});
  }
  return projections;
}

// Hugging Face layers: qk-norm and rotary on the projected queries and keys
// of every step, each row at its position in its session (the tokens
// before it). Cross memory never has them (Session::Open refuses it).
void PositionSelfSteps(ThreadPool& pool, const Model& model, const StepScratch& s,
                       std::span<const StepRun> runs) {
  if (!internal::TransformsRows(model.terms)) return;
  std::vector<int64_t> positions;
  positions.reserve(s.rows);
  for (const StepRun& run : runs) {
    const int64_t before = run.state->length + run.piece.offset;
    for (int64_t b = 0; b < run.dims().batch; ++b) {
      for (int64_t i = 0; i < run.dims().num_queries; ++i) positions.push_back(before + i);
    }
  }
  const internal::ProjectedRows parts[] = {
      {s.projected, s.projected_width, s.rows, model.num_heads, &model.terms.q_norm},
      {s.projected + s.query_width, s.projected_width, s.rows, KvHeads(model), &model.terms.k_norm}};
  internal::PositionRows(pool, model.terms, HeadSize(model), parts, positions);
}

// Every step's queries projected as the kind needs, one GEMM per product
// over the rows of all steps, in one parallel phase.
void ProjectInputs(ThreadPool& pool, const Model& model, const StepScratch& s,
                   std::span<const StepRun> runs) {
  std::vector<Projection> projections;
  if (model.kind == Kind::kMultiHead) {
    projections = MultiHeadInputProjections(model, s, runs);
  } else if (model.kind == Kind::kBilinear) {
    projections = {{s.inputs, s.projected, s.rows, &model.w_k, nullptr, /*transposed=*/false}};
  } else if (model.kind == Kind::kAdditive) {
    projections = {{s.inputs, s.projected, s.rows, &model.w_q, nullptr}};
  }
  if (projections.empty()) return;
  internal::RunProjections(pool, projections, runs.size() == 1 ? runs[0].stop : nullptr);
  if (model.kind == Kind::kMultiHead) PositionSelfSteps(pool, model, s, runs);
}

// A self step's new keys and values into its blocks, after the session's
// length and the step's earlier pieces: `keys` and `values` (rows of the
// piece, with their row strides). Rows in blocks shared with other sessions
// (State::shared_until) are there already, and shared blocks are never
// written.
void Append(const StepRun& run, const float* keys, const float* values, int64_t key_stride,
            int64_t value_stride) {
  Session::State& state = *run.state;
  const int64_t n = run.dims().num_queries, before = state.length + run.piece.offset;
  const int64_t first = std::clamp<int64_t>(state.shared_until - before, 0, n);
  for (int64_t b = 0; b < state.batch; ++b) {
    for (int64_t i = first; i < n; ++i) {
      state.keys[b].Put(before + i, state.key_width, state.row_heads(),
                        keys + (b * n + i) * key_stride);
      if (state.values_are_keys) continue;
      state.values[b].Put(before + i, state.value_width, state.row_heads(),
                          values + (b * n + i) * value_stride);
    }
  }
}

void AppendSelfSteps(const Model& model, const StepScratch& s, std::span<const StepRun> runs) {
  for (const StepRun& run : runs) {
    if (!run.self()) continue;
    if (model.kind == Kind::kMultiHead) {
      const float* row = s.projected + run.first_row * s.projected_width;
      Append(run, row + s.query_width, row + s.query_width + s.kv_width, s.projected_width,
             s.projected_width);
    } else {
      const TensorView& keys = run.piece.keys ? *run.piece.keys : run.queries();
      const float* values = run.piece.values ? run.piece.values->data.data() : nullptr;
      Append(run, keys.data.data(), values, run.state->key_width, run.state->value_width);
    }
  }
}

FlashProblem BaseProblem(const StepRun& run) {
  FlashProblem p;
  p.num_queries = run.dims().num_queries;
  p.num_keys = run.dims().num_keys;
  p.scale = run.dims().scale;
  p.stop = run.stop;
  return p;
}

// Whether a one-token step's query heads of a group run as one problem of
// `group` rows over their kv head, so the group reads each key and value
// once: decoding reads every key per step, and at long contexts that read
// is the step's cost. Only where every head of the group sees the same
// keys alike: no per-head terms, no window (whose bound moves with the
// row), no weights asked for (their layout is per head).
bool FoldsGroup(const Model& model, const StepRun& run) {
  return run.dims().num_queries == 1 && model.num_heads > KvHeads(model) &&
         !model.terms.has_head_terms() && model.terms.sliding_window == 0 &&
         run.result().attention_weights.data.empty();
}

// multi_head: one problem per (step, example, head), on the projections;
// or per (step, example, kv head) where FoldsGroup.
void AddHeadTasks(const Model& model, const StepScratch& s, StepRun& run,
                  std::deque<FlashProblem>& problems, std::vector<AttentionTask>& tasks) {
  const int64_t heads = model.num_heads, head_size = HeadSize(model);
  const int64_t group = heads / KvHeads(model);
  const int64_t n = run.dims().num_queries;
  const bool fold = FoldsGroup(model, run);
  for (int64_t b = 0; b < run.dims().batch; ++b) {
    const int64_t row = run.first_row + b * n;
    for (int64_t h = 0; h < heads; h += fold ? group : 1) {
      FlashProblem& p = problems.emplace_back(BaseProblem(run));
      p.queries = s.projected + row * s.projected_width + h * head_size;
      p.query_stride = s.projected_width;
      p.output = s.concat + row * s.query_width + h * head_size;
      p.output_stride = s.query_width;
      p.head_size = p.value_size = head_size;
      p.bounds = BoundsOf(run, b);
      p.bounds.window = model.terms.sliding_window;
      p.bounds.first_query = run.state->length + run.piece.offset;
      p.terms = internal::HeadTerms(model.terms, h);
      p.precision = model.precision;
      SetMemory(p, *run.state, b, h / group);
      if (fold) {
        // The group's heads are adjacent columns of the token's row: rows
        // of head_size, all with the token's bound.
        p.num_queries = group;
        p.query_stride = p.output_stride = head_size;
        p.bounds.valid_len = p.bounds.valid_lens[0];
        p.bounds.valid_lens = nullptr;
      }
      internal::AddTasks(p, internal::WeightsOf(run.result(), b * heads + h, run.dims()), tasks);
    }
  }
}

// distance: -scale/2 |q|^2 of every query row of the step.
void DistanceQueryBias(StepRun& run) {
  const AttentionDims& d = run.dims();
  const internal::ConstMatrixMap q(run.queries().data.data(), run.rows(), d.query_size);
  run.query_bias.resize(run.rows());
  Eigen::Map<Vector>(run.query_bias.data(), run.rows()) =
      -(0.5f * d.scale) * q.rowwise().squaredNorm();
}

// Whether a one-token step of a dot_product session over grouped heads
// runs the query heads of a group as one problem of `group` rows over their
// kv head, as FoldsGroup does for multi_head: the heads of a group are
// adjacent rows of the token, all with its bound. Not with a window (whose
// bound moves with the row) or weights asked for (their layout is per head).
bool FoldsExampleGroup(const Model& model, const StepRun& run) {
  const AttentionDims& d = run.dims();
  return model.kind == Kind::kDotProduct && d.grouped && d.num_queries == 1 &&
         d.num_heads > d.num_kv_heads && run.state->sliding_window == 0 &&
         run.result().attention_weights.data.empty();
}

// The dot-product family: one problem per (step, example, head), on the
// step's queries (bilinear: mapped by W_k); one head unless the rows are
// grouped (query head h on kv head h / (H / H_kv)), or per (step, example,
// kv head) where FoldsExampleGroup.
void AddExampleTasks(const Model& model, const StepScratch& s, StepRun& run,
                     std::deque<FlashProblem>& problems, std::vector<AttentionTask>& tasks) {
  const AttentionDims& d = run.dims();
  const bool mapped = s.projected_width > 0;
  const int64_t head_size = mapped ? s.projected_width : d.query_size;
  const int64_t heads = d.num_heads, group = heads / d.num_kv_heads;
  const float* queries =
      mapped ? s.projected + run.first_row * head_size : run.queries().data.data();
  if (model.kind == Kind::kDistance) DistanceQueryBias(run);
  const Session::State& state = *run.state;
  const bool fold = FoldsExampleGroup(model, run);
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t h = 0; h < heads; h += fold ? group : 1) {
      FlashProblem& p = problems.emplace_back(BaseProblem(run));
      p.queries = queries + (b * d.num_queries * heads + h) * head_size;
      p.query_stride = heads * head_size;
      p.output = run.result().output.data.data() + (b * d.num_queries * heads + h) * d.value_size;
      p.output_stride = heads * d.value_size;
      p.head_size = head_size;
      p.value_size = d.value_size;
      p.bounds = BoundsOf(run, b);
      if (model.kind == Kind::kDistance) {
        p.distance = true;
        p.query_bias = run.query_bias.data() + b * d.num_queries;
        p.key_bias = state.key_bias[b].data();
      }
      if (model.kind == Kind::kDotProduct) {
        p.precision = model.precision;
        p.bounds.window = state.sliding_window;
        p.bounds.first_query = state.length + run.piece.offset;
        p.terms.softcap = state.softcap;
      }
      SetMemory(p, state, b, h / group);
      if (fold) {
        p.num_queries = group;
        p.query_stride = head_size;
        p.output_stride = d.value_size;
        p.bounds.valid_len = p.bounds.valid_lens[0];
        p.bounds.valid_lens = nullptr;
      }
      internal::AddTasks(p, internal::WeightsOf(run.result(), b * heads + h, d), tasks);
    }
  }
}

// The output projection of every step's heads, into its result.
void ProjectOutput(ThreadPool& pool, const Model& model, const StepScratch& s,
                   std::span<const StepRun> runs) {
  float* out = runs.size() == 1 ? runs[0].result().output.data.data() : s.output;
  internal::RunProjections(pool,
                           {{s.concat, out, s.rows, &model.w_o, &model.b_o, true, &model.packed_o}},
                           runs.size() == 1 ? runs[0].stop : nullptr);
  if (runs.size() == 1) return;
  for (const StepRun& run : runs) {
    std::copy_n(s.output + run.first_row * s.width, run.result().output.data.size(),
                run.result().output.data.begin());
  }
}

// additive: rows [begin, end) of example b of a step, whose W_q q start at
// `queries`: per query row, w_v . tanh(W_q q + W_k k) over the W_k k held
// block by block, the masked softmax, and the values block by block.
void AdditiveRows(const Model& model, const StepRun& run, int64_t b, const float* queries,
                  int64_t begin, int64_t end) {
  const Session::State& state = *run.state;
  const AttentionDims& d = run.dims();
  const int64_t hidden = state.key_width, n_k = d.num_keys;
  const Eigen::Map<const Vector> w_v(model.w_v.data(), hidden);
  internal::MatrixMap output(run.result().output.data.data() + b * d.num_queries * d.value_size,
                             d.num_queries, d.value_size);
  float* weights = internal::WeightsOf(run.result(), b, d);
  const KeyBounds bounds = BoundsOf(run, b);
  thread_local RowMatrix features;
  thread_local Vector scores;
  // A 16-bit session's block widened, one block at a time.
  thread_local std::vector<float> widened;
  scores.resize(n_k);
  for (int64_t i = begin; i < end && !(run.stop != nullptr && run.stop->Stopped()); ++i) {
    const Eigen::Map<const Eigen::RowVectorXf> query(queries + i * hidden, hidden);
    const int64_t bound = bounds.Allowed(i, n_k);
    for (int64_t first = 0; first < bound; first += kKvBlockRows) {
      const int64_t count = std::min(kKvBlockRows, bound - first);
      const internal::ConstMatrixMap keys(state.keys[b].Rows(first, count, hidden, widened), count,
                                          hidden);
      features = (keys.rowwise() + query).array().tanh();
      scores.segment(first, count).noalias() = features * w_v;
    }
    const int64_t nonzero = MaskedSoftmaxRow({scores.data(), static_cast<size_t>(n_k)}, bound);
    output.row(i).setZero();
    for (int64_t first = 0; first < nonzero; first += kKvBlockRows) {
      const int64_t count = std::min(kKvBlockRows, nonzero - first);
      const internal::ConstMatrixMap values(
          state.values[b].Rows(first, count, d.value_size, widened), count, d.value_size);
      output.row(i).noalias() += scores.segment(first, count).transpose() * values;
    }
    if (weights != nullptr) std::copy_n(scores.data(), n_k, weights + i * n_k);
  }
  if (scores.size() > kKeptKernelScratchFloats) scores.resize(0);
  if (widened.capacity() > static_cast<size_t>(kKeptKernelScratchFloats)) {
    std::vector<float>().swap(widened);
  }
}

// additive: one task per (step, example, query tile).
void RunAdditiveSteps(ThreadPool& pool, const Model& model, const StepScratch& s,
                      std::span<const StepRun> runs) {
  struct Rows {
    const StepRun* run;
    int64_t example, begin, end;
  };
  std::vector<Rows> tasks;
  for (const StepRun& run : runs) {
    for (int64_t b = 0; b < run.dims().batch; ++b) {
      for (int64_t i = 0; i < run.dims().num_queries; i += kFlashQueryTile) {
        tasks.push_back({&run, b, i, std::min(run.dims().num_queries, i + kFlashQueryTile)});
      }
    }
  }
  pool.ParallelFor(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const Rows& rows = tasks[t];
    const StepRun& run = *rows.run;
    const float* queries =
        s.projected + (run.first_row + rows.example * run.dims().num_queries) * s.projected_width;
    AdditiveRows(model, run, rows.example, queries, rows.begin, rows.end);
  });
}

// Every step of one model: the memory read in place from the blocks.
void RunStepsOf(ThreadPool& pool, const Model& model, std::span<StepRun> runs, bool split_keys) {
  if (runs.empty()) return;
  std::vector<float> once;
  const StepScratch s = PlanScratch(model, runs, once);
  ProjectInputs(pool, model, s, runs);
  AppendSelfSteps(model, s, runs);
  if (model.kind == Kind::kAdditive) return RunAdditiveSteps(pool, model, s, runs);
  std::deque<FlashProblem> problems;
  std::vector<AttentionTask> tasks;
  for (StepRun& run : runs) {
    if (model.kind == Kind::kMultiHead) {
      AddHeadTasks(model, s, run, problems, tasks);
    } else {
      AddExampleTasks(model, s, run, problems, tasks);
    }
  }
  internal::RunAttention(pool, tasks, split_keys);
  if (model.kind == Kind::kMultiHead) ProjectOutput(pool, model, s, runs);
}

// OK when the step's answer is finite (as Engine::Run checks its requests').
absl::Status CheckFinite(const Model& model, const StepRun& run) {
  for (const Tensor* tensor : {&run.result().output, &run.result().attention_weights}) {
    if (const int64_t at = FirstNonFinite(tensor->data); at >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(tensor == &run.result().output ? "output" : "attention_weights", "[", at,
                       "]: expected a finite value, got ", tensor->data[at],
                       ": the step overflows float32 on model '", model.name, "' (scale ",
                       run.dims().scale, "); send a smaller scale or smaller values"));
    }
  }
  return absl::OkStatus();
}

// A piece's output rows (and weights) into the whole step's result: per
// example (and head), its rows after the earlier pieces'; a piece's weights
// rows are as long as the keys it saw, the later keys being masked anyway.
void GatherPiece(const StepRun& run) {
  const AttentionDims &piece = run.dims(), &whole = run.step->dims;
  const int64_t rows = piece.num_queries, offset = run.piece.offset;
  const std::vector<float>& output = run.piece_result.output.data;
  std::vector<float>& answer = run.answer->output.data;
  for (int64_t b = 0; b < piece.batch; ++b) {
    std::copy_n(output.begin() + b * rows * piece.output_size, rows * piece.output_size,
                answer.begin() + (b * whole.num_queries + offset) * whole.output_size);
  }
  const std::vector<float>& weights = run.piece_result.attention_weights.data;
  if (weights.empty()) return;
  std::vector<float>& all = run.answer->attention_weights.data;
  for (int64_t slice = 0; slice < piece.batch * piece.num_heads; ++slice) {
    for (int64_t i = 0; i < rows; ++i) {
      std::copy_n(weights.begin() + (slice * rows + i) * piece.num_keys, piece.num_keys,
                  all.begin() + (slice * whole.num_queries + offset + i) * whole.num_keys);
    }
  }
}

// The piece's status; the session grows by the step with its last piece if
// OK, and is as before the step otherwise.
void FinishStep(const Model& model, StepRun& run) {
  absl::Status status = run.result().status;
  if (status.ok() && run.stop != nullptr) status = run.stop->why();
  if (status.ok()) status = CheckFinite(model, run);
  if (!status.ok()) {
    *run.answer = {.output = {}, .attention_weights = {}, .status = status};
    run.state->Rollback();
    return;
  }
  if (run.self() && !run.cached) {
    run.state->CacheOutputs(run.piece.offset, run.dims().num_queries, run.result().output.data);
  }
  if (!run.whole()) GatherPiece(run);
  if (run.self() && run.last()) run.state->Commit(*run.step->step);
}

// FAILED_PRECONDITION for a step RunSteps cannot run with the others: of
// another model, or of a session with an earlier step in the same call
// (each step starts where the one before it ended).
absl::Status CheckRunnable(const Model& model, const Session::State* state,
                           std::unordered_set<const Session::State*>& sessions) {
  if (state->model.get() != &model) {
    return absl::FailedPreconditionError(
        absl::StrCat("session of model '", state->model->name, "' stepped with steps of model '",
                     model.name, "': one RunSteps computes steps of one model"));
  }
  if (!sessions.insert(state).second) {
    return absl::FailedPreconditionError(
        "a session has two steps in one RunSteps: step it once per call");
  }
  return absl::OkStatus();
}

}  // namespace

void Engine::RunSteps(std::span<const ValidatedStep> steps, std::span<AttentionResult> results) {
  if (steps.empty()) return;
  const Model& model = *steps[0].session->state_->model;
  std::deque<RequestStop> stop_storage;
  std::vector<StepRun> runs;  // the steps that could begin
  runs.reserve(steps.size());
  std::unordered_set<const Session::State*> sessions;
  double work = 0;
  for (size_t s = 0; s < steps.size(); ++s) {
    StepRun run(steps[s], *steps[s].session->state_, results[s]);
    absl::Status status = CheckRunnable(model, run.state, sessions);
    if (status.ok()) status = BeginStep(run);
    if (!status.ok()) {
      results[s] = {.output = {}, .attention_weights = {}, .status = status};
      continue;
    }
    const bool weights = steps[s].step->return_attention_weights;
    if (steps[s].done_rows == 0) ShapeResult(model, steps[s].dims, weights, results[s]);
    if (!run.whole()) ShapeResult(model, run.dims(), weights, run.piece_result);
    run.cached = run.self() && run.state->CopyCachedOutputs(
                                   run.piece.offset, run.dims().num_queries,
                                   run.result().output.data);
    if (run.cached) {
      runs.push_back(std::move(run));
      continue;
    }
    const double step_work = run.state->StepWork(run.dims());
    work += step_work;
    if (steps[s].stop && step_work >= kStopPollWork) {
      run.stop = &stop_storage.emplace_back(steps[s].stop);
    }
    runs.push_back(std::move(run));
  }
  const auto computed = std::stable_partition(runs.begin(), runs.end(),
                                              [](const StepRun& run) { return !run.cached; });
  RunStepsOf(PoolFor(work), model, {runs.begin(), computed}, split_keys_);
  for (StepRun& run : runs) FinishStep(model, run);
}

}  // namespace attention
