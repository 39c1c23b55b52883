// session_test.cc: decoding sessions (core/sessions/session.h) against Engine::Attend.
//
// Step by step, a self session's outputs and weights equal Attend() on the
// whole prefix with causal = true, and a cross session's equal Attend() with
// its fixed keys and values, for every kind, prefill then single steps,
// lengths at the block edges, B > 1 and valid lengths; several sessions in
// one RunSteps get what they get alone; a step refused by the pool, by
// max_length or by its stop leaves its session as it was; blocks go back to
// the pool. Run once per kernel path (tests/CMakeLists.txt).
#include "core/sessions/session.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/engine/engine.h"
#include "tests/core/random_weights.h"

namespace attention {
namespace {

using testing::RandomMatrix;
using testing::RandomVector;

std::vector<float> RandomData(std::mt19937& rng, int64_t size) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> data(size);
  for (float& x : data) x = normal(rng);
  return data;
}

// A multi_head model of E = heads * head_size over inputs of the given sizes.
std::shared_ptr<Model> MultiHeadModel(std::mt19937& rng, int64_t heads, int64_t head_size,
                                      int64_t d_q, int64_t d_k, int64_t d_v, bool packed,
                                      Precision precision = Precision::kFp32) {
  auto m = std::make_shared<Model>();
  m->kind = Kind::kMultiHead;
  m->name = "multi_head";
  m->num_heads = heads;
  m->query_size = d_q;
  m->key_size = d_k;
  m->value_size = d_v;
  m->output_size = heads * head_size;
  m->precision = precision;
  const int64_t e = m->output_size;
  m->w_q = RandomMatrix(rng, e, d_q);
  m->w_k = RandomMatrix(rng, e, d_k);
  m->w_v = RandomMatrix(rng, e, d_v);
  m->w_o = RandomMatrix(rng, e, e);
  m->b_q = RandomVector(rng, e);
  m->b_k = RandomVector(rng, e);
  m->b_v = RandomVector(rng, e);
  m->b_o = RandomVector(rng, e);
  if (packed) PackProjections(*m);
  return m;
}

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

// One step of `n` rows through RunSteps.
AttentionResult Step(Engine& engine, Session& session, const std::vector<float>& rows, int64_t n,
                     int64_t d, bool weights) {
  const SessionStep step = StepOf({{session.batch(), n, d}, rows}, weights);
  absl::StatusOr<ValidatedStep> validated = ValidateStep(session, step);
  if (!validated.ok()) return {{}, {}, validated.status()};
  AttentionResult result;
  engine.RunSteps({&*validated, 1}, {&result, 1});
  return result;
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

// A self session stepped by `schedule` (tokens per step) against the causal
// prefix after every step.
void CheckSelfSession(const std::shared_ptr<Model>& model, int64_t batch, int64_t d,
                      const std::vector<int64_t>& schedule, double atol = 1e-5) {
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
    const AttentionResult got = Step(engine, **session, rows, n, d, weights);
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

// A cross session of `kind` against Attend() with its keys and values.
void CheckCrossSession(Kind kind, std::vector<int32_t> valid_lens) {
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
    const AttentionResult got = Step(engine, **session, queries, n, d_q, true);
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
// exceeds; a step that would itself exceed it is refused.
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
  const SessionStep large = StepOf({{1, 100, d}, std::span(tokens).first(100 * d)}, false);
  const absl::StatusOr<ValidatedStep> refused = ValidateStep(*session, large, limits);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("work units"), std::string::npos) << refused.status();
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

}  // namespace
}  // namespace attention
