// projection_test.cc: how the engine spreads a projection over its pool
// (core/engine/projection.h). A projection of few rows (a batch
// of single tokens, a decode step) is cut by columns so every thread gets
// work, and the answer is the same bits at every thread count, the same as
// the whole product on one thread; a batch of tokens still runs while
// another model's batch holds the pool. Run per kernel path (ATTENTION_ISA).
#include "core/engine/projection.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <future>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/engine/engine.h"
#include "core/kernels/flash_kernel.h"
#include "core/thread_pool.h"
#include "tests/core/random_weights.h"

namespace attention {
namespace {

using internal::Projection;
using internal::ProjectionBlock;
using testing::RandomMatrix;
using testing::RandomVector;

constexpr int kThreadCounts[] = {1, 2, 3, 4, 8, 16};

// out_cols x in_cols weights and a bias, packed in `precision`, with the
// weights as held (BF16-rounded for bf16) kept for the reference.
struct Weights {
  RowMatrix held;
  Vector bias;
  PackedWeights packed;
};

Weights RandomWeights(std::mt19937& rng, int64_t out_cols, int64_t in_cols,
                      Precision precision) {
  Weights w;
  const RowMatrix weight = RandomMatrix(rng, out_cols, in_cols);
  w.bias = RandomVector(rng, out_cols);
  w.packed = PackedWeights::Pack(weight.data(), out_cols, in_cols, w.bias.data(), precision);
  w.held.resize(out_cols, in_cols);
  Vector bias(out_cols);
  w.packed.Unpack(w.held.data(), bias.data());
  return w;
}

std::vector<float> RandomRows(std::mt19937& rng, int64_t rows, int64_t cols) {
  const RowMatrix m = RandomMatrix(rng, rows, cols);
  return {m.data(), m.data() + m.size()};
}

// For shapes of 1 to 64 rows, N = 1024 and 256, and pools of 2 to 16
// threads: the blocks cover each output element once, and there are at least
// as many as threads (or panels, when fewer), so no thread is left idle.
TEST(ProjectionBlocksTest, FewRowsGiveEveryThreadColumnBlocks) {
  std::mt19937 rng(27);
  for (const int64_t width : {256, 1024}) {
    const Weights w = RandomWeights(rng, width, width, Precision::kFp32);
    for (const int64_t rows : {1, 8, 24, 64}) {
      const std::vector<float> in = RandomRows(rng, rows, width);
      std::vector<float> out(rows * width);
      const std::vector<Projection> projections = {
          {in.data(), out.data(), rows, nullptr, nullptr, true, &w.packed}};
      const Projection& p = projections[0];
      for (const int threads : kThreadCounts) {
        SCOPED_TRACE(::testing::Message()
                     << "E " << width << " rows " << rows << " threads " << threads);
        const std::vector<ProjectionBlock> blocks =
            internal::ProjectionBlocks(projections, threads);
        std::vector<int> covered(rows * w.packed.panels(), 0);
        for (const ProjectionBlock& b : blocks) {
          ASSERT_EQ(b.projection, &p);
          for (int64_t row = b.begin; row < b.end; ++row) {
            for (int64_t panel = b.panel_begin; panel < b.panel_end; ++panel) {
              ++covered[row * w.packed.panels() + panel];
            }
          }
        }
        for (size_t i = 0; i < covered.size(); ++i) ASSERT_EQ(covered[i], 1) << "element " << i;
        EXPECT_GE(static_cast<int64_t>(blocks.size()),
                  std::min<int64_t>(threads, w.packed.panels()));
      }
    }
  }
}

// out = in W^T + b in double, on the weights as held, and each element's
// sum of |in[k] W[n][k]|, which bounds its rounding error.
struct Expected {
  std::vector<double> out, magnitude;
};

Expected Reference(const std::vector<float>& in, const Weights& w, int64_t rows) {
  const int64_t out_cols = w.held.rows(), in_cols = w.held.cols();
  Expected e{std::vector<double>(rows * out_cols), std::vector<double>(rows * out_cols)};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t n = 0; n < out_cols; ++n) {
      double sum = w.bias[n], magnitude = 0;
      for (int64_t k = 0; k < in_cols; ++k) {
        const double term = static_cast<double>(in[r * in_cols + k]) * w.held(n, k);
        sum += term;
        magnitude += std::abs(term);
      }
      e.out[r * out_cols + n] = sum;
      e.magnitude[r * out_cols + n] = magnitude;
    }
  }
  return e;
}

// The products compute in FP32, the reference in double: near, not equal.
// The avx512_bf16 path also rounds the inputs to BF16 (2^-9 of each, 2^-8
// with the FP32 sums), which `input_rounding` allows for. The thread counts
// must agree bitwise.
void ExpectNearReference(const std::vector<float>& out, const Expected& expected,
                         double input_rounding) {
  int reported = 0;
  for (size_t i = 0; i < expected.out.size(); ++i) {
    const double tolerance = 1e-5 + (input_rounding + 1e-6) * expected.magnitude[i];
    if (!(std::abs(out[i] - expected.out[i]) <= tolerance) && reported++ < 5) {
      ADD_FAILURE() << "[" << i << "]: expected " << expected.out[i] << ", got " << out[i];
    }
  }
}

class ProjectionThreadsTest : public ::testing::TestWithParam<Precision> {};

// Q, K and V of a few-rows self-attention (three products into one buffer
// of stride 3 out_cols, as run_multi_head.cc runs them) on pools of every
// size: each pool's output is the bits of the whole product on one thread.
TEST_P(ProjectionThreadsTest, FewRowsGiveTheSameBitsAtEveryThreadCount) {
  const Precision precision = GetParam();
  const double input_rounding = precision == Precision::kBf16 ? 1.0 / 256 : 0.0;
  std::mt19937 rng(5);
  for (const std::pair<int64_t, int64_t>& shape : {std::pair<int64_t, int64_t>{1024, 1024}, {100, 67}}) {
    // Not a structured binding: clang 14 cannot capture one in the lambda
    // below.
    const int64_t out_cols = shape.first, in_cols = shape.second;
    const Weights qkv[3] = {RandomWeights(rng, out_cols, in_cols, precision),
                            RandomWeights(rng, out_cols, in_cols, precision),
                            RandomWeights(rng, out_cols, in_cols, precision)};
    for (const int64_t rows : {1, 7, 64, 200}) {
      SCOPED_TRACE(::testing::Message() << out_cols << "x" << in_cols << " rows " << rows);
      const std::vector<float> in = RandomRows(rng, rows, in_cols);
      const auto projections = [&](std::vector<float>& out) {
        out.assign(rows * 3 * out_cols, std::numeric_limits<float>::quiet_NaN());
        std::vector<Projection> all;
        for (int m = 0; m < 3; ++m) {
          all.push_back({in.data(), out.data() + m * out_cols, rows, nullptr, nullptr, true,
                         &qkv[m].packed, 3 * out_cols});
        }
        return all;
      };
      std::vector<float> whole;
      for (const Projection& p : projections(whole)) internal::ProjectAll(p);
      for (int m = 0; m < 3; ++m) {
        std::vector<float> part(rows * out_cols);
        for (int64_t r = 0; r < rows; ++r) {
          std::copy_n(whole.data() + r * 3 * out_cols + m * out_cols, out_cols,
                      part.data() + r * out_cols);
        }
        ExpectNearReference(part, Reference(in, qkv[m], rows), input_rounding);
      }
      for (const int threads : kThreadCounts) {
        ThreadPool pool(threads);
        std::vector<float> out;
        internal::RunProjections(pool, projections(out));
        EXPECT_EQ(std::memcmp(out.data(), whole.data(), out.size() * sizeof(float)), 0)
            << "threads " << threads << " differ from the whole product on one thread";
      }
    }
  }
}

// One product of RunProjections: `rows` rows of in_cols floats from `in`.
struct Part {
  const float* in;
  int64_t rows;
  const Weights* weights;
};

// RunProjections of `parts` together on pools of every size: each gives
// the bits of its product alone on one thread.
void ExpectEachProductAlone(const std::vector<Part>& parts) {
  const auto projections = [&](std::vector<std::vector<float>>& outs) {
    outs.assign(parts.size(), {});
    std::vector<Projection> all;
    for (size_t i = 0; i < parts.size(); ++i) {
      const int64_t out_cols = parts[i].weights->packed.out_cols();
      outs[i].assign(parts[i].rows * out_cols, std::numeric_limits<float>::quiet_NaN());
      all.push_back({parts[i].in, outs[i].data(), parts[i].rows, nullptr, nullptr, true,
                     &parts[i].weights->packed});
    }
    return all;
  };
  std::vector<std::vector<float>> alone;
  for (const Projection& p : projections(alone)) internal::ProjectAll(p);
  for (const int threads : kThreadCounts) {
    ThreadPool pool(threads);
    std::vector<std::vector<float>> outs;
    internal::RunProjections(pool, projections(outs));
    for (size_t i = 0; i < parts.size(); ++i) {
      EXPECT_EQ(std::memcmp(outs[i].data(), alone[i].data(), outs[i].size() * sizeof(float)), 0)
          << "threads " << threads << ": product " << i << " differs from it alone";
    }
  }
}

// Products over overlapping rows of one input, as run_multi_head.cc makes
// them (Q over every row, K and V over the rows each example reads); the
// same beside products over another input and over the input a float off
// its rows; and the same memory read as rows of two widths. On the
// avx512_bf16 path RunProjections rounds the input rows to BF16 pairs once
// for all the products that read them (core/engine/projection.cc, InputPairs), so
// a product pointed at the wrong rows' pairs would differ from it alone; on
// the other paths it widens the bf16 weights of products of 32 rows or more
// once for all of them (WidenedWeights), so wrong panels would differ too.
TEST_P(ProjectionThreadsTest, OverlappingInputsGiveTheBitsOfEachProductAlone) {
  const Precision precision = GetParam();
  std::mt19937 rng(26);
  constexpr int64_t kRows = 300, kInCols = 67, kOutCols = 100;
  const std::vector<float> in = RandomRows(rng, kRows, kInCols);
  const std::vector<float> other = RandomRows(rng, 130, kInCols);
  const Weights w[3] = {RandomWeights(rng, kOutCols, kInCols, precision),
                        RandomWeights(rng, kOutCols, kInCols, precision),
                        RandomWeights(rng, kOutCols, kInCols, precision)};
  const Weights narrow = RandomWeights(rng, kOutCols, 40, precision);
  const auto row = [&](int64_t r) { return in.data() + r * kInCols; };
  const std::vector<Part> qkv = {{row(0), kRows, &w[0]},  {row(10), 100, &w[1]},
                                 {row(150), 1, &w[1]},    {row(200), 100, &w[1]},
                                 {row(0), 290, &w[2]},    {row(110), 40, &w[2]}};
  std::vector<Part> mixed = qkv;
  mixed.push_back({other.data(), 130, &w[0]});
  mixed.push_back({row(0) + 1, 50, &w[1]});
  for (const auto& [name, parts] :
       {std::pair<const char*, std::vector<Part>>{"Q, K and V", qkv},
        {"beside another input and rows off by a float", mixed},
        {"two widths", {{row(0), kRows, &w[0]}, {row(0), 400, &narrow}}}}) {
    SCOPED_TRACE(name);
    ExpectEachProductAlone(parts);
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, ProjectionThreadsTest,
                         ::testing::Values(Precision::kFp32, Precision::kBf16),
                         [](const ::testing::TestParamInfo<Precision>& info) {
                           return info.param == Precision::kBf16 ? "Bf16" : "Fp32";
                         });

// A multi_head model of width E (E / 64 heads) with random weights, packed.
Model RandomMultiHead(std::mt19937& rng, int64_t width) {
  Model model;
  model.kind = Kind::kMultiHead;
  model.name = "multi_head_" + std::to_string(width);
  model.num_heads = width / 64;
  model.query_size = model.key_size = model.value_size = model.output_size = width;
  for (RowMatrix* w : {&model.w_q, &model.w_k, &model.w_v, &model.w_o}) {
    *w = RandomMatrix(rng, width, width);
  }
  for (Vector* b : {&model.b_q, &model.b_k, &model.b_v, &model.b_o}) *b = RandomVector(rng, width);
  PackProjections(model);
  return model;
}

// The service's token batch: 64 single-token self-attention requests
// (queries only) of a model of width E = 1024.
class TokenBatch {
 public:
  static constexpr int64_t kWidth = 1024, kTokens = 64;

  explicit TokenBatch(std::mt19937& rng)
      : model_(RandomMultiHead(rng, kWidth)), tokens_(RandomRows(rng, kTokens, kWidth)),
        requests_(kTokens) {
    for (int64_t t = 0; t < kTokens; ++t) {
      requests_[t].queries = {{1, 1, kWidth}, std::span(tokens_).subspan(t * kWidth, kWidth)};
      absl::StatusOr<AttentionDims> dims = Validate(model_, requests_[t]);
      EXPECT_TRUE(dims.ok()) << dims.status();
      batch_.push_back({&requests_[t], dims.value_or(AttentionDims{})});
    }
  }

  const Model& model() const { return model_; }
  const AttentionRequest& request(int64_t t) const { return requests_[t]; }

  std::vector<AttentionResult> Run(Engine& engine) const {
    std::vector<AttentionResult> results(kTokens);
    engine.Run(model_, batch_, results);
    return results;
  }

 private:
  Model model_;
  std::vector<float> tokens_;
  std::vector<AttentionRequest> requests_;
  std::vector<ValidatedRequest> batch_;
};

void ExpectSameOutputs(const std::vector<AttentionResult>& results,
                       const std::vector<AttentionResult>& expected) {
  ASSERT_EQ(results.size(), expected.size());
  for (size_t t = 0; t < results.size(); ++t) {
    ASSERT_TRUE(results[t].status.ok()) << results[t].status;
    ASSERT_EQ(results[t].output.data, expected[t].output.data) << "token " << t;
  }
}

// The token batch through Engine::Run on engines of 1 to 16 threads: the
// same bits as on one thread, which match Attend on the first token alone.
TEST(ProjectionEngineTest, BatchOfTokensGivesTheSameBitsAtEveryThreadCount) {
  std::mt19937 rng(64);
  const TokenBatch tokens(rng);
  Engine one_thread(EngineOptions{.num_threads = 1});
  const std::vector<AttentionResult> expected = tokens.Run(one_thread);
  absl::StatusOr<AttentionResult> first = one_thread.Attend(tokens.model(), tokens.request(0));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_EQ(expected[0].output.data, first->output.data);
  for (const int threads : kThreadCounts) {
    SCOPED_TRACE(::testing::Message() << "threads " << threads);
    Engine engine(EngineOptions{.num_threads = threads, .serial_work = -1});
    ExpectSameOutputs(tokens.Run(engine), expected);
  }
}

// A second model's batch beside the token batch: while a long request of
// another model holds the engine's threads (its StopCheck, asked before
// each block, waits), the token batch still runs to the end, on its
// caller, with the same bits.
TEST(ProjectionEngineTest, BatchOfTokensRunsBesideAnotherModelsHeldBatch) {
  std::mt19937 rng(14);
  const TokenBatch tokens(rng);
  Engine one_thread(EngineOptions{.num_threads = 1});
  const std::vector<AttentionResult> expected = tokens.Run(one_thread);

  const Model other = RandomMultiHead(rng, 256);
  const std::vector<float> queries = RandomRows(rng, 256, 256);
  AttentionRequest long_request;
  long_request.queries = {{1, 256, 256}, queries};
  absl::StatusOr<AttentionDims> dims = Validate(other, long_request);
  ASSERT_TRUE(dims.ok()) << dims.status();
  ASSERT_GE(RequestWork(other, *dims), kStopPollWork) << "the request must be polled";
  std::atomic<int> held{0};
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  const ValidatedRequest held_request{&long_request, *dims, [&] {
                                        ++held;
                                        released.wait();
                                        return absl::OkStatus();
                                      }};

  Engine engine(EngineOptions{.num_threads = 2});
  AttentionResult held_result;
  std::thread long_run([&] { engine.Run(other, {&held_request, 1}, {&held_result, 1}); });
  // Both threads held when the worker joins within a second; one is enough.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (held.load() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  ASSERT_GE(held.load(), 1);
  std::future<std::vector<AttentionResult>> token_run =
      std::async(std::launch::async, [&] { return tokens.Run(engine); });
  const bool returned = token_run.wait_for(std::chrono::seconds(30)) == std::future_status::ready;
  release.set_value();
  long_run.join();
  ASSERT_TRUE(returned) << "the token batch waited for the other model's held batch";
  ExpectSameOutputs(token_run.get(), expected);
  EXPECT_TRUE(held_result.status.ok()) << held_result.status;
}

}  // namespace
}  // namespace attention
