// layer_terms_test.cc: grouped heads, positions and score terms (docs/api.md
// 2.8) against a plain-loop reference in double, at sizes the conformance
// cases do not reach: several key chunks and query tiles, several session
// blocks, windows that leave whole tiles out. Run once per kernel path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/engine/engine.h"
#include "core/model/layer_config.h"
#include "core/sessions/session.h"
#include "tests/core/random_weights.h"

namespace attention {
namespace {

using testing::RandomMatrix;
using testing::RandomVector;

std::vector<float> RandomFloats(std::mt19937& rng, int64_t count, float spread = 1.0f) {
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

// One head's rule in double: scores with the terms, the masks, the softmax
// with the sink, the weighted values.
struct HeadInput {
  const std::vector<double>* q;  // n_q x d
  const std::vector<double>* k;  // n_k x d
  const std::vector<double>* v;  // n_k x dv
  int64_t n_q, n_k, d, dv;
  double scale;
  bool causal;
  int64_t valid_len;  // n_k: none
  int64_t window;     // 0: none
  double alibi_slope, softcap;
  bool has_sink;
  double sink;
};

std::vector<double> ReferenceHead(const HeadInput& in) {
  std::vector<double> out(in.n_q * in.dv, 0.0);
  for (int64_t i = 0; i < in.n_q; ++i) {
    std::vector<double> s(in.n_k);
    for (int64_t j = 0; j < in.n_k; ++j) {
      const bool allowed = j < in.valid_len && (!in.causal || j <= i) &&
                           (in.window == 0 || i - j < in.window);
      if (!allowed) {
        s[j] = -1e6;
        continue;
      }
      double dot = 0;
      for (int64_t c = 0; c < in.d; ++c) dot += (*in.q)[i * in.d + c] * (*in.k)[j * in.d + c];
      double score = in.scale * dot + in.alibi_slope * static_cast<double>(j - i);
      if (in.softcap != 0) score = in.softcap * std::tanh(score / in.softcap);
      s[j] = score;
    }
    double top = in.has_sink ? in.sink : -std::numeric_limits<double>::infinity();
    for (double x : s) top = std::max(top, x);
    double sum = in.has_sink ? std::exp(in.sink - top) : 0.0;
    for (double& x : s) sum += (x = std::exp(x - top));
    for (int64_t j = 0; j < in.n_k; ++j) {
      for (int64_t c = 0; c < in.dv; ++c) out[i * in.dv + c] += s[j] / sum * (*in.v)[j * in.dv + c];
    }
  }
  return out;
}

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want, double tolerance) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tolerance * (1 + std::abs(want[i]))) << "element " << i;
  }
}

Engine& SharedEngine() {
  static auto* engine = new Engine;
  return *engine;
}

struct GroupedCase {
  int64_t batch, n_q, n_k, heads, kv_heads, d, dv;
  bool causal;
  int64_t window;
  float softcap;
};

class GroupedDotProduct : public ::testing::TestWithParam<GroupedCase> {};

// Head h of example b of a (B, n, heads, width) tensor, in double.
std::vector<double> HeadRows(const std::vector<float>& data, int64_t b, int64_t n, int64_t heads,
                             int64_t h, int64_t width) {
  std::vector<double> rows(n * width);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < width; ++c) rows[t * width + c] = data[((b * n + t) * heads + h) * width + c];
  }
  return rows;
}

TEST_P(GroupedDotProduct, MatchesTheRuleOfEachHead) {
  const GroupedCase g = GetParam();
  std::mt19937 rng(7);
  const std::vector<float> q = RandomFloats(rng, g.batch * g.n_q * g.heads * g.d);
  const std::vector<float> k = RandomFloats(rng, g.batch * g.n_k * g.kv_heads * g.d);
  const std::vector<float> v = RandomFloats(rng, g.batch * g.n_k * g.kv_heads * g.dv);
  AttentionRequest request;
  request.queries = {{g.batch, g.n_q, g.heads, g.d}, q};
  request.keys = TensorView{{g.batch, g.n_k, g.kv_heads, g.d}, k};
  request.values = TensorView{{g.batch, g.n_k, g.kv_heads, g.dv}, v};
  request.causal = g.causal;
  if (g.window > 0) request.sliding_window = g.window;
  if (g.softcap > 0) request.softcap = g.softcap;
  request.return_attention_weights = g.n_q * g.n_k < 5000;
  absl::StatusOr<AttentionResult> result = SharedEngine().Attend(DotProductModel(), request);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->output.shape, (std::vector<int64_t>{g.batch, g.n_q, g.heads, g.dv}));
  for (int64_t b = 0; b < g.batch; ++b) {
    for (int64_t h = 0; h < g.heads; ++h) {
      const int64_t kv = h / (g.heads / g.kv_heads);
      const std::vector<double> qh = HeadRows(q, b, g.n_q, g.heads, h, g.d);
      const std::vector<double> kh = HeadRows(k, b, g.n_k, g.kv_heads, kv, g.d);
      const std::vector<double> vh = HeadRows(v, b, g.n_k, g.kv_heads, kv, g.dv);
      const std::vector<double> want = ReferenceHead(
          {&qh, &kh, &vh, g.n_q, g.n_k, g.d, g.dv, 1 / std::sqrt(static_cast<double>(g.d)),
           g.causal, g.n_k, g.window, 0.0, g.softcap, false, 0.0});
      std::vector<float> got(g.n_q * g.dv);
      for (int64_t i = 0; i < g.n_q; ++i) {
        for (int64_t c = 0; c < g.dv; ++c) {
          got[i * g.dv + c] = result->output.data[((b * g.n_q + i) * g.heads + h) * g.dv + c];
        }
      }
      ExpectNear(got, want, 2e-4);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupedDotProduct,
    ::testing::Values(GroupedCase{2, 5, 9, 4, 2, 8, 8, false, 0, 0},
                      GroupedCase{1, 1, 700, 8, 2, 64, 64, false, 0, 0},
                      GroupedCase{1, 300, 300, 4, 1, 32, 16, true, 70, 0},
                      GroupedCase{2, 130, 130, 6, 3, 16, 16, true, 0, 30},
                      GroupedCase{1, 200, 600, 2, 2, 32, 32, false, 100, 20}));

TEST(GroupedDotProduct, RefusesMixedRanksAndUngroupedHeads) {
  std::vector<float> q(2 * 3 * 4 * 8), k3(2 * 3 * 8), k4(2 * 3 * 3 * 8);
  AttentionRequest request;
  request.queries = {{2, 3, 4, 8}, q};
  request.keys = TensorView{{2, 3, 8}, k3};
  absl::StatusOr<AttentionDims> dims = Validate(DotProductModel(), request);
  ASSERT_FALSE(dims.ok());
  EXPECT_NE(dims.status().message().find("keys.shape: expected rank 4"), std::string::npos)
      << dims.status();
  request.keys = TensorView{{2, 3, 3, 8}, k4};
  dims = Validate(DotProductModel(), request);
  ASSERT_FALSE(dims.ok());
  EXPECT_NE(dims.status().message().find("multiple of the keys' kv heads H_kv = 3"),
            std::string::npos)
      << dims.status();
}

// A session of grouped heads whose steps bring their own keys and values
// (an attention offload): its outputs are those of Attend on the whole
// prefix, causal, with the session's window and soft-cap.
TEST(GroupedDotProduct, SessionStepsWithTheirOwnKeysAndValuesMatchAttend) {
  const int64_t batch = 2, n = 300, heads = 4, kv_heads = 2, d = 16, dv = 8, prefill = 270;
  std::mt19937 rng(5);
  const std::vector<float> q = RandomFloats(rng, batch * n * heads * d);
  const std::vector<float> k = RandomFloats(rng, batch * n * kv_heads * d);
  const std::vector<float> v = RandomFloats(rng, batch * n * kv_heads * dv);
  AttentionRequest whole;
  whole.queries = {{batch, n, heads, d}, q};
  whole.keys = TensorView{{batch, n, kv_heads, d}, k};
  whole.values = TensorView{{batch, n, kv_heads, dv}, v};
  whole.causal = true;
  whole.sliding_window = 100;
  whole.softcap = 20;
  absl::StatusOr<AttentionResult> want = SharedEngine().Attend(DotProductModel(), whole);
  ASSERT_TRUE(want.ok()) << want.status();
  KvBlockPool pool(int64_t{1} << 26);
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(
      std::make_shared<Model>(DotProductModel()), pool,
      {.memory = SessionMemory::kSelf, .batch = batch, .sliding_window = 100, .softcap = 20});
  ASSERT_TRUE(session.ok()) << session.status();
  // Rows [begin, begin + rows) of every example of a (B, n, heads, width) tensor.
  auto rows_of = [&](const std::vector<float>& all, int64_t begin, int64_t rows, int64_t width) {
    std::vector<float> part;
    for (int64_t b = 0; b < batch; ++b) {
      part.insert(part.end(), all.begin() + (b * n + begin) * width,
                  all.begin() + (b * n + begin + rows) * width);
    }
    return part;
  };
  for (int64_t begin = 0; begin < n;) {
    const int64_t rows = begin == 0 ? prefill : 1;
    const std::vector<float> step_q = rows_of(q, begin, rows, heads * d);
    const std::vector<float> step_k = rows_of(k, begin, rows, kv_heads * d);
    const std::vector<float> step_v = rows_of(v, begin, rows, kv_heads * dv);
    SessionStep step{.queries = {{batch, rows, heads, d}, step_q}};
    step.keys = TensorView{{batch, rows, kv_heads, d}, step_k};
    step.values = TensorView{{batch, rows, kv_heads, dv}, step_v};
    absl::StatusOr<ValidatedStep> validated = ValidateStep(**session, step);
    ASSERT_TRUE(validated.ok()) << validated.status();
    AttentionResult result;
    SharedEngine().RunSteps({&*validated, 1}, {&result, 1});
    ASSERT_TRUE(result.status.ok()) << result.status;
    ASSERT_EQ(result.output.shape, (std::vector<int64_t>{batch, rows, heads, dv}));
    const std::vector<float> expected = rows_of(want->output.data, begin, rows, heads * dv);
    for (size_t i = 0; i < expected.size(); ++i) {
      ASSERT_NEAR(result.output.data[i], expected[i], 1e-5) << "row " << begin << " element " << i;
    }
    begin += rows;
  }
  // A step must bring what the first one did.
  const std::vector<float> step_q = rows_of(q, 0, 1, heads * d);
  SessionStep without_keys{.queries = {{batch, 1, heads, d}, step_q}};
  absl::StatusOr<ValidatedStep> refused = ValidateStep(**session, without_keys);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("keys: required"), std::string::npos)
      << refused.status();
}

// A Hugging Face layer built by hand: GQA, rotary at the given positions
// (halves or interleaved), qk-norm per head, and the score terms.
struct LayerCase {
  int64_t hidden, heads, kv_heads, head_size;
  bool interleaved, norm, alibi;
  int64_t window;
  float softcap;
  bool sinks;
};

Model LayerModel(const LayerCase& c, std::mt19937& rng) {
  Model m;
  m.name = "layer";
  m.kind = Kind::kMultiHead;
  m.num_heads = c.heads;
  m.num_kv_heads = c.kv_heads;
  m.head_size = c.head_size;
  m.query_size = m.key_size = m.value_size = m.output_size = c.hidden;
  m.w_q = RandomMatrix(rng, c.heads * c.head_size, c.hidden);
  m.w_k = RandomMatrix(rng, c.kv_heads * c.head_size, c.hidden);
  m.w_v = RandomMatrix(rng, c.kv_heads * c.head_size, c.hidden);
  m.w_o = RandomMatrix(rng, c.hidden, c.heads * c.head_size);
  m.b_q = RandomVector(rng, c.heads * c.head_size);
  m.b_k = RandomVector(rng, c.kv_heads * c.head_size);
  m.b_v = RandomVector(rng, c.kv_heads * c.head_size);
  m.b_o = RandomVector(rng, c.hidden);
  LayerTerms& t = m.terms;
  if (c.alibi) {
    t.alibi_slopes = AlibiSlopes(c.heads);
  } else {
    t.rotary.dims = c.head_size;
    t.rotary.interleaved = c.interleaved;
    for (int64_t f = 0; f < c.head_size / 2; ++f) {
      t.rotary.inv_freq.push_back(1.0 / std::pow(10000.0, 2.0 * f / c.head_size));
    }
  }
  if (c.norm) {
    t.q_norm = RandomFloats(rng, c.head_size, 0.3f);
    t.k_norm = RandomFloats(rng, c.head_size, 0.3f);
    for (float& w : t.q_norm) w += 1;
    for (float& w : t.k_norm) w += 1;
  }
  t.sliding_window = c.window;
  t.softcap = c.softcap;
  if (c.sinks) t.sinks = RandomFloats(rng, c.heads);
  PackProjections(m);
  return m;
}

// The layer of docs/api.md 2.8 in double, for one example of n tokens at
// `positions`, causal.
std::vector<double> ReferenceLayer(const Model& packed, const LayerCase& c,
                                   const std::vector<float>& x, int64_t n,
                                   const std::vector<int64_t>& positions) {
  Model m = packed;
  UnpackProjections(m);
  const int64_t hd = c.head_size;
  auto project = [&](const RowMatrix& w, const Vector& b) {
    std::vector<double> y(n * w.rows());
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t o = 0; o < w.rows(); ++o) {
        double sum = b[o];
        for (int64_t i = 0; i < c.hidden; ++i) sum += double{w(o, i)} * x[t * c.hidden + i];
        y[t * w.rows() + o] = sum;
      }
    }
    return y;
  };
  std::vector<double> q = project(m.w_q, m.b_q), k = project(m.w_k, m.b_k), v = project(m.w_v, m.b_v);
  auto position = [&](std::vector<double>& rows, int64_t heads, const std::vector<float>& norm) {
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        double* r = rows.data() + (t * heads + h) * hd;
        if (!norm.empty()) {
          double square = 0;
          for (int64_t e = 0; e < hd; ++e) square += r[e] * r[e];
          const double inverse = 1 / std::sqrt(square / hd + m.terms.norm_eps);
          for (int64_t e = 0; e < hd; ++e) r[e] = r[e] * inverse * norm[e];
        }
        for (int64_t f = 0; f < m.terms.rotary.dims / 2; ++f) {
          const double angle = positions[t] * m.terms.rotary.inv_freq[f];
          double& a = c.interleaved ? r[2 * f] : r[f];
          double& b = c.interleaved ? r[2 * f + 1] : r[f + hd / 2];
          const double x0 = a, x1 = b;
          a = x0 * std::cos(angle) - x1 * std::sin(angle);
          b = x1 * std::cos(angle) + x0 * std::sin(angle);
        }
      }
    }
  };
  position(q, c.heads, m.terms.q_norm);
  position(k, c.kv_heads, m.terms.k_norm);
  std::vector<double> concat(n * c.heads * hd);
  for (int64_t h = 0; h < c.heads; ++h) {
    const int64_t kv = h / (c.heads / c.kv_heads);
    std::vector<double> qh(n * hd), kh(n * hd), vh(n * hd);
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < hd; ++e) {
        qh[t * hd + e] = q[(t * c.heads + h) * hd + e];
        kh[t * hd + e] = k[(t * c.kv_heads + kv) * hd + e];
        vh[t * hd + e] = v[(t * c.kv_heads + kv) * hd + e];
      }
    }
    const std::vector<double> out = ReferenceHead(
        {&qh, &kh, &vh, n, n, hd, hd, 1 / std::sqrt(static_cast<double>(hd)), true, n, c.window,
         c.alibi ? m.terms.alibi_slopes[h] : 0.0, c.softcap, c.sinks,
         c.sinks ? m.terms.sinks[h] : 0.0});
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t e = 0; e < hd; ++e) concat[(t * c.heads + h) * hd + e] = out[t * hd + e];
    }
  }
  std::vector<double> output(n * c.hidden);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < c.hidden; ++o) {
      double sum = m.b_o[o];
      for (int64_t i = 0; i < c.heads * hd; ++i) sum += double{m.w_o(o, i)} * concat[t * c.heads * hd + i];
      output[t * c.hidden + o] = sum;
    }
  }
  return output;
}

class HuggingFaceLayer : public ::testing::TestWithParam<LayerCase> {};

TEST_P(HuggingFaceLayer, AttendMatchesTheLayerAtGivenPositions) {
  const LayerCase c = GetParam();
  std::mt19937 rng(11);
  const Model model = LayerModel(c, rng);
  const int64_t n = 290;
  const std::vector<float> x = RandomFloats(rng, n * c.hidden);
  std::vector<int64_t> positions(n);
  for (int64_t t = 0; t < n; ++t) positions[t] = 5000 + 3 * t;
  AttentionRequest request;
  request.queries = {{1, n, c.hidden}, x};
  request.causal = true;
  request.position_ids = positions;
  absl::StatusOr<AttentionResult> result = SharedEngine().Attend(model, request);
  ASSERT_TRUE(result.ok()) << result.status();
  ExpectNear(result->output.data, ReferenceLayer(model, c, x, n, positions), 2e-4);
}

TEST_P(HuggingFaceLayer, SessionOverSeveralBlocksMatchesTheLayer) {
  const LayerCase c = GetParam();
  std::mt19937 rng(13);
  const Model model = LayerModel(c, rng);
  const int64_t n = 300, prefill = 280;
  const std::vector<float> x = RandomFloats(rng, n * c.hidden);
  std::vector<int64_t> positions(n);
  for (int64_t t = 0; t < n; ++t) positions[t] = t;
  const std::vector<double> want = ReferenceLayer(model, c, x, n, positions);
  KvBlockPool pool(int64_t{1} << 26);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open(std::make_shared<Model>(model), pool, {.memory = SessionMemory::kSelf});
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->held_bytes(), 0);
  for (int64_t begin = 0; begin < n;) {
    const int64_t rows = begin == 0 ? prefill : 1;
    const TensorView queries{{1, rows, c.hidden},
                             std::span<const float>(x).subspan(begin * c.hidden, rows * c.hidden)};
    SessionStep step{.queries = queries};
    absl::StatusOr<ValidatedStep> validated = ValidateStep(**session, step);
    ASSERT_TRUE(validated.ok()) << validated.status();
    AttentionResult result;
    SharedEngine().RunSteps({&*validated, 1}, {&result, 1});
    ASSERT_TRUE(result.status.ok()) << result.status;
    ExpectNear(result.output.data,
               std::vector<double>(want.begin() + begin * c.hidden,
                                   want.begin() + (begin + rows) * c.hidden),
               2e-4);
    begin += rows;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layers, HuggingFaceLayer,
    ::testing::Values(LayerCase{64, 8, 2, 16, false, false, false, 0, 0, false},
                      LayerCase{48, 4, 1, 24, true, true, false, 0, 0, false},
                      LayerCase{32, 4, 2, 16, false, false, false, 100, 30, false},
                      LayerCase{64, 8, 2, 8, false, false, false, 64, 0, true},
                      LayerCase{48, 6, 6, 8, false, false, true, 0, 0, false}));

// A windowed session gives back the blocks behind its window: after many
// times the window's tokens it holds at most window + 2 blocks of rows per
// example, and its steps still answer as Attend on the whole prefix.
TEST(HuggingFaceLayer, WindowedSessionHoldsOnlyWhatItsWindowSees) {
  const LayerCase c{32, 4, 2, 8, false, false, false, 100, 0, false};
  std::mt19937 rng(17);
  const Model model = LayerModel(c, rng);
  const int64_t n = 1300, prefill = 200, step_rows = 50;
  const std::vector<float> x = RandomFloats(rng, n * c.hidden);
  AttentionRequest whole;
  whole.queries = {{1, n, c.hidden}, x};
  whole.causal = true;
  absl::StatusOr<AttentionResult> want = SharedEngine().Attend(model, whole);
  ASSERT_TRUE(want.ok()) << want.status();
  KvBlockPool pool(int64_t{1} << 26);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open(std::make_shared<Model>(model), pool, {.memory = SessionMemory::kSelf});
  ASSERT_TRUE(session.ok()) << session.status();
  const int64_t row_bytes = 2 * KvWidth(model) * static_cast<int64_t>(sizeof(float));
  for (int64_t begin = 0; begin < n;) {
    const int64_t rows = begin == 0 ? prefill : step_rows;
    SessionStep step{.queries = {{1, rows, c.hidden},
                                 std::span<const float>(x).subspan(begin * c.hidden, rows * c.hidden)}};
    absl::StatusOr<ValidatedStep> validated = ValidateStep(**session, step);
    ASSERT_TRUE(validated.ok()) << validated.status();
    AttentionResult result;
    SharedEngine().RunSteps({&*validated, 1}, {&result, 1});
    ASSERT_TRUE(result.status.ok()) << result.status;
    for (int64_t i = 0; i < rows * c.hidden; ++i) {
      ASSERT_NEAR(result.output.data[i], want->output.data[begin * c.hidden + i], 1e-5)
          << "row " << begin + i / c.hidden;
    }
    begin += rows;
    EXPECT_LE((*session)->held_bytes(), (c.window + 2 * kKvBlockRows + step_rows) * row_bytes)
        << "after " << begin << " tokens";
    EXPECT_EQ(pool.used_bytes(), (*session)->held_bytes());
  }
  EXPECT_LE((*session)->held_bytes(), (c.window + 2 * kKvBlockRows) * row_bytes);
  session->reset();
  EXPECT_EQ(pool.used_bytes(), 0);
}

TEST(HuggingFaceLayer, RefusesPositionsItCannotUse) {
  std::mt19937 rng(3);
  const Model model = LayerModel({32, 4, 2, 8, false, false, false, 0, 0, false}, rng);
  const std::vector<float> x(2 * 3 * 32);
  const std::vector<int64_t> positions = {0, 1, 2, 3};
  AttentionRequest request;
  request.queries = {{2, 3, 32}, x};
  request.position_ids = positions;
  absl::StatusOr<AttentionDims> dims = Validate(model, request);
  ASSERT_FALSE(dims.ok());
  EXPECT_NE(dims.status().message().find("position_ids: expected 0, 3 (n_q, for every example) or 6"),
            std::string::npos)
      << dims.status();
  const std::vector<int64_t> three = {0, 1, 2};
  request.position_ids = three;
  request.sliding_window = 2;
  dims = Validate(model, request);
  ASSERT_FALSE(dims.ok());
  EXPECT_NE(dims.status().message().find("sliding_window: only dot_product"), std::string::npos)
      << dims.status();
}

}  // namespace
}  // namespace attention
