// engine_stop_test.cc: cooperative cancellation in the engine.
//
// A request's StopCheck is polled between blocks of its work; once it says
// stop, the request's remaining work is skipped, its result carries that
// status, and the requests batched with it are still answered right. Runs on
// every kernel path (ctest core_engine_stop_test/<path>).
#include <gtest/gtest.h>

#include <atomic>
#include <ctime>
#include <random>
#include <vector>

#include "core/engine/engine.h"
#include "core/kernels/flash_kernel.h"

namespace attention {
namespace {

Tensor Random(std::mt19937& rng, std::vector<int64_t> shape) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int64_t size = 1;
  for (int64_t d : shape) size *= d;
  Tensor t{std::move(shape), std::vector<float>(size)};
  for (float& x : t.data) x = normal(rng);
  return t;
}

RowMatrix RandomMatrix(std::mt19937& rng, int64_t rows, int64_t cols) {
  const Tensor t = Random(rng, {rows, cols});
  return RowMatrix(Eigen::Map<const RowMatrix>(t.data.data(), rows, cols));
}

// A multi_head model of `heads` heads, inputs of `input` features, width
// `width`, random weights and zero biases.
Model RandomMultiHead(std::mt19937& rng, int64_t heads, int64_t input, int64_t width) {
  Model m;
  m.kind = Kind::kMultiHead;
  m.name = "multi_head";
  m.num_heads = heads;
  m.query_size = m.key_size = m.value_size = input;
  m.output_size = width;
  m.w_q = RandomMatrix(rng, width, input);
  m.w_k = RandomMatrix(rng, width, input);
  m.w_v = RandomMatrix(rng, width, input);
  m.w_o = RandomMatrix(rng, width, width);
  m.b_q = m.b_k = m.b_v = m.b_o = Vector::Zero(width);
  return m;
}

// A StopCheck that answers `why` from its `stop_at`-th poll on, counting polls.
struct CountingStop {
  explicit CountingStop(int stop_at, absl::Status why = absl::DeadlineExceededError("late"))
      : stop_at(stop_at), why(std::move(why)) {}
  StopCheck Check() {
    return [this] { return ++polls >= stop_at ? why : absl::OkStatus(); };
  }
  const int stop_at;
  const absl::Status why;
  std::atomic<int> polls{0};
};

AttentionRequest RequestOf(const Tensor& queries, const Tensor* keys = nullptr,
                           bool weights = false) {
  AttentionRequest request;
  request.queries = queries.view();
  if (keys != nullptr) request.keys = keys->view();
  request.return_attention_weights = weights;
  return request;
}

// CPU seconds of the whole process (every engine thread) spent in `run`:
// unlike wall time, not stretched by other processes on a loaded host.
double CpuSecondsOf(const std::function<void()>& run) {
  const auto now = [] {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
  };
  const double start = now();
  run();
  return now() - start;
}

void ExpectSameOutput(const AttentionResult& actual, const AttentionResult& expected) {
  ASSERT_TRUE(actual.status.ok()) << actual.status;
  ASSERT_EQ(actual.output.shape, expected.output.shape);
  for (size_t i = 0; i < expected.output.data.size(); ++i) {
    ASSERT_NEAR(actual.output.data[i], expected.output.data[i], 1e-5f) << "output[" << i << "]";
  }
}

// A budget-sized self-attention request stopped at its second poll costs a
// small fraction of its full run, and the small request batched with it gets
// the answer it gets alone.
TEST(EngineStop, StoppedRequestStopsCostingCpuWhileItsBatchMateIsAnswered) {
  std::mt19937 rng(1);
  Engine engine(EngineOptions{.num_threads = 1});
  const Model model = DotProductModel();
  const Tensor big_queries = Random(rng, {1, 6000, 16});
  const Tensor small_queries = Random(rng, {2, 5, 3});
  const AttentionRequest big = RequestOf(big_queries);
  const AttentionRequest small = RequestOf(small_queries);
  const absl::StatusOr<AttentionDims> big_dims = Validate(model, big);
  const absl::StatusOr<AttentionDims> small_dims = Validate(model, small);
  ASSERT_TRUE(big_dims.ok() && small_dims.ok());
  ASSERT_GT(RequestWork(model, *big_dims), 50 * kStopPollWork);

  std::vector<AttentionResult> full(2), stopped(2);
  const std::vector<ValidatedRequest> unstopped = {{&big, *big_dims}, {&small, *small_dims}};
  const double full_seconds = CpuSecondsOf([&] { engine.Run(model, unstopped, full); });
  ASSERT_TRUE(full[0].status.ok());

  CountingStop stop(2);
  const std::vector<ValidatedRequest> batch = {{&big, *big_dims, stop.Check()},
                                               {&small, *small_dims}};
  const double stopped_seconds = CpuSecondsOf([&] { engine.Run(model, batch, stopped); });
  EXPECT_EQ(stopped[0].status, absl::DeadlineExceededError("late"));
  EXPECT_TRUE(stopped[0].output.data.empty());
  EXPECT_EQ(stop.polls.load(), 2) << "polled again after it said stop";
  EXPECT_LT(stopped_seconds, full_seconds / 5)
      << "stopped run " << stopped_seconds << " s of CPU, full run " << full_seconds << " s";

  absl::StatusOr<AttentionResult> alone = engine.Attend(model, small);
  ASSERT_TRUE(alone.ok());
  ExpectSameOutput(stopped[1], *alone);
}

// One query over many keys is one query tile: it is polled between chunks
// of keys, so it stops mid-tile. With weights, rows are materialised whole
// and polled between rows.
TEST(EngineStop, LongRowsArePolledWithinTheirTile) {
  std::mt19937 rng(2);
  Engine engine(EngineOptions{.num_threads = 2});
  const Model model = DotProductModel();
  const Tensor one_query = Random(rng, {1, 1, 4});
  const Tensor eight_queries = Random(rng, {1, 8, 4});
  const Tensor million_keys = Random(rng, {1, 1000000, 4});
  const Tensor keys = Random(rng, {1, 250000, 4});
  for (bool weights : {false, true}) {
    const AttentionRequest request = weights ? RequestOf(eight_queries, &keys, true)
                                             : RequestOf(one_query, &million_keys);
    const absl::StatusOr<AttentionDims> dims = Validate(model, request);
    ASSERT_TRUE(dims.ok()) << dims.status();
    CountingStop stop(2, absl::CancelledError("gone"));
    std::vector<AttentionResult> results(1);
    engine.Run(model, std::vector<ValidatedRequest>{{&request, *dims, stop.Check()}}, results);
    EXPECT_EQ(results[0].status, absl::CancelledError("gone")) << "weights " << weights;
    EXPECT_EQ(stop.polls.load(), 2) << "weights " << weights;
  }
}

// A request that never stops is polled, and answered exactly as without a
// StopCheck; one of less work than a poll interval is not polled at all.
TEST(EngineStop, UnstoppedRequestsAreAnsweredAsWithoutACheck) {
  std::mt19937 rng(3);
  Engine engine(EngineOptions{.num_threads = 2});
  const Model model = DotProductModel();
  const Tensor big_queries = Random(rng, {1, 1500, 8});
  const Tensor small_queries = Random(rng, {1, 7, 8});
  for (const Tensor* queries : {&big_queries, &small_queries}) {
    const AttentionRequest request = RequestOf(*queries);
    const absl::StatusOr<AttentionDims> dims = Validate(model, request);
    ASSERT_TRUE(dims.ok());
    CountingStop never(1 << 30);
    std::vector<AttentionResult> results(1);
    engine.Run(model, std::vector<ValidatedRequest>{{&request, *dims, never.Check()}}, results);
    absl::StatusOr<AttentionResult> alone = engine.Attend(model, request);
    ASSERT_TRUE(alone.ok());
    ExpectSameOutput(results[0], *alone);
    if (queries == &big_queries) {
      EXPECT_GT(never.polls.load(), 1);
    } else {
      EXPECT_EQ(never.polls.load(), 0);
    }
  }
}

// The kinds with their own loops: additive's rows (polled between chunks of
// keys of one row) and multi_head's heads.
TEST(EngineStop, AdditiveAndMultiHeadStop) {
  std::mt19937 rng(4);
  Engine engine(EngineOptions{.num_threads = 1});
  Model additive;
  additive.kind = Kind::kAdditive;
  additive.name = "additive";
  additive.query_size = additive.key_size = 4;
  additive.w_q = RandomMatrix(rng, 8, 4);
  additive.w_k = RandomMatrix(rng, 8, 4);
  additive.w_v = RandomMatrix(rng, 1, 8);
  const Model multi_head = RandomMultiHead(rng, 2, 4, 8);

  const Tensor one_query = Random(rng, {1, 1, 4});
  const Tensor many_keys = Random(rng, {1, 300000, 4});
  const Tensor queries = Random(rng, {1, 2000, 4});
  const AttentionRequest long_row = RequestOf(one_query, &many_keys);
  const AttentionRequest self = RequestOf(queries);
  for (const auto& [model, request] :
       {std::pair<const Model*, const AttentionRequest*>{&additive, &long_row},
        {&multi_head, &self}}) {
    const absl::StatusOr<AttentionDims> dims = Validate(*model, *request);
    ASSERT_TRUE(dims.ok()) << dims.status();
    CountingStop stop(2);
    std::vector<AttentionResult> results(1);
    engine.Run(*model, std::vector<ValidatedRequest>{{request, *dims, stop.Check()}}, results);
    EXPECT_EQ(results[0].status, absl::DeadlineExceededError("late")) << model->name;
    EXPECT_EQ(stop.polls.load(), 2) << model->name;
  }
}

// multi_head's projections are polled between their blocks: here they are
// nearly all of the work (E = 2048, 64 tokens) and the attention is one
// head of one query tile, which polls at most twice, so more polls than that
// come from the projections; and a stop found there ends the request.
TEST(EngineStop, MultiHeadProjectionsArePolled) {
  std::mt19937 rng(5);
  constexpr int64_t kWidth = 2048, kTokens = 64;
  Model model = RandomMultiHead(rng, 1, kWidth, kWidth);
  PackProjections(model);
  const Tensor tokens = Random(rng, {1, kTokens, kWidth});
  const AttentionRequest request = RequestOf(tokens);
  const absl::StatusOr<AttentionDims> dims = Validate(model, request);
  ASSERT_TRUE(dims.ok()) << dims.status();
  ASSERT_GE(RequestWork(model, *dims), kStopPollWork);
  Engine engine(EngineOptions{.num_threads = 2});

  CountingStop never(1 << 30);
  std::vector<AttentionResult> answered(1);
  engine.Run(model, std::vector<ValidatedRequest>{{&request, *dims, never.Check()}}, answered);
  ASSERT_TRUE(answered[0].status.ok()) << answered[0].status;
  EXPECT_GT(never.polls.load(), 2);

  CountingStop stop(2);
  std::vector<AttentionResult> stopped(1);
  engine.Run(model, std::vector<ValidatedRequest>{{&request, *dims, stop.Check()}}, stopped);
  EXPECT_EQ(stopped[0].status, absl::DeadlineExceededError("late"));
  EXPECT_EQ(stop.polls.load(), 2);
}

}  // namespace
}  // namespace attention
