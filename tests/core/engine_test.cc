// engine_test.cc: the engine against the plain reference, as properties.
//
// Random shapes (1, primes, tile edges), every mask form, causal, scale
// override, the self-attention shorthand and every kind, at every thread count
// from 1 to the machine's cores; and a ragged batch through Engine::Run, in
// one execution or split into groups, must equal each request computed alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "core/engine/engine.h"
#include "tests/core/random_weights.h"
#include "tests/core/reference_attention.h"

namespace attention {
namespace {

using testing::ReferenceAttention;
using testing::RandomMatrix;
using testing::RandomVector;

constexpr int64_t kSizes[] = {1, 2, 3, 5, 7, 13, 31, 64, 67};

// A model of `kind` with random weights for inputs of the given sizes.
Model RandomModel(Kind kind, std::mt19937& rng, int64_t d_q, int64_t d_k, int64_t d_v) {
  Model m;
  m.kind = kind;
  m.name = std::string(KindName(kind));
  switch (kind) {
    case Kind::kDotProduct:
    case Kind::kDistance:
      break;
    case Kind::kAdditive: {
      const int64_t hidden = 1 + rng() % 20;
      m.query_size = d_q;
      m.key_size = d_k;
      m.w_q = RandomMatrix(rng, hidden, d_q);
      m.w_k = RandomMatrix(rng, hidden, d_k);
      m.w_v = RandomMatrix(rng, 1, hidden);
      break;
    }
    case Kind::kBilinear:
      m.query_size = d_q;
      m.key_size = d_k;
      m.w_k = RandomMatrix(rng, d_q, d_k);
      break;
    case Kind::kMultiHead: {
      const int64_t heads = 1 + rng() % 4;
      const int64_t width = heads * (1 + rng() % 9);
      m.num_heads = heads;
      m.query_size = d_q;
      m.key_size = d_k;
      m.value_size = d_v;
      m.output_size = width;
      m.w_q = RandomMatrix(rng, width, d_q);
      m.w_k = RandomMatrix(rng, width, d_k);
      m.w_v = RandomMatrix(rng, width, d_v);
      m.w_o = RandomMatrix(rng, width, width);
      m.b_q = RandomVector(rng, width);
      m.b_k = RandomVector(rng, width);
      m.b_v = RandomVector(rng, width);
      m.b_o = RandomVector(rng, width);
      // Half the models take the fused Q/K/V product for self-attention.
      if (rng() % 2 == 0) PackProjections(m);
      break;
    }
  }
  return m;
}

// A random request and the tensors it views.
struct Case {
  Tensor queries, keys, values;
  std::vector<int32_t> valid_lens;
  AttentionRequest request;
};

Tensor RandomTensor(std::mt19937& rng, int64_t b, int64_t n, int64_t d) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Tensor t{{b, n, d}, std::vector<float>(b * n * d)};
  for (float& x : t.data) x = normal(rng);
  return t;
}

std::unique_ptr<Case> RandomCase(std::mt19937& rng, Kind kind, Model& model) {
  auto c = std::make_unique<Case>();
  auto pick = [&] { return kSizes[rng() % std::size(kSizes)]; };
  const int64_t batch = 1 + rng() % 3;
  const int64_t n_q = pick();
  const bool self = rng() % 4 == 0;
  const int64_t n_k = self ? n_q : pick();
  const int64_t d_q = pick();
  const bool same_d = kind == Kind::kDotProduct || kind == Kind::kDistance || self;
  const int64_t d_k = same_d ? d_q : pick();
  const int64_t d_v = self ? d_k : pick();
  model = RandomModel(kind, rng, d_q, d_k, d_v);

  c->queries = RandomTensor(rng, batch, n_q, d_q);
  c->request.queries = c->queries.view();
  if (!self) {
    c->keys = RandomTensor(rng, batch, n_k, d_k);
    c->values = RandomTensor(rng, batch, n_k, d_v);
    c->request.keys = c->keys.view();
    c->request.values = c->values.view();
  }
  switch (rng() % 3) {
    case 0:
      break;
    case 1:
      for (int64_t b = 0; b < batch; ++b) c->valid_lens.push_back(rng() % (n_k + 3));
      break;
    case 2:
      for (int64_t i = 0; i < batch * n_q; ++i) c->valid_lens.push_back(rng() % (n_k + 3));
      break;
  }
  c->request.valid_lens = c->valid_lens;
  c->request.causal = rng() % 2 == 0;
  c->request.return_attention_weights = rng() % 2 == 0;
  if (kind != Kind::kAdditive && rng() % 4 == 0) c->request.scale = 0.1f + (rng() % 20) * 0.1f;
  return c;
}

// Defaults for the engine against the reference, which sums in another order.
void ExpectNear(const Tensor& actual, const Tensor& expected, const char* what,
                float absolute = 1e-5f, float relative = 1e-4f) {
  ASSERT_EQ(actual.shape, expected.shape) << what;
  int reported = 0;
  for (size_t i = 0; i < expected.data.size(); ++i) {
    const float tolerance = absolute + relative * std::abs(expected.data[i]);
    if (std::abs(actual.data[i] - expected.data[i]) > tolerance && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: expected " << expected.data[i] << ", got "
                    << actual.data[i];
    }
  }
}

class EngineVsReference : public ::testing::TestWithParam<Kind> {};

TEST_P(EngineVsReference, RandomRequestsAtEveryThreadCount) {
  const int cores = std::max(1u, std::thread::hardware_concurrency());
  std::mt19937 rng(1234 + static_cast<int>(GetParam()));
  for (int threads = 1; threads <= cores; ++threads) {
    // serial_work < 0: these small cases would otherwise run on the caller
    // alone and never exercise the parallel phases.
    Engine engine(EngineOptions{.num_threads = threads, .serial_work = -1});
    for (int trial = 0; trial < 40; ++trial) {
      Model model;
      auto c = RandomCase(rng, GetParam(), model);
      SCOPED_TRACE(::testing::Message()
                   << "threads " << threads << " trial " << trial << " shape q "
                   << c->queries.shape[0] << "x" << c->queries.shape[1] << "x"
                   << c->queries.shape[2] << " lens " << c->valid_lens.size() << " causal "
                   << c->request.causal);
      absl::StatusOr<AttentionResult> result = engine.Attend(model, c->request);
      ASSERT_TRUE(result.ok()) << result.status();
      const AttentionResult expected = ReferenceAttention(model, c->request);
      ExpectNear(result->output, expected.output, "output");
      if (c->request.return_attention_weights) {
        ExpectNear(result->attention_weights, expected.attention_weights, "weights");
      } else {
        EXPECT_TRUE(result->attention_weights.data.empty());
      }
    }
  }
}

// A request with keys and values given, of the feature sizes of `first` (so
// it fits the same model), `mask`: 0 no valid_lens, 1 per example, 2 per query.
std::unique_ptr<Case> RequestLike(std::mt19937& rng, const Case& first, int64_t batch,
                                  int64_t n_q, int64_t n_k, int mask, bool causal,
                                  bool weights) {
  const int64_t d_q = first.queries.shape[2];
  const int64_t d_k = first.request.keys ? first.keys.shape[2] : d_q;
  const int64_t d_v = first.request.values ? first.values.shape[2] : d_k;
  auto c = std::make_unique<Case>();
  c->queries = RandomTensor(rng, batch, n_q, d_q);
  c->keys = RandomTensor(rng, batch, n_k, d_k);
  c->values = RandomTensor(rng, batch, n_k, d_v);
  c->request.queries = c->queries.view();
  c->request.keys = c->keys.view();
  c->request.values = c->values.view();
  const int64_t lens = mask == 0 ? 0 : mask == 1 ? batch : batch * n_q;
  for (int64_t i = 0; i < lens; ++i) c->valid_lens.push_back(rng() % (n_k + 1));
  c->request.valid_lens = c->valid_lens;
  c->request.causal = causal;
  c->request.return_attention_weights = weights;
  return c;
}

// Runs `cases` as one batch through `engine` and expects each answer to be
// what `alone` computes for that request by itself: the same arithmetic, but
// projections of other row blocks, which OpenBLAS may sum in another order.
void ExpectBatchEqualsAlone(Engine& engine, Engine& alone, const Model& model,
                            const std::vector<std::unique_ptr<Case>>& cases) {
  std::vector<ValidatedRequest> batch;
  for (const auto& c : cases) {
    absl::StatusOr<AttentionDims> dims = Validate(model, c->request);
    ASSERT_TRUE(dims.ok()) << dims.status();
    batch.push_back({&c->request, *dims});
  }
  std::vector<AttentionResult> results(batch.size());
  engine.Run(model, batch, results);
  for (size_t r = 0; r < cases.size(); ++r) {
    SCOPED_TRACE(::testing::Message() << "request " << r);
    absl::StatusOr<AttentionResult> expected = alone.Attend(model, cases[r]->request);
    ASSERT_TRUE(expected.ok()) << expected.status();
    ExpectNear(results[r].output, expected->output, "output", 1e-6f, 1e-5f);
    ExpectNear(results[r].attention_weights, expected->attention_weights, "weights", 1e-6f, 1e-5f);
  }
}

// One model of `kind` and a batch for it: a RandomCase, then `extras`
// requests of other B, n_q and n_k (same feature sizes), cycling through the
// mask forms, causal or not, some asking for weights.
std::vector<std::unique_ptr<Case>> RandomBatch(std::mt19937& rng, Kind kind, Model& model,
                                               int extras) {
  std::vector<std::unique_ptr<Case>> cases;
  cases.push_back(RandomCase(rng, kind, model));
  for (int extra = 0; extra < extras; ++extra) {
    const int64_t batch = 1 + rng() % 3, n_q = kSizes[rng() % 9], n_k = kSizes[rng() % 9];
    cases.push_back(RequestLike(rng, *cases[0], batch, n_q, n_k, /*mask=*/extra % 3,
                                /*causal=*/extra % 2 == 1, /*weights=*/extra % 4 == 0));
  }
  return cases;
}

TEST_P(EngineVsReference, RaggedBatchEqualsEachRequestAlone) {
  std::mt19937 rng(99 + static_cast<int>(GetParam()));
  Engine engine;
  for (int trial = 0; trial < 10; ++trial) {
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    Model model;
    const std::vector<std::unique_ptr<Case>> cases = RandomBatch(rng, GetParam(), model, 4);
    ExpectBatchEqualsAlone(engine, engine, model, cases);
  }
}

// Floats of token rows a request counts for against max_group_floats, as
// engine.h defines them.
int64_t GroupFloats(const Model& model, const AttentionDims& d) {
  const int64_t widest = std::max({d.query_size, d.key_size, d.value_size, d.output_size,
                                   static_cast<int64_t>(model.w_q.rows())});
  return d.batch * (d.num_queries + d.num_keys) * widest;
}

// With a group bound of about two requests, Run() splits this batch into
// several groups, merging small requests and running the one over the bound
// on its own, and every answer must still be the request's alone.
TEST_P(EngineVsReference, BatchSplitIntoGroupsEqualsEachRequestAlone) {
  std::mt19937 rng(7 + static_cast<int>(GetParam()));
  Engine alone;
  for (int trial = 0; trial < 5; ++trial) {
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    Model model;
    std::vector<std::unique_ptr<Case>> cases = RandomBatch(rng, GetParam(), model, 9);
    int64_t largest = 0;
    for (const auto& c : cases) {
      absl::StatusOr<AttentionDims> dims = Validate(model, c->request);
      ASSERT_TRUE(dims.ok()) << dims.status();
      largest = std::max(largest, GroupFloats(model, *dims));
    }
    // Over twice the largest of the others (kSizes tops out at 67).
    const size_t big = cases.size() / 2;
    cases.insert(cases.begin() + big, RequestLike(rng, *cases[0], 3, 150, 160, /*mask=*/2,
                                                  /*causal=*/true, /*weights=*/true));
    absl::StatusOr<AttentionDims> big_dims = Validate(model, cases[big]->request);
    ASSERT_TRUE(big_dims.ok()) << big_dims.status();
    ASSERT_GT(GroupFloats(model, *big_dims), 2 * largest);

    Engine engine(EngineOptions{.max_group_floats = 2 * largest});
    ExpectBatchEqualsAlone(engine, alone, model, cases);
  }
}

INSTANTIATE_TEST_SUITE_P(AllKinds, EngineVsReference,
                         ::testing::Values(Kind::kDotProduct, Kind::kDistance, Kind::kAdditive,
                                           Kind::kBilinear, Kind::kMultiHead),
                         [](const auto& info) { return std::string(KindName(info.param)); });

TEST(Engine, ValidLenZeroGivesUniformWeights) {
  Tensor q{{1, 2, 3}, {1, 2, 3, 4, 5, 6}};
  Tensor k{{1, 4, 3}, {9, 1, 0, 2, 2, 2, -1, 0, 5, 3, 3, 3}};
  Tensor v{{1, 4, 2}, {1, 10, 2, 20, 3, 30, 4, 40}};
  const std::vector<int32_t> lens = {0};
  AttentionRequest request{q.view(), k.view(), v.view(), lens, false, true, std::nullopt};
  Engine engine;
  absl::StatusOr<AttentionResult> result = engine.Attend(DotProductModel(), request);
  ASSERT_TRUE(result.ok());
  for (float w : result->attention_weights.data) EXPECT_FLOAT_EQ(w, 0.25f);
  EXPECT_FLOAT_EQ(result->output.data[0], 2.5f);
  EXPECT_FLOAT_EQ(result->output.data[1], 25.0f);
}

// Value rows past every allowed key are projected only when read (RowsRead,
// core/engine/run_multi_head.cc): here every allowed score is -1e6 - 1, so each disallowed
// key (score -1e6) weighs e times an allowed one and the answer needs all
// value rows. Each request runs after one with other inputs of the same
// shape, so rows it failed to project would hold that run's values, not
// zeros or its own.
TEST(Engine, MultiHeadReadsValueRowsPastTheBoundWhenDisallowedKeysCarryWeight) {
  constexpr int64_t kHeads = 2, kWidth = 4, kBatch = 3, kTokens = 9;
  std::mt19937 rng(7);
  for (const bool packed : {false, true}) {
    Model m;
    m.kind = Kind::kMultiHead;
    m.name = "multi_head";
    m.num_heads = kHeads;
    m.query_size = m.key_size = m.value_size = m.output_size = kWidth;
    // Every head's q = (1000, 1) and k = -q: with scale 1 every score is
    // -1e6 - 1, exactly, in float as in double.
    m.w_q = RowMatrix::Zero(kWidth, kWidth);
    m.w_k = RowMatrix::Zero(kWidth, kWidth);
    m.b_q = Vector{{1000.0f, 1.0f, 1000.0f, 1.0f}};
    m.b_k = -m.b_q;
    m.w_v = RandomMatrix(rng, kWidth, kWidth);
    m.b_v = RandomVector(rng, kWidth);
    m.w_o = RowMatrix::Identity(kWidth, kWidth);
    m.b_o = Vector::Zero(kWidth);
    if (packed) PackProjections(m);
    for (const bool weights : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "packed " << packed << " weights " << weights);
      const Tensor other = RandomTensor(rng, kBatch, kTokens, kWidth);
      const Tensor tokens = RandomTensor(rng, kBatch, kTokens, kWidth);
      const std::vector<int32_t> lens = {2, 5, 9};
      Engine engine(EngineOptions{.num_threads = 2});
      AttentionRequest before{other.view(), std::nullopt, std::nullopt, {}, false, false,
                              std::nullopt};
      ASSERT_TRUE(engine.Attend(m, before).ok());
      AttentionRequest request{tokens.view(), std::nullopt, std::nullopt, lens, false, weights,
                               1.0f};
      absl::StatusOr<AttentionResult> result = engine.Attend(m, request);
      ASSERT_TRUE(result.ok()) << result.status();
      const AttentionResult expected = ReferenceAttention(m, request);
      ExpectNear(result->output, expected.output, "output");
      if (weights) ExpectNear(result->attention_weights, expected.attention_weights, "weights");
      // The rule's answer, not the allowed keys' alone: a disallowed key of
      // the first example weighs e / (2 + 7e).
      const float masked_weight = std::exp(1.0f) / (2.0f + 7.0f * std::exp(1.0f));
      if (weights) {
        EXPECT_NEAR(result->attention_weights.data[kTokens - 1], masked_weight, 1e-5f);
      }
    }
  }
}

}  // namespace
}  // namespace attention
