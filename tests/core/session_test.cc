// session_test.cc: decoding sessions (core/sessions/session.h) against Engine::Attend.
//
// Step by step, a self session's outputs and weights equal Attend() on the
// whole prefix with causal = true, and a cross session's equal Attend() with
// its fixed keys and values, for every kind, prefill then single steps,
// lengths at the block edges, B > 1 and valid lengths; several sessions in
// one RunSteps get what they get alone; a step refused by the pool, by
// max_length or by its stop leaves its session as it was; blocks go back to
// the pool; a full pool asks its reclaim for room, and a session larger than
// the empty pool is refused without asking. A step computed in pieces
// (chunked prefill: ValidatedStep::chunk_rows) answers as in one piece,
// beside other sessions' steps too; a piece stopped, refused or abandoned
// leaves the session as before the step; ChunkRows cuts pieces within a
// work budget. Run once per kernel path
// (tests/CMakeLists.txt).
#include "core/sessions/session.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/engine/engine.h"
#include "core/sessions/session_state.h"
#include "tests/core/random_weights.h"

namespace attention {
namespace {

using testing::MultiHeadModel;
using testing::RandomData;
using testing::RandomMatrix;
using testing::RandomVector;

std::shared_ptr<Model> KindModel(std::mt19937& rng, Kind kind, int64_t d_q, int64_t d_k) {
  if (kind == Kind::kMultiHead) return MultiHeadModel(rng, 2, 4, d_q, d_k, d_k, true);
  auto m = std::make_shared<Model>(kind == Kind::kDistance ? DistanceModel() : DotProductModel());
  m->kind = kind;
  m->name = std::string(KindName(kind));
  if (kind == Kind::kAdditive) {
    m->query_size = d_q;
    m->key_size = d_k;
    m->w_q = RandomMatrix(rng, 7, d_q);
    m->w_k = RandomMatrix(rng, 7, d_k);
    m->w_v = RandomMatrix(rng, 1, 7);
  } else if (kind == Kind::kBilinear) {
    m->query_size = d_q;
    m->key_size = d_k;
    m->w_k = RandomMatrix(rng, d_q, d_k);
  }
  return m;
}

// Open settings and requests, field by field (GCC 12 warns of designated
// initializers that leave fields out).
SessionOpen SelfOpen(int64_t batch = 1, int64_t max_length = 0) {
  SessionOpen open;
  open.batch = batch;
  open.max_length = max_length;
  return open;
}

SessionOpen CrossOpen(const TensorView& keys, std::optional<TensorView> values,
                      std::span<const int32_t> valid_lens) {
  SessionOpen open;
  open.memory = SessionMemory::kCross;
  open.keys = keys;
  open.values = std::move(values);
  open.valid_lens = valid_lens;
  return open;
}

SessionStep StepOf(TensorView queries, bool weights) {
  SessionStep step;
  step.queries = std::move(queries);
  step.return_attention_weights = weights;
  return step;
}

AttentionRequest RequestOf(TensorView queries, bool weights) {
  AttentionRequest request;
  request.queries = std::move(queries);
  request.return_attention_weights = weights;
  return request;
}

// Within the conformance tolerance (atol 1e-5, rtol 1e-4), or `atol` for
// bf16 models.
void ExpectNear(const Tensor& actual, const Tensor& expected, const std::string& what,
                double atol = 1e-5) {
  ASSERT_EQ(actual.shape, expected.shape) << what;
  ASSERT_EQ(actual.data.size(), expected.data.size()) << what;
  for (size_t i = 0; i < actual.data.size(); ++i) {
    ASSERT_NEAR(actual.data[i], expected.data[i], atol + 1e-4 * std::abs(expected.data[i]))
        << what << " at " << i;
  }
}

// Rows [first, first + count) of axis -2 of a (..., n, cols) tensor.
Tensor LastRows(const Tensor& t, int64_t first, int64_t count) {
  const int64_t n = t.shape[t.shape.size() - 2], cols = t.shape.back();
  Tensor out;
  out.shape = t.shape;
  out.shape[out.shape.size() - 2] = count;
  for (size_t slice = 0; slice < t.data.size() / (n * cols); ++slice) {
    const auto begin = t.data.begin() + (slice * n + first) * cols;
    out.data.insert(out.data.end(), begin, begin + count * cols);
  }
  return out;
}

// Every token a self session has seen, per example, to compute the prefix.
class Prefix {
 public:
  Prefix(int64_t batch, int64_t d) : rows_(batch), d_(d) {}

  // Appends a step's (B, n, d) rows.
  void Add(const std::vector<float>& step, int64_t n) {
    for (size_t b = 0; b < rows_.size(); ++b) {
      rows_[b].insert(rows_[b].end(), step.begin() + b * n * d_, step.begin() + (b + 1) * n * d_);
    }
  }
  int64_t length() const { return static_cast<int64_t>(rows_[0].size()) / d_; }
  // (B, length, d).
  Tensor Tensor3() const {
    Tensor t{{static_cast<int64_t>(rows_.size()), length(), d_}, {}};
    for (const auto& rows : rows_) t.data.insert(t.data.end(), rows.begin(), rows.end());
    return t;
  }

 private:
  std::vector<std::vector<float>> rows_;
  int64_t d_;
};

// Runs `validated` to its end in pieces of `piece` rows (0: one piece), as
// the server computes a long step: one RunSteps call per piece, the
// session's length unchanged until the last.
AttentionResult RunInPieces(Engine& engine, ValidatedStep& validated, int64_t piece) {
  const int64_t n = validated.dims.num_queries, length = validated.session->length();
  AttentionResult result;
  do {
    validated.chunk_rows = piece;
    engine.RunSteps({&validated, 1}, {&result, 1});
    if (!result.status.ok()) break;
    validated.done_rows += piece > 0 ? std::min(piece, n - validated.done_rows) : n;
    if (validated.done_rows < n) {
      EXPECT_EQ(validated.session->length(), length);
    }
  } while (validated.done_rows < n);
  return result;
}

// One step of `n` rows through RunSteps, in pieces of `piece` rows (0: one).
AttentionResult Step(Engine& engine, Session& session, const std::vector<float>& rows, int64_t n,
                     int64_t d, bool weights, int64_t piece = 0) {
  const SessionStep step = StepOf({{session.batch(), n, d}, rows}, weights);
  absl::StatusOr<ValidatedStep> validated = ValidateStep(session, step);
  if (!validated.ok()) return {{}, {}, validated.status()};
  return RunInPieces(engine, *validated, piece);
}

// Attend() on the whole prefix, causal, and its last n rows.
AttentionResult CausalReference(Engine& engine, const Model& model, const Prefix& prefix, int64_t n,
                                bool weights) {
  const Tensor all = prefix.Tensor3();
  AttentionRequest request = RequestOf(all.view(), weights);
  request.causal = true;
  absl::StatusOr<AttentionResult> full = engine.Attend(model, request);
  EXPECT_TRUE(full.ok()) << full.status();
  AttentionResult last;
  last.output = LastRows(full->output, prefix.length() - n, n);
  if (weights) last.attention_weights = LastRows(full->attention_weights, prefix.length() - n, n);
  return last;
}

// A self session stepped by `schedule` (tokens per step), each step in
// pieces of `piece` rows (0: whole), against the causal prefix after every
// step.
void CheckSelfSession(const std::shared_ptr<Model>& model, int64_t batch, int64_t d,
                      const std::vector<int64_t>& schedule, double atol = 1e-5,
                      int64_t piece = 0) {
  std::mt19937 rng(7);
  Engine engine;
  KvBlockPool pool(int64_t{1} << 28);
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(model, pool, SelfOpen(batch));
  ASSERT_TRUE(session.ok()) << session.status();
  Prefix prefix(batch, d);
  for (size_t s = 0; s < schedule.size(); ++s) {
    const int64_t n = schedule[s];
    const bool weights = s % 2 == 1;
    const std::vector<float> rows = RandomData(rng, batch * n * d);
    const AttentionResult got = Step(engine, **session, rows, n, d, weights, piece);
    ASSERT_TRUE(got.status.ok()) << got.status;
    prefix.Add(rows, n);
    ASSERT_EQ((*session)->length(), prefix.length());
    const AttentionResult want = CausalReference(engine, *model, prefix, n, weights);
    const std::string what =
        "step " + std::to_string(s) + " at length " + std::to_string(prefix.length());
    ExpectNear(got.output, want.output, what + " output", atol);
    if (weights) ExpectNear(got.attention_weights, want.attention_weights, what + " weights", atol);
  }
  EXPECT_GT(pool.used_bytes(), 0);
  EXPECT_EQ((*session)->held_bytes(), pool.used_bytes());
  session->reset();
  EXPECT_EQ(pool.used_bytes(), 0);
}

// Lengths around the block edges, prefill first, then single steps.
const std::vector<int64_t> kEdgeSchedule = {kKvBlockRows - 2, 1, 1, 1, 1};
const std::vector<int64_t> kPrefillSchedule = {5, 1, 1, kKvBlockRows - 8, 1, 1, 2, 1};

TEST(SelfSession, MultiHeadMatchesCausalAttendAtBlockEdges) {
  std::mt19937 rng(1);
  CheckSelfSession(MultiHeadModel(rng, 4, 8, 32, 32, 32, true), 2, 32, kEdgeSchedule);
}

TEST(SelfSession, UnpackedMultiHeadMatchesCausalAttend) {
  std::mt19937 rng(2);
  CheckSelfSession(MultiHeadModel(rng, 2, 4, 8, 8, 8, false), 3, 8, kPrefillSchedule);
}

TEST(SelfSession, Bf16MultiHeadMatchesCausalAttend) {
  std::mt19937 rng(3);
  CheckSelfSession(MultiHeadModel(rng, 2, 16, 32, 32, 32, true, Precision::kBf16), 1, 32,
                   kPrefillSchedule, 2e-3);
}

TEST(SelfSession, DotProductMatchesCausalAttend) {
  CheckSelfSession(std::make_shared<Model>(DotProductModel()), 2, 16, kEdgeSchedule);
  CheckSelfSession(std::make_shared<Model>(DotProductModel()), 1, 5, kPrefillSchedule);
}

TEST(SelfSession, OneLongPrefillOverManyBlocks) {
  std::mt19937 rng(4);
  CheckSelfSession(MultiHeadModel(rng, 2, 8, 16, 16, 16, true), 1, 16,
                   {3 * kKvBlockRows + 17, 1, kKvBlockRows, 1});
}

// Chunked prefill: every step in pieces, across block edges, B > 1, with
// and without weights, answers as the causal prefix within the same
// tolerances as in one piece.
TEST(SelfSessionInPieces, MatchesCausalAttendForEveryPieceSize) {
  std::mt19937 rng(5);
  const std::vector<int64_t> schedule = {kKvBlockRows + 45, 1, 70, 1};
  for (int64_t piece : {int64_t{1}, int64_t{7}, int64_t{64}, kKvBlockRows - 3}) {
    SCOPED_TRACE("pieces of " + std::to_string(piece));
    CheckSelfSession(MultiHeadModel(rng, 4, 8, 32, 32, 32, true), 2, 32, schedule, 1e-5, piece);
    CheckSelfSession(std::make_shared<Model>(DotProductModel()), 3, 16, schedule, 1e-5, piece);
  }
  CheckSelfSession(MultiHeadModel(rng, 2, 4, 8, 8, 8, false), 3, 8, kPrefillSchedule, 1e-5, 5);
  CheckSelfSession(MultiHeadModel(rng, 2, 16, 32, 32, 32, true, Precision::kBf16), 1, 32,
                   kPrefillSchedule, 2e-3, 9);
}

// A cross session of `kind` against Attend() with its keys and values, each
// step in pieces of `piece` rows (0: whole).
void CheckCrossSession(Kind kind, std::vector<int32_t> valid_lens, int64_t piece = 0) {
  std::mt19937 rng(11);
  const int64_t batch = 2, n_k = kKvBlockRows + 1, d_q = 6;
  const bool weightless = kind == Kind::kDotProduct || kind == Kind::kDistance;
  const int64_t d_k = weightless ? d_q : 5, d_v = kind == Kind::kMultiHead ? d_k : 3;
  const std::shared_ptr<Model> model = KindModel(rng, kind, d_q, d_k);
  const std::vector<float> keys = RandomData(rng, batch * n_k * d_k);
  const std::vector<float> values = RandomData(rng, batch * n_k * d_v);
  const TensorView key_view{{batch, n_k, d_k}, keys}, value_view{{batch, n_k, d_v}, values};
  Engine engine;
  KvBlockPool pool(int64_t{1} << 26);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open(model, pool, CrossOpen(key_view, value_view, valid_lens));
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->length(), n_k);
  for (int64_t n : {1, 70, 1}) {
    const std::vector<float> queries = RandomData(rng, batch * n * d_q);
    const AttentionResult got = Step(engine, **session, queries, n, d_q, true, piece);
    ASSERT_TRUE(got.status.ok()) << got.status;
    AttentionRequest request = RequestOf({{batch, n, d_q}, queries}, true);
    request.keys = key_view;
    request.values = value_view;
    request.valid_lens = valid_lens;
    absl::StatusOr<AttentionResult> want = engine.Attend(*model, request);
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectNear(got.output, want->output, std::string(KindName(kind)) + " output");
    ExpectNear(got.attention_weights, want->attention_weights,
               std::string(KindName(kind)) + " weights");
  }
  EXPECT_EQ((*session)->length(), n_k);
  session->reset();
  EXPECT_EQ(pool.used_bytes(), 0);
}

TEST(CrossSession, EveryKindMatchesAttend) {
  for (Kind kind :
       {Kind::kDotProduct, Kind::kDistance, Kind::kAdditive, Kind::kBilinear, Kind::kMultiHead}) {
    SCOPED_TRACE(KindName(kind));
    CheckCrossSession(kind, {});
    CheckCrossSession(kind, {static_cast<int32_t>(kKvBlockRows), 3});
    CheckCrossSession(kind, {0, 1000});
    CheckCrossSession(kind, {static_cast<int32_t>(kKvBlockRows), 3}, /*piece=*/16);
  }
}

TEST(RunSteps, SessionsBatchedTogetherGetWhatTheyGetAlone) {
  std::mt19937 rng(21);
  const int64_t d = 16;
  const std::shared_ptr<Model> model = MultiHeadModel(rng, 4, 4, d, d, d, true);
  Engine engine;
  KvBlockPool pool(int64_t{1} << 28);
  std::vector<std::unique_ptr<Session>> together, alone;
  const std::vector<float> keys = RandomData(rng, 2 * 9 * d);
  const TensorView key_view{{2, 9, d}, keys};
  const std::vector<int32_t> lens = {4, 9};
  for (int copy = 0; copy < 2; ++copy) {
    auto& sessions = copy == 0 ? together : alone;
    for (int64_t batch : {1, 2, 1, 3}) {
      sessions.push_back(*Session::Open(model, pool, SelfOpen(batch)));
    }
    sessions.push_back(*Session::Open(model, pool, CrossOpen(key_view, std::nullopt, lens)));
  }
  for (int round = 0; round < 3; ++round) {
    std::vector<std::vector<float>> rows;
    std::vector<SessionStep> steps;
    steps.reserve(together.size());
    std::vector<ValidatedStep> validated;
    for (size_t s = 0; s < together.size(); ++s) {
      const int64_t n = round == 0 ? 1 + 37 * s % 70 : 1 + s % 2;
      rows.push_back(RandomData(rng, together[s]->batch() * n * d));
      steps.push_back(StepOf({{together[s]->batch(), n, d}, rows.back()}, s % 2 == 0));
      validated.push_back(*ValidateStep(*together[s], steps.back()));
    }
    std::vector<AttentionResult> results(steps.size());
    engine.RunSteps(validated, results);
    for (size_t s = 0; s < steps.size(); ++s) {
      ASSERT_TRUE(results[s].status.ok()) << results[s].status;
      const AttentionResult want = Step(engine, *alone[s], rows[s], steps[s].queries.shape[1], d,
                                        steps[s].return_attention_weights);
      ExpectNear(results[s].output, want.output, "session " + std::to_string(s));
      ExpectNear(results[s].attention_weights, want.attention_weights,
                 "session " + std::to_string(s) + " weights");
      EXPECT_EQ(together[s]->length(), alone[s]->length());
    }
  }
}

TEST(RunSteps, RefusesASecondStepOfOneSessionAndStepsOfAnotherModel) {
  std::mt19937 rng(22);
  const int64_t d = 8;
  const std::shared_ptr<Model> model = MultiHeadModel(rng, 2, 4, d, d, d, true);
  Engine engine;
  KvBlockPool pool(int64_t{1} << 24);
  std::unique_ptr<Session> session = *Session::Open(model, pool, SelfOpen());
  std::unique_ptr<Session> other =
      *Session::Open(MultiHeadModel(rng, 2, 4, d, d, d, true), pool, SelfOpen());
  const std::vector<float> rows = RandomData(rng, 3 * d);
  const SessionStep step = StepOf({{1, 3, d}, rows}, false);
  const std::vector<ValidatedStep> steps = {
      *ValidateStep(*session, step), *ValidateStep(*session, step), *ValidateStep(*other, step)};
  std::vector<AttentionResult> results(steps.size());
  engine.RunSteps(steps, results);
  ASSERT_TRUE(results[0].status.ok()) << results[0].status;
  EXPECT_EQ(results[1].status.code(), absl::StatusCode::kFailedPrecondition) << results[1].status;
  EXPECT_EQ(results[2].status.code(), absl::StatusCode::kFailedPrecondition) << results[2].status;
  EXPECT_EQ(session->length(), 3);
  EXPECT_EQ(other->length(), 0);
  AttentionRequest alone = RequestOf(step.queries, false);
  alone.causal = true;
  ExpectNear(results[0].output, engine.Attend(*model, alone)->output, "the first step");
}

TEST(SessionLimits, FullPoolRefusesTheStepAndLeavesTheSessionAsItWas) {
  std::mt19937 rng(31);
  const int64_t d = 8;
  const std::shared_ptr<Model> model = MultiHeadModel(rng, 2, 4, d, d, d, true);
  // One block of keys and one of values.
  const int64_t capacity = 2 * kKvBlockRows * d * static_cast<int64_t>(sizeof(float));
  Engine engine;
  KvBlockPool pool(capacity);
  std::unique_ptr<Session> session = *Session::Open(model, pool, SelfOpen());
  Prefix prefix(1, d);
  const std::vector<float> first = RandomData(rng, (kKvBlockRows - 2) * d);
  ASSERT_TRUE(Step(engine, *session, first, kKvBlockRows - 2, d, false).status.ok());
  prefix.Add(first, kKvBlockRows - 2);
  EXPECT_EQ(pool.used_bytes(), capacity);
  const AttentionResult refused = Step(engine, *session, RandomData(rng, 5 * d), 5, d, false);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_NE(refused.status.message().find(std::to_string(capacity)), std::string::npos)
      << refused.status;
  EXPECT_TRUE(refused.output.data.empty());
  EXPECT_EQ(session->length(), kKvBlockRows - 2);
  EXPECT_EQ(pool.used_bytes(), capacity);
  const std::vector<float> next = RandomData(rng, 2 * d);
  const AttentionResult later = Step(engine, *session, next, 2, d, true);
  ASSERT_TRUE(later.status.ok()) << later.status;
  prefix.Add(next, 2);
  const AttentionResult want = CausalReference(engine, *model, prefix, 2, true);
  ExpectNear(later.output, want.output, "after the refusal");
  ExpectNear(later.attention_weights, want.attention_weights, "weights after the refusal");
  session.reset();
  EXPECT_EQ(pool.used_bytes(), 0);
}

// Sessions of the reclaim tests: dot_product rows of kReclaimWidth floats,
// held once as keys and values, a block of kReclaimBlock bytes.
constexpr int64_t kReclaimWidth = 4;
constexpr int64_t kReclaimBlock =
    kKvBlockRows * kReclaimWidth * static_cast<int64_t>(sizeof(float));

TEST(SessionLimits, FullPoolAsksItsReclaimForRoomAndTakesWhatItFrees) {
  std::mt19937 rng(34);
  const int64_t d = kReclaimWidth, block = kReclaimBlock;
  const auto model = std::make_shared<Model>(DotProductModel());
  Engine engine;
  // The reclaim ends the oldest session still held, as a server's table would.
  std::vector<std::unique_ptr<Session>> held;
  std::vector<int64_t> asked;
  KvBlockPool pool(2 * block, [&](const Session* asking, int64_t bytes) {
    EXPECT_NE(asking, nullptr);
    asked.push_back(bytes);
    if (held.empty()) return false;
    held.erase(held.begin());
    return true;
  });
  for (int i = 0; i < 2; ++i) {
    held.push_back(*Session::Open(model, pool, SelfOpen()));
    ASSERT_TRUE(Step(engine, *held.back(), RandomData(rng, 3 * d), 3, d, false).status.ok());
  }
  EXPECT_EQ(pool.used_bytes(), 2 * block);
  std::unique_ptr<Session> third = *Session::Open(model, pool, SelfOpen());
  Prefix prefix(1, d);
  const std::vector<float> rows = RandomData(rng, 5 * d);
  const AttentionResult stepped = Step(engine, *third, rows, 5, d, false);
  ASSERT_TRUE(stepped.status.ok()) << stepped.status;
  prefix.Add(rows, 5);
  ExpectNear(stepped.output, CausalReference(engine, *model, prefix, 5, false).output,
             "the step given room");
  EXPECT_EQ(asked, std::vector<int64_t>{block});
  EXPECT_EQ(held.size(), 1u);
  EXPECT_EQ(pool.used_bytes(), 2 * block);

  // Nothing left to end: the step is refused as the pool was full, and the
  // session is as it was.
  held.clear();
  std::unique_ptr<Session> fourth = *Session::Open(model, pool, SelfOpen());
  ASSERT_TRUE(Step(engine, *fourth, RandomData(rng, 3 * d), 3, d, false).status.ok());
  const AttentionResult refused =
      Step(engine, *third, RandomData(rng, kKvBlockRows * d), kKvBlockRows, d, false);
  EXPECT_TRUE(PoolWasFull(refused.status)) << refused.status;
  EXPECT_EQ(third->length(), 5);
  EXPECT_EQ(pool.used_bytes(), 2 * block);
}

TEST(SessionLimits, SessionLargerThanTheEmptyPoolIsRefusedWithoutReclaiming) {
  std::mt19937 rng(35);
  const int64_t d = kReclaimWidth, block = kReclaimBlock;
  const auto model = std::make_shared<Model>(DotProductModel());
  Engine engine;
  int asked = 0;
  KvBlockPool pool(2 * block, [&](const Session*, int64_t) {
    ++asked;
    return false;
  });
  std::unique_ptr<Session> session = *Session::Open(model, pool, SelfOpen());
  const int64_t rows = 2 * kKvBlockRows + 1;
  const AttentionResult refused = Step(engine, *session, RandomData(rng, rows * d), rows, d, false);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_FALSE(PoolWasFull(refused.status)) << refused.status;
  EXPECT_NE(refused.status.message().find(std::to_string(3 * block)), std::string::npos)
      << refused.status;
  EXPECT_NE(refused.status.message().find(std::to_string(2 * block)), std::string::npos)
      << refused.status;
  EXPECT_EQ(asked, 0);
  EXPECT_EQ(pool.used_bytes(), 0);
}

TEST(SessionLimits, FullPoolRefusesACrossOpen) {
  std::mt19937 rng(32);
  KvBlockPool pool(1000);
  const std::vector<float> keys = RandomData(rng, 2 * 3 * 4);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open(std::make_shared<Model>(DotProductModel()), pool,
                    CrossOpen({{2, 3, 4}, keys}, std::nullopt, {}));
  EXPECT_EQ(session.status().code(), absl::StatusCode::kResourceExhausted) << session.status();
  EXPECT_NE(session.status().message().find("1000"), std::string::npos) << session.status();
  EXPECT_EQ(pool.used_bytes(), 0);
}

TEST(SessionLimits, MaxLengthRefusesTheStep) {
  std::mt19937 rng(33);
  const int64_t d = 4;
  Engine engine;
  KvBlockPool pool(int64_t{1} << 24);
  const std::shared_ptr<Model> model = std::make_shared<Model>(DotProductModel());
  std::unique_ptr<Session> session = *Session::Open(model, pool, SelfOpen(1, 6));
  Prefix prefix(1, d);
  const std::vector<float> first = RandomData(rng, 5 * d);
  ASSERT_TRUE(Step(engine, *session, first, 5, d, false).status.ok());
  prefix.Add(first, 5);
  const AttentionResult refused = Step(engine, *session, RandomData(rng, 2 * d), 2, d, false);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_NE(refused.status.message().find("max_length of 6"), std::string::npos) << refused.status;
  EXPECT_EQ(session->length(), 5);
  const std::vector<float> last = RandomData(rng, d);
  const AttentionResult got = Step(engine, *session, last, 1, d, false);
  ASSERT_TRUE(got.status.ok()) << got.status;
  prefix.Add(last, 1);
  ExpectNear(got.output, CausalReference(engine, *model, prefix, 1, false).output, "last");
}

TEST(SessionLimits, StoppedStepLeavesTheSessionAsItWas) {
  std::mt19937 rng(34);
  const int64_t d = 64, n = 2048;
  Engine engine;
  KvBlockPool pool(int64_t{1} << 26);
  std::unique_ptr<Session> session =
      *Session::Open(std::make_shared<Model>(DotProductModel()), pool, SelfOpen());
  const std::vector<float> rows = RandomData(rng, n * d);
  const SessionStep step = StepOf({{1, n, d}, rows}, false);
  ValidatedStep validated = *ValidateStep(*session, step);
  validated.stop = [] { return absl::CancelledError("caller went away"); };
  AttentionResult result;
  engine.RunSteps({&validated, 1}, {&result, 1});
  EXPECT_EQ(result.status.code(), absl::StatusCode::kCancelled) << result.status;
  EXPECT_EQ(session->length(), 0);
  EXPECT_EQ(pool.used_bytes(), 0);
}

TEST(SessionOpen, RefusesWhatTheKindCannotHold) {
  std::mt19937 rng(41);
  KvBlockPool pool(1 << 20);
  const std::shared_ptr<Model> additive = KindModel(rng, Kind::kAdditive, 4, 4);
  absl::StatusOr<std::unique_ptr<Session>> self = Session::Open(additive, pool, SelfOpen());
  EXPECT_EQ(self.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(self.status().message().find("memory"), std::string::npos) << self.status();
  absl::StatusOr<std::unique_ptr<Session>> cross =
      Session::Open(additive, pool, CrossOpen({}, std::nullopt, {}));
  EXPECT_EQ(cross.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cross.status().message().find("keys"), std::string::npos) << cross.status();
}

TEST(ValidateStep, NamesTheFieldThatIsWrong) {
  std::mt19937 rng(42);
  KvBlockPool pool(1 << 20);
  std::unique_ptr<Session> session =
      *Session::Open(MultiHeadModel(rng, 2, 4, 8, 8, 8, true), pool, SelfOpen(2));
  const std::vector<float> rows(2 * 3 * 7, 0.5f);
  const SessionStep wrong_size = StepOf({{2, 3, 7}, rows}, false);
  absl::StatusOr<ValidatedStep> refused = ValidateStep(*session, wrong_size);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("queries.shape[2]"), std::string::npos)
      << refused.status();
  const SessionStep wrong_batch = StepOf({{1, 6, 7}, rows}, false);
  refused = ValidateStep(*session, wrong_batch);
  EXPECT_NE(refused.status().message().find("queries.shape[0]"), std::string::npos)
      << refused.status();
  EXPECT_EQ(session->length(), 0);
}

// The work limit counts what a step computes: its own projections and its
// attention over the rows held, not projections of those rows again, so a
// long session's single tokens pass a limit that Attend() on the prefix
// exceeds. It bounds a piece, not the step (computed in pieces): a step over
// it passes while its last token fits, and is refused once one token is
// over it.
TEST(ValidateStep, WorkLimitCountsTheStepNotTheHeldProjections) {
  std::mt19937 rng(44);
  const int64_t d = 8, length = 300;
  Limits limits;
  limits.max_request_work = 20000;
  const std::shared_ptr<Model> model = MultiHeadModel(rng, 2, 4, d, d, d, true);
  Engine engine;
  KvBlockPool pool(int64_t{1} << 24);
  std::unique_ptr<Session> session = *Session::Open(model, pool, SelfOpen());
  const std::vector<float> tokens = RandomData(rng, length * d);
  for (int64_t t = 0; t < length; ++t) {
    const SessionStep step = StepOf({{1, 1, d}, std::span(tokens).subspan(t * d, d)}, false);
    absl::StatusOr<ValidatedStep> validated = ValidateStep(*session, step, limits);
    ASSERT_TRUE(validated.ok()) << "token " << t << ": " << validated.status();
    AttentionResult result;
    engine.RunSteps({&*validated, 1}, {&result, 1});
    ASSERT_TRUE(result.status.ok()) << result.status;
  }
  const AttentionRequest prefix = RequestOf({{1, length, d}, tokens}, false);
  EXPECT_EQ(Validate(*model, prefix, limits).status().code(), absl::StatusCode::kInvalidArgument);
  // The last of 100 more tokens sees 400 keys: (4 d) d + 2 heads x 400 x 24 = 19456 units.
  const SessionStep large = StepOf({{1, 100, d}, std::span(tokens).first(100 * d)}, false);
  absl::StatusOr<ValidatedStep> accepted = ValidateStep(*session, large, limits);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_GT(ChunkRows(*accepted, 0), ChunkRows(*accepted, limits.max_request_work));
  // ... and of 200, 500 keys: 24256 units.
  const SessionStep larger = StepOf({{1, 200, d}, std::span(tokens).first(200 * d)}, false);
  const absl::StatusOr<ValidatedStep> refused = ValidateStep(*session, larger, limits);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("work units"), std::string::npos) << refused.status();
}

// Pieces of one session's prefill in the same RunSteps calls as other
// sessions' single steps (as the server batches them): every session gets
// what it gets alone and in one piece.
TEST(StepInPieces, BesideOtherSessionsStepsGetsWhatItGetsAlone) {
  std::mt19937 rng(51);
  const int64_t d = 16, n = 300, piece = 64;
  const std::shared_ptr<Model> model = MultiHeadModel(rng, 4, 4, d, d, d, true);
  Engine engine;
  KvBlockPool pool(int64_t{1} << 28);
  std::vector<std::unique_ptr<Session>> together, alone;
  for (int s = 0; s < 6; ++s) {
    (s < 3 ? together : alone).push_back(*Session::Open(model, pool, SelfOpen(s % 3 == 1 ? 2 : 1)));
  }
  const std::vector<float> prompt = RandomData(rng, n * d);
  const SessionStep prefill = StepOf({{1, n, d}, prompt}, false);
  ValidatedStep long_step = *ValidateStep(*together[0], prefill);
  AttentionResult long_result;
  while (long_step.done_rows < n) {
    std::vector<std::vector<float>> rows;
    std::vector<SessionStep> steps;
    steps.reserve(2);
    std::vector<ValidatedStep> validated = {long_step};
    validated[0].chunk_rows = piece;
    for (int s = 1; s < 3; ++s) {
      rows.push_back(RandomData(rng, together[s]->batch() * d));
      steps.push_back(StepOf({{together[s]->batch(), 1, d}, rows.back()}, s == 2));
      validated.push_back(*ValidateStep(*together[s], steps.back()));
    }
    std::vector<AttentionResult> results(3);
    results[0] = std::move(long_result);
    engine.RunSteps(validated, results);
    ASSERT_TRUE(results[0].status.ok()) << results[0].status;
    long_result = std::move(results[0]);
    long_step.done_rows += std::min(piece, n - long_step.done_rows);
    for (int s = 1; s < 3; ++s) {
      ASSERT_TRUE(results[s].status.ok()) << results[s].status;
      const AttentionResult want =
          Step(engine, *alone[s], rows[s - 1], 1, d, steps[s - 1].return_attention_weights);
      ExpectNear(results[s].output, want.output, "session " + std::to_string(s));
      ExpectNear(results[s].attention_weights, want.attention_weights, "weights");
    }
  }
  EXPECT_EQ(together[0]->length(), n);
  const AttentionResult want = Step(engine, *alone[0], prompt, n, d, false);
  ExpectNear(long_result.output, want.output, "the prefill in pieces");
}

// A step stopped between its pieces, refused by the pool at its first, or
// abandoned by its caller leaves the session as before it: same length, same
// blocks, and its next step answers as if the failed one never came.
TEST(StepInPieces, FailedOrAbandonedStepLeavesTheSessionAsBeforeIt) {
  std::mt19937 rng(52);
  const int64_t d = 8, n = 2 * kKvBlockRows + 10, piece = n / 5;
  const std::shared_ptr<Model> model = MultiHeadModel(rng, 2, 4, d, d, d, true);
  Engine engine;
  // The session's blocks with the failing step, keys and values; not those
  // and another session's.
  const int64_t block_bytes = kKvBlockRows * d * static_cast<int64_t>(sizeof(float));
  KvBlockPool pool(2 * block_bytes * internal::BlocksFor(5 + n));
  std::unique_ptr<Session> session = *Session::Open(model, pool, SelfOpen());
  Prefix prefix(1, d);
  const std::vector<float> first = RandomData(rng, 5 * d);
  ASSERT_TRUE(Step(engine, *session, first, 5, d, false).status.ok());
  prefix.Add(first, 5);
  const int64_t held = pool.used_bytes();
  const std::vector<float> rows = RandomData(rng, n * d);
  const SessionStep step = StepOf({{1, n, d}, rows}, false);

  std::atomic<bool> stopped{false};
  ValidatedStep stopping = *ValidateStep(*session, step);
  stopping.stop = [&] {
    return stopped.load() ? absl::DeadlineExceededError("deadline") : absl::OkStatus();
  };
  AttentionResult result;
  for (int p = 0; p < 2; ++p, stopping.done_rows += piece) {
    stopping.chunk_rows = piece;
    engine.RunSteps({&stopping, 1}, {&result, 1});
    ASSERT_TRUE(result.status.ok()) << result.status;
  }
  EXPECT_GT(pool.used_bytes(), held);
  stopped.store(true);
  engine.RunSteps({&stopping, 1}, {&result, 1});
  EXPECT_EQ(result.status.code(), absl::StatusCode::kDeadlineExceeded) << result.status;
  EXPECT_TRUE(result.output.data.empty());
  EXPECT_EQ(session->length(), 5);
  EXPECT_EQ(pool.used_bytes(), held);

  ValidatedStep abandoned = *ValidateStep(*session, step);
  abandoned.chunk_rows = piece;
  engine.RunSteps({&abandoned, 1}, {&result, 1});
  ASSERT_TRUE(result.status.ok()) << result.status;
  AbandonStep(abandoned);
  EXPECT_EQ(session->length(), 5);
  EXPECT_EQ(pool.used_bytes(), held);

  std::unique_ptr<Session> other = *Session::Open(model, pool, SelfOpen());
  ASSERT_TRUE(Step(engine, *other, RandomData(rng, d), 1, d, false).status.ok());
  const AttentionResult refused = Step(engine, *session, rows, n, d, false, piece);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_EQ(session->length(), 5);
  other.reset();
  EXPECT_EQ(pool.used_bytes(), held);

  const std::vector<float> next = RandomData(rng, 3 * d);
  const AttentionResult got = Step(engine, *session, next, 3, d, true, 2);
  ASSERT_TRUE(got.status.ok()) << got.status;
  prefix.Add(next, 3);
  const AttentionResult want = CausalReference(engine, *model, prefix, 3, true);
  ExpectNear(got.output, want.output, "after the failures");
  ExpectNear(got.attention_weights, want.attention_weights, "weights after the failures");
}

// multi_head's work of a self piece of `rows` rows of one example after
// `before` keys (RequestWork less the held rows' projections), written out.
double SelfPieceWork(int64_t rows, int64_t before, int64_t d, int64_t e, int64_t heads) {
  const double keys = static_cast<double>(before + rows);
  return static_cast<double>(rows) * (3.0 * d + e) * e +
         static_cast<double>(heads) * rows * keys * (2.0 * e / heads + kSoftmaxWork);
}

// ChunkRows cuts the most rows within the budget, fewer as the keys before
// them grow, at least one, and all the rest with no budget.
TEST(ChunkRows, CutsTheMostRowsWithinTheWork) {
  std::mt19937 rng(53);
  const int64_t d = 8, heads = 2, e = 8, n = 1000;
  const std::shared_ptr<Model> model = MultiHeadModel(rng, heads, 4, d, d, d, true);
  KvBlockPool pool(int64_t{1} << 24);
  std::unique_ptr<Session> session = *Session::Open(model, pool, SelfOpen());
  const std::vector<float> rows = RandomData(rng, n * d);
  const SessionStep step = StepOf({{1, n, d}, rows}, false);
  ValidatedStep validated = *ValidateStep(*session, step);
  EXPECT_EQ(ChunkRows(validated, 0), n);
  EXPECT_EQ(ChunkRows(validated, 1e30), n);
  EXPECT_EQ(ChunkRows(validated, 1), 1);
  const double budget = 200000;
  int64_t last = n, pieces = 0;
  while (validated.done_rows < n) {
    const int64_t piece = ChunkRows(validated, budget);
    const int64_t before = validated.done_rows;
    ASSERT_GE(piece, 1);
    ASSERT_LE(piece, last);
    EXPECT_LE(SelfPieceWork(piece, before, d, e, heads), budget) << "at " << before;
    if (before + piece < n) {
      EXPECT_GT(SelfPieceWork(piece + 1, before, d, e, heads), budget) << "at " << before;
    }
    last = piece;
    validated.done_rows += piece;
    ++pieces;
  }
  EXPECT_EQ(validated.done_rows, n);
  EXPECT_GT(pieces, 3);
}

TEST(SessionOpen, KeepsItsModelVersion) {
  std::mt19937 rng(43);
  KvBlockPool pool(1 << 20);
  std::shared_ptr<Model> model = MultiHeadModel(rng, 2, 4, 8, 8, 8, true);
  std::weak_ptr<Model> version = model;
  std::unique_ptr<Session> session = *Session::Open(model, pool, SelfOpen());
  model.reset();  // a reload replaced the version the server holds
  EXPECT_FALSE(version.expired());
  EXPECT_EQ(&session->model(), version.lock().get());
  session.reset();
  EXPECT_TRUE(version.expired());
}

// A one-token step over a long context on an engine that splits its keys
// (EngineOptions::split_keys) answers as one that does not, to float
// rounding: 3-D rows, grouped heads folded (4-D, keys and values apart),
// a window with a soft-cap, and weights asked for (served unsplit).
TEST(SelfSession, SplitKeysMatchUnsplitSteps) {
  struct Config {
    int64_t heads, kv_heads;  // 0: 3-D rows
    int64_t window;
    float softcap;
    bool weights;
  };
  constexpr int64_t kSize = 16, kContext = 4500;
  Engine split(EngineOptions{.num_threads = 2, .serial_work = -1});
  Engine unsplit(EngineOptions{.num_threads = 2, .serial_work = -1, .split_keys = false});
  auto model = std::make_shared<const Model>(DotProductModel());
  std::mt19937 rng(41);
  for (const Config& config : {Config{0, 0, 0, 0, false}, Config{8, 2, 0, 0, false},
                               Config{8, 2, 0, 3.0f, false}, Config{0, 0, 2500, 5.0f, false},
                               Config{8, 2, 0, 0, true}}) {
    SCOPED_TRACE("heads " + std::to_string(config.heads) + " window " +
                 std::to_string(config.window) + " weights " + std::to_string(config.weights));
    const bool grouped = config.heads > 0;
    const int64_t heads = grouped ? config.heads : 1, kv_heads = grouped ? config.kv_heads : 1;
    const std::vector<float> queries = RandomData(rng, heads * kSize);
    const std::vector<float> keys = RandomData(rng, kv_heads * kSize);
    const std::vector<float> values = RandomData(rng, kv_heads * kSize);
    SessionStep step{.queries = grouped ? TensorView{{1, 1, heads, kSize}, queries}
                                        : TensorView{{1, 1, kSize}, queries},
                     .return_attention_weights = config.weights};
    if (grouped) {
      step.keys = TensorView{{1, 1, kv_heads, kSize}, keys};
      step.values = TensorView{{1, 1, kv_heads, kSize}, values};
    }
    KvBlockPool pool(int64_t{1} << 30);
    std::vector<AttentionResult> answers[2];
    Engine* engines[2] = {&split, &unsplit};
    for (int e = 0; e < 2; ++e) {
      absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(
          model, pool,
          {.memory = SessionMemory::kSelf, .sliding_window = config.window, .softcap = config.softcap});
      ASSERT_TRUE(session.ok()) << session.status();
      for (int t = 0; t < 3; ++t) {
        absl::StatusOr<ValidatedStep> validated = ValidateStep(**session, step);
        ASSERT_TRUE(validated.ok()) << validated.status();
        AttentionResult& result = answers[e].emplace_back();
        engines[e]->RunSteps({&*validated, 1}, {&result, 1});
        ASSERT_TRUE(result.status.ok()) << result.status;
        if (t == 0) {
          ASSERT_TRUE(internal::AppendUncomputed(**session, kContext, 7).ok());
        }
      }
    }
    for (int t = 0; t < 3; ++t) {
      const std::vector<float>& got = answers[0][t].output.data;
      const std::vector<float>& want = answers[1][t].output.data;
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], want[i], 1e-6 + 1e-5 * std::abs(want[i])) << "step " << t << " at " << i;
      }
      EXPECT_EQ(answers[0][t].attention_weights.data, answers[1][t].attention_weights.data);
    }
  }
}

}  // namespace
}  // namespace attention
