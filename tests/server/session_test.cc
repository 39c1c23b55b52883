// server_session_test.cc: decoding sessions (docs/api.md, "Sessions") on a
// real attention-server: AttendSession step by step equals Attend on the
// whole prefix with causal (self memory, both multi-head layouts and
// dot_product, prefill then single steps across a block edge) or on the
// fixed memory (cross, additive); many sessions at once each answer as
// alone; errors answered in place leave the session as it was; the limits
// (--max-sessions, --max-session-length, --session-memory-bytes) refuse with
// RESOURCE_EXHAUSTED naming them and other sessions go on; a full pool
// preempts the least recently stepped session with no step in flight (its
// stream ends UNAVAILABLE, counted; a Triton sequence is told at its next
// request), a step waits while every holder is in a step, sessions that all
// wait for memory preempt one of them while it waits, a session larger than
// the empty pool is refused naming the sizes, and --session-preemption off
// refuses as the pool fills; idle expiry;
// a session keeps its version across a reload; SIGTERM with sessions open
// gives only OK and UNAVAILABLE, and the steps of Triton sequences sent as
// unary calls go on until the sequences end (or the grace period); Triton's
// sequence parameters through ModelInfer and ModelStreamInfer; a step's own
// keys, positions on a sequence, and a window or soft-cap a session does not
// take, refused naming them; memory back in the pool and RSS bounded
// over many open/step/close cycles. A long step in pieces (--chunk-work,
// chunked prefill) answers as in one, lets other sessions' steps be answered
// between its pieces (the test gate holds each batch), and one whose
// deadline passes between its pieces is refused with its session rolled
// back.
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/support/gate.h"
#include "tests/support/http_client.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::HasSubstr;
using InferStub = inference::GRPCInferenceService::Stub;

constexpr float kTolerance = 1e-4f;
const std::string kModels = std::string(ATTENTION_SOURCE_DIR) + "/tests/conformance/models";
// core/sessions/session.h's kKvBlockRows: one flash key tile of 64 rows.
constexpr int kBlockRows = 64;
// Bytes of one block of rows `width` floats wide.
constexpr int64_t BlockBytes(int64_t width) { return int64_t{kBlockRows} * width * 4; }
// A mh_torch_small session of at most kBlockRows tokens holds one block of
// keys and one of values (E = 16), so two such sessions fill this pool.
const std::string kTwoSmallSessions = std::to_string(4 * BlockBytes(16));
// Two dot_product sessions of d = 8 and at most kBlockRows tokens (their
// rows are their keys and values, one block each) fill this pool.
const std::string kTwoDotSessions = std::to_string(2 * BlockBytes(8));

// (batch, n, d) values from `rng` in [-1, 1].
v1::Tensor RandomTensor(int64_t batch, int64_t n, int64_t d, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  v1::Tensor tensor;
  tensor.add_shape(batch);
  tensor.add_shape(n);
  tensor.add_shape(d);
  for (int64_t i = 0; i < batch * n * d; ++i) tensor.add_data(uniform(rng));
  return tensor;
}

// Rows [from, to) of every example of a (B, n, d) tensor.
v1::Tensor Rows(const v1::Tensor& tensor, int64_t from, int64_t to) {
  const int64_t batch = tensor.shape(0), n = tensor.shape(1), d = tensor.shape(2);
  v1::Tensor rows;
  rows.add_shape(batch);
  rows.add_shape(to - from);
  rows.add_shape(d);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = from * d; i < to * d; ++i) rows.add_data(tensor.data(b * n * d + i));
  }
  return rows;
}

// The largest |a - b| over two tensors of one shape; infinity otherwise.
float MaxDifference(const v1::Tensor& a, const v1::Tensor& b) {
  if (a.shape_size() != b.shape_size() || a.data_size() != b.data_size()) return INFINITY;
  for (int i = 0; i < a.shape_size(); ++i) {
    if (a.shape(i) != b.shape(i)) return INFINITY;
  }
  float most = 0;
  for (int i = 0; i < a.data_size(); ++i) most = std::max(most, std::abs(a.data(i) - b.data(i)));
  return most;
}

// One AttendSession call, message by message.
class SessionCall {
 public:
  explicit SessionCall(v1::AttentionService::Stub& stub)
      : context_(Context()), stream_(stub.AttendSession(context_.get())) {}

  v1::SessionResponse Send(const v1::SessionRequest& request) {
    v1::SessionResponse response;
    if (!stream_->Write(request) || !stream_->Read(&response)) {
      response.mutable_error()->set_code(-1);
      response.mutable_error()->set_message("the stream ended");
    }
    return response;
  }
  v1::SessionResponse Open(const v1::SessionOpen& open) {
    v1::SessionRequest request;
    *request.mutable_open() = open;
    return Send(request);
  }
  v1::SessionResponse Step(const v1::Tensor& queries) {
    v1::SessionRequest request;
    *request.mutable_step()->mutable_queries() = queries;
    return Send(request);
  }
  grpc::Status Close() {
    stream_->WritesDone();
    v1::SessionResponse ignored;
    while (stream_->Read(&ignored)) {
    }
    return stream_->Finish();
  }
  grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>& stream() { return *stream_; }
  // Breaks the stream as a client that goes away does.
  void Cancel() { context_->TryCancel(); }

 private:
  // A deadline, so that a stream a test expects to end but which stays open
  // fails that test instead of hanging the suite.
  static std::unique_ptr<grpc::ClientContext> Context() {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
    return context;
  }
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream_;
};

v1::SessionOpen SelfOpen(const std::string& model, int64_t batch = 1) {
  v1::SessionOpen open;
  open.set_model(model);
  open.set_batch(batch);
  return open;
}

// Attend on `tokens` rows [0, length) with causal; the last `n_new` rows of
// its output.
v1::Tensor CausalPrefixAnswer(v1::AttentionService::Stub& stub, const std::string& model,
                              const v1::Tensor& tokens, int64_t length, int64_t n_new) {
  v1::AttendRequest request;
  request.set_model(model);
  *request.mutable_queries() = Rows(tokens, 0, length);
  request.set_causal(true);
  v1::AttendResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub.Attend(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return Rows(response.output(), length - n_new, length);
}

class SessionTest : public ::testing::Test {
 protected:
  // With `gate`, the server also serves the test gate's model `gate`.
  void StartServer(std::vector<std::string> flags = {}, const TestGate* gate = nullptr) {
    flags.insert(flags.end(), {"--model-repository", kModels});
    auto server = ServerProcess::Start(gate != nullptr ? gate->Flags(flags) : flags);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = server_->Stub();
  }
  // Steps a self session of `model` (width d) through `steps` (new rows
  // each) and checks every answer against Attend on the prefix.
  void ExpectSelfSessionMatches(const std::string& model, int64_t d,
                                const std::vector<int64_t>& steps, int64_t batch = 1) {
    SCOPED_TRACE(model);
    std::mt19937 rng(17);
    int64_t total = 0;
    for (int64_t n : steps) total += n;
    const v1::Tensor tokens = RandomTensor(batch, total, d, rng);
    SessionCall call(*stub_);
    const v1::SessionResponse opened = call.Open(SelfOpen(model, batch));
    ASSERT_FALSE(opened.has_error()) << opened.error().message();
    EXPECT_EQ(opened.length(), 0);
    int64_t length = 0;
    for (int64_t n : steps) {
      const v1::SessionResponse answer = call.Step(Rows(tokens, length, length + n));
      length += n;
      ASSERT_FALSE(answer.has_error()) << answer.error().message();
      EXPECT_EQ(answer.length(), length);
      EXPECT_LE(MaxDifference(answer.output(), CausalPrefixAnswer(*stub_, model, tokens, length, n)),
                kTolerance)
          << "length " << length;
    }
    EXPECT_TRUE(call.Close().ok());
  }

  void TearDown() override {
    if (HasFailure() && server_ != nullptr) std::cerr << "server log:\n" << server_->Log();
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

TEST_F(SessionTest, SelfSessionsEqualCausalAttendOnThePrefix) {
  StartServer();
  // Prefill to a block's last row, then single steps over its edge.
  const std::vector<int64_t> steps = {kBlockRows - 2, 1, 1, 1, 3};
  ExpectSelfSessionMatches("mh_torch_small", 16, steps);
  ExpectSelfSessionMatches("mh_d2l_bias", 24, steps);
  ExpectSelfSessionMatches("dot_product", 8, {5, 1, 1, 2});
  ExpectSelfSessionMatches("mh_torch_small", 16, {3, 1, 1}, /*batch=*/2);
}

// 20000 units cut a prefill of 300 rows into tens of pieces (a row of
// mh_torch_small, E=16, costs about a thousand units plus tens per key).
TEST_F(SessionTest, StepsInPiecesEqualCausalAttendOnThePrefix) {
  StartServer({"--chunk-work", "20000"});
  ExpectSelfSessionMatches("mh_torch_small", 16, {300, 1, 40, 1});
  ExpectSelfSessionMatches("dot_product", 8, {kBlockRows + 9, 1}, /*batch=*/2);
  const std::string metrics = ScrapeMetrics(server_->metrics_address());
  EXPECT_GT(MetricValue(metrics, "attention_batch_size_count", {{"model", "mh_torch_small"}}), 40)
      << "the prefill was not computed in pieces";
}

// The model `gate` holds each batch until the test writes a byte: a prefill
// in pieces is answered only after its last, while another session's step
// queued behind its first piece is answered with its second.
TEST_F(SessionTest, OtherSessionsStepBetweenThePiecesOfAPrefill) {
  TestGate gate;
  ASSERT_TRUE(gate.ok());
  // A gate (dot_product) row of d=8 over k keys costs 32 k units: pieces of
  // at most 25 rows, tens of them for 200 rows.
  StartServer({"--chunk-work", "20000"}, &gate);
  std::mt19937 rng(31);
  const v1::Tensor prompt = RandomTensor(1, 200, 8, rng), token = RandomTensor(1, 1, 8, rng);
  SessionCall prefill(*stub_), decode(*stub_);
  ASSERT_FALSE(prefill.Open(SelfOpen("gate")).has_error());
  ASSERT_FALSE(decode.Open(SelfOpen("gate")).has_error());
  v1::SessionRequest step;
  *step.mutable_step()->mutable_queries() = prompt;
  ASSERT_TRUE(prefill.stream().Write(step));
  ASSERT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
    return MetricValue(text, "attention_batch_size_count", {{"model", "gate"}}) == 1;
  })) << "the prefill's first piece never reached the gate";
  *step.mutable_step()->mutable_queries() = token;
  ASSERT_TRUE(decode.stream().Write(step));
  ASSERT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
    return MetricValue(text, "attention_queue_depth", {{"model", "gate"}}) == 1;
  })) << "the decode step never queued";
  ASSERT_TRUE(gate.Release(2));  // the first piece, then the second beside the decode step
  v1::SessionResponse decoded;
  ASSERT_TRUE(decode.stream().Read(&decoded));
  ASSERT_FALSE(decoded.has_error()) << decoded.error().message();
  EXPECT_EQ(decoded.length(), 1);
  // Answers are counted before they are sent: the two openings and the
  // decode step, not the prefill.
  EXPECT_EQ(MetricValue(ScrapeMetrics(server_->metrics_address()), "attention_requests_total",
                        {{"model", "gate"}, {"code", "OK"}}),
            3);
  ASSERT_TRUE(gate.Release(200));  // at least a row a piece
  v1::SessionResponse prefilled;
  ASSERT_TRUE(prefill.stream().Read(&prefilled));
  ASSERT_FALSE(prefilled.has_error()) << prefilled.error().message();
  EXPECT_EQ(prefilled.length(), 200);
  EXPECT_LE(MaxDifference(prefilled.output(),
                          CausalPrefixAnswer(*stub_, "dot_product", prompt, 200, 200)),
            kTolerance);
  EXPECT_TRUE(prefill.Close().ok());
  EXPECT_TRUE(decode.Close().ok());
}

TEST_F(SessionTest, CrossSessionEqualsAttendWithTheMemory) {
  StartServer();
  std::mt19937 rng(5);
  v1::SessionOpen open;
  open.set_model("additive_small");
  open.set_memory(v1::SESSION_MEMORY_CROSS);
  *open.mutable_keys() = RandomTensor(2, 9, 5, rng);
  *open.mutable_values() = RandomTensor(2, 9, 3, rng);
  open.add_valid_lens(4);
  open.add_valid_lens(9);
  SessionCall call(*stub_);
  const v1::SessionResponse opened = call.Open(open);
  ASSERT_FALSE(opened.has_error()) << opened.error().message();
  EXPECT_EQ(opened.length(), 9);
  for (int step = 0; step < 4; ++step) {
    const v1::Tensor queries = RandomTensor(2, step + 1, 6, rng);
    const v1::SessionResponse answer = call.Step(queries);
    ASSERT_FALSE(answer.has_error()) << answer.error().message();
    v1::AttendRequest request;
    request.set_model("additive_small");
    *request.mutable_queries() = queries;
    *request.mutable_keys() = open.keys();
    *request.mutable_values() = open.values();
    *request.mutable_valid_lens() = open.valid_lens();
    v1::AttendResponse expected;
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Attend(&context, request, &expected).ok());
    EXPECT_LE(MaxDifference(answer.output(), expected.output()), kTolerance);
    EXPECT_EQ(answer.length(), 9);
  }
  EXPECT_TRUE(call.Close().ok());
}

TEST_F(SessionTest, ConcurrentSessionsAnswerAsAlone) {
  StartServer();
  constexpr int kSessions = 12;
  constexpr int kSteps = 12;
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0}, failures{0};
  for (int s = 0; s < kSessions; ++s) {
    threads.emplace_back([&, s] {
      std::mt19937 rng(100 + s);
      const v1::Tensor tokens = RandomTensor(1, kSteps + 2, 16, rng);
      SessionCall call(*stub_);
      if (call.Open(SelfOpen("mh_torch_small")).has_error()) ++failures;
      int64_t length = 0;
      for (int step = 0; step < kSteps; ++step) {
        const int64_t n = step == 0 ? 3 : 1;
        const v1::SessionResponse answer = call.Step(Rows(tokens, length, length + n));
        length += n;
        if (answer.has_error()) {
          ++failures;
          continue;
        }
        const v1::Tensor expected = CausalPrefixAnswer(*stub_, "mh_torch_small", tokens, length, n);
        if (MaxDifference(answer.output(), expected) > kTolerance) ++mismatches;
      }
      if (!call.Close().ok()) ++failures;
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
  // The server ends each session a moment after its client saw the stream end.
  EXPECT_TRUE(WaitForMetrics(server_->metrics_address(), [&](const std::string& text) {
    return MetricValue(text, "attention_sessions_ended_total", {{"reason", "closed"}}) ==
           kSessions;
  }));
  EXPECT_EQ(MetricValue(ScrapeMetrics(server_->metrics_address()),
                        "attention_session_steps_total", {{"model", "mh_torch_small"}}),
            kSessions * kSteps);
}

TEST_F(SessionTest, ErrorsAreAnsweredInPlaceAndLeaveTheSessionAsItWas) {
  StartServer();
  std::mt19937 rng(3);
  const v1::Tensor tokens = RandomTensor(1, 6, 16, rng);
  SessionCall call(*stub_);
  ASSERT_FALSE(call.Open(SelfOpen("mh_torch_small")).has_error());
  ASSERT_FALSE(call.Step(Rows(tokens, 0, 4)).has_error());
  // Wrong width, then a step before any opening's twin: a second opening.
  const v1::SessionResponse wrong = call.Step(RandomTensor(1, 1, 7, rng));
  EXPECT_EQ(wrong.error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(wrong.error().message(), HasSubstr("queries"));
  EXPECT_EQ(wrong.length(), 4);
  const v1::SessionResponse twice = call.Open(SelfOpen("mh_torch_small"));
  EXPECT_EQ(twice.error().code(), grpc::StatusCode::FAILED_PRECONDITION);
  const v1::SessionResponse next = call.Step(Rows(tokens, 4, 5));
  ASSERT_FALSE(next.has_error()) << next.error().message();
  EXPECT_EQ(next.length(), 5);
  EXPECT_LE(MaxDifference(next.output(), CausalPrefixAnswer(*stub_, "mh_torch_small", tokens, 5, 1)),
            kTolerance);
  EXPECT_TRUE(call.Close().ok());

  SessionCall unopened(*stub_);
  EXPECT_EQ(unopened.Step(Rows(tokens, 0, 1)).error().code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(unopened.Open(SelfOpen("no_such_model")).error().code(), grpc::StatusCode::NOT_FOUND);
  v1::SessionOpen self_additive = SelfOpen("additive_small");
  EXPECT_EQ(unopened.Open(self_additive).error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(unopened.Close().ok());

  // Openings and steps are requests like any other, refused ones included:
  // OK are the opening, two steps and one Attend.
  const std::string metrics = ScrapeMetrics(server_->metrics_address());
  for (const auto& [code, count] : std::vector<std::pair<std::string, double>>{
           {"OK", 4}, {"INVALID_ARGUMENT", 2}, {"FAILED_PRECONDITION", 2}, {"NOT_FOUND", 1}}) {
    EXPECT_EQ(MetricValue(metrics, "attention_api_requests_total",
                          {{"api", "attention"}, {"code", code}}),
              count)
        << code;
  }
  EXPECT_THAT(server_->Log(), HasSubstr("request failed: api=attention model='no_such_model'"));
}

TEST_F(SessionTest, LimitsRefuseWithTheirNameAndOtherSessionsGoOn) {
  StartServer({"--max-sessions", "2", "--max-session-length", "8"});
  std::mt19937 rng(9);
  const v1::Tensor tokens = RandomTensor(1, 10, 16, rng);
  SessionCall first(*stub_), second(*stub_), third(*stub_);
  ASSERT_FALSE(first.Open(SelfOpen("mh_torch_small")).has_error());
  ASSERT_FALSE(second.Open(SelfOpen("mh_torch_small")).has_error());
  const v1::SessionResponse refused = third.Open(SelfOpen("mh_torch_small"));
  EXPECT_EQ(refused.error().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error().message(), HasSubstr("--max-sessions"));

  ASSERT_FALSE(first.Step(Rows(tokens, 0, 6)).has_error());
  const v1::SessionResponse too_long = first.Step(Rows(tokens, 6, 9));
  EXPECT_EQ(too_long.error().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(too_long.error().message(), HasSubstr("--max-session-length 8"));
  EXPECT_EQ(too_long.length(), 6);
  const v1::SessionResponse fits = first.Step(Rows(tokens, 6, 8));
  ASSERT_FALSE(fits.has_error()) << fits.error().message();
  EXPECT_LE(MaxDifference(fits.output(), CausalPrefixAnswer(*stub_, "mh_torch_small", tokens, 8, 2)),
            kTolerance);
  const v1::SessionResponse other = second.Step(Rows(tokens, 0, 3));
  ASSERT_FALSE(other.has_error()) << other.error().message();
  EXPECT_TRUE(first.Close().ok());
  // A closed session's place is free again, once the server has seen the
  // stream end (a moment after its client).
  EXPECT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
    return MetricValue(text, "attention_sessions_open") == 1;
  }));
  const v1::SessionResponse reopened = third.Open(SelfOpen("mh_torch_small"));
  EXPECT_FALSE(reopened.has_error()) << reopened.error().message();
  EXPECT_TRUE(second.Close().ok());
  EXPECT_TRUE(third.Close().ok());
}

TEST_F(SessionTest, SessionMemoryIsBoundedByThePool) {
  // Two blocks' worth of keys and values (projected) fill it.
  StartServer({"--session-memory-bytes", kTwoSmallSessions});
  std::mt19937 rng(4);
  SessionCall big(*stub_), small(*stub_);
  ASSERT_FALSE(big.Open(SelfOpen("mh_torch_small")).has_error());
  ASSERT_FALSE(small.Open(SelfOpen("mh_torch_small")).has_error());
  ASSERT_FALSE(small.Step(RandomTensor(1, 2, 16, rng)).has_error());
  const v1::SessionResponse refused = big.Step(RandomTensor(1, 3 * kBlockRows, 16, rng));
  EXPECT_EQ(refused.error().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error().message(),
              HasSubstr("--session-memory-bytes " + kTwoSmallSessions));
  EXPECT_EQ(refused.length(), 0);
  EXPECT_FALSE(small.Step(RandomTensor(1, 1, 16, rng)).has_error());
  const std::string metrics = ScrapeMetrics(server_->metrics_address());
  EXPECT_EQ(MetricValue(metrics, "attention_session_pool_capacity_bytes"), 4 * BlockBytes(16));
  EXPECT_TRUE(big.Close().ok());
  EXPECT_TRUE(small.Close().ok());
}

// The stream of a preempted session: the step sent gets no answer, and the
// stream ends UNAVAILABLE saying so.
void ExpectPreempted(SessionCall& call, const v1::Tensor& step) {
  const v1::SessionResponse answer = call.Step(step);
  EXPECT_EQ(answer.error().code(), -1) << "answered: " << answer.DebugString();
  const grpc::Status status = call.stream().Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("preempted"));
}

// Sessions preempted so far; 0 before the first (no sample yet).
double Preemptions(const ServerProcess& server) {
  return MetricValue(ScrapeMetrics(server.metrics_address()), "attention_sessions_ended_total",
                     {{"reason", "preempted"}})
      .value_or(0);
}

TEST_F(SessionTest, ANewSessionPreemptsTheLeastRecentlySteppedIdleOne) {
  StartServer({"--session-memory-bytes", kTwoSmallSessions});
  std::mt19937 rng(41);
  const v1::Tensor tokens = RandomTensor(1, 20, 16, rng);
  SessionCall older(*stub_), newer(*stub_), opening(*stub_);
  for (SessionCall* call : {&newer, &older, &opening}) {
    ASSERT_FALSE(call->Open(SelfOpen("mh_torch_small")).has_error());
  }
  // `newer` steps first, then `older` twice, then `newer` again: `older`
  // is the one stepped least recently, though opened last.
  const absl::Time first = absl::Now();
  ASSERT_FALSE(newer.Step(Rows(tokens, 0, 4)).has_error());
  ASSERT_FALSE(older.Step(Rows(tokens, 0, 4)).has_error());
  ASSERT_FALSE(older.Step(Rows(tokens, 4, 6)).has_error());
  ASSERT_FALSE(newer.Step(Rows(tokens, 4, 8)).has_error());
  EXPECT_EQ(Preemptions(*server_), 0);
  // Past the time a session is kept after the step that took its blocks
  // (four times that step's), so both can be preempted and the choice is
  // the least recently stepped.
  absl::SleepFor(5 * (absl::Now() - first));

  const v1::SessionResponse opened = opening.Step(Rows(tokens, 0, 10));
  ASSERT_FALSE(opened.has_error()) << opened.error().message();
  EXPECT_LE(MaxDifference(opened.output(),
                          CausalPrefixAnswer(*stub_, "mh_torch_small", tokens, 10, 10)),
            kTolerance);
  ExpectPreempted(older, Rows(tokens, 6, 7));
  const v1::SessionResponse kept = newer.Step(Rows(tokens, 8, 9));
  ASSERT_FALSE(kept.has_error()) << kept.error().message();
  EXPECT_EQ(kept.length(), 9);
  EXPECT_LE(
      MaxDifference(kept.output(), CausalPrefixAnswer(*stub_, "mh_torch_small", tokens, 9, 1)),
      kTolerance);
  EXPECT_EQ(Preemptions(*server_), 1);
  EXPECT_TRUE(newer.Close().ok());
  EXPECT_TRUE(opening.Close().ok());
}

TEST_F(SessionTest, ASessionWhoseStepIsInFlightIsNeverPreempted) {
  TestGate gate;
  ASSERT_TRUE(gate.ok());
  StartServer({"--session-memory-bytes", kTwoDotSessions}, &gate);
  std::mt19937 rng(42);
  const v1::Tensor tokens = RandomTensor(1, 12, 8, rng);
  SessionCall stepping(*stub_), idle(*stub_), opening(*stub_);
  ASSERT_FALSE(stepping.Open(SelfOpen("gate")).has_error());
  ASSERT_FALSE(idle.Open(SelfOpen("dot_product")).has_error());
  ASSERT_FALSE(opening.Open(SelfOpen("dot_product")).has_error());
  v1::SessionRequest step;
  *step.mutable_step()->mutable_queries() = Rows(tokens, 0, 4);
  ASSERT_TRUE(stepping.stream().Write(step));
  ASSERT_TRUE(gate.Release());
  v1::SessionResponse answer;
  ASSERT_TRUE(stepping.stream().Read(&answer));
  ASSERT_FALSE(answer.has_error()) << answer.error().message();
  ASSERT_FALSE(idle.Step(Rows(tokens, 0, 4)).has_error());

  // `stepping` was stepped least recently, but its next step is held at
  // the gate: the blocks come from `idle`.
  *step.mutable_step()->mutable_queries() = Rows(tokens, 4, 6);
  ASSERT_TRUE(stepping.stream().Write(step));
  ASSERT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
    return MetricValue(text, "attention_batch_size_count", {{"model", "gate"}}) == 2;
  })) << "the step never reached the gate";
  const v1::SessionResponse opened = opening.Step(Rows(tokens, 0, 5));
  ASSERT_FALSE(opened.has_error()) << opened.error().message();
  ExpectPreempted(idle, Rows(tokens, 4, 5));
  ASSERT_TRUE(gate.Release());
  ASSERT_TRUE(stepping.stream().Read(&answer));
  ASSERT_FALSE(answer.has_error()) << answer.error().message();
  EXPECT_EQ(answer.length(), 6);
  EXPECT_LE(MaxDifference(answer.output(), CausalPrefixAnswer(*stub_, "dot_product", tokens, 6, 2)),
            kTolerance);
  EXPECT_EQ(Preemptions(*server_), 1);

  // With every holder of blocks in a step, a step that needs blocks waits
  // for one to be answered, then takes that one's blocks.
  EXPECT_TRUE(opening.Close().ok());
  ASSERT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
    return MetricValue(text, "attention_sessions_open") == 1;
  }));
  SessionCall filler(*stub_), waiting(*stub_);
  ASSERT_FALSE(filler.Open(SelfOpen("gate")).has_error());
  ASSERT_FALSE(waiting.Open(SelfOpen("dot_product")).has_error());
  *step.mutable_step()->mutable_queries() = Rows(tokens, 0, 2);
  ASSERT_TRUE(filler.stream().Write(step));
  ASSERT_TRUE(gate.Release());
  ASSERT_TRUE(filler.stream().Read(&answer));
  ASSERT_FALSE(answer.has_error()) << answer.error().message();
  *step.mutable_step()->mutable_queries() = Rows(tokens, 6, 7);
  ASSERT_TRUE(stepping.stream().Write(step));
  ASSERT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
    return MetricValue(text, "attention_batch_size_count", {{"model", "gate"}}) == 4;
  })) << "the step never reached the gate";
  *step.mutable_step()->mutable_queries() = Rows(tokens, 2, 3);
  ASSERT_TRUE(filler.stream().Write(step));
  ASSERT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
    return MetricValue(text, "attention_queue_depth", {{"model", "gate"}}) == 1;
  })) << "the step never queued";
  *step.mutable_step()->mutable_queries() = Rows(tokens, 0, 3);
  ASSERT_TRUE(waiting.stream().Write(step));
  ASSERT_TRUE(gate.Release(2));
  for (SessionCall* call : {&stepping, &filler}) {
    ASSERT_TRUE(call->stream().Read(&answer));
    ASSERT_FALSE(answer.has_error()) << answer.error().message();
  }
  ASSERT_TRUE(waiting.stream().Read(&answer));
  ASSERT_FALSE(answer.has_error()) << answer.error().message();
  EXPECT_LE(MaxDifference(answer.output(), CausalPrefixAnswer(*stub_, "dot_product", tokens, 3, 3)),
            kTolerance);
  // `idle`, then one of `stepping` and `filler`; which one, and whether
  // both, depends on whether each is still kept when its step ends.
  EXPECT_GE(Preemptions(*server_), 2);
  EXPECT_TRUE(waiting.Close().ok());
  // What ended preempted gets UNAVAILABLE at its Close().
  for (SessionCall* call : {&stepping, &filler}) call->Close();
}

TEST_F(SessionTest, SessionsThatAllWaitForMemoryPreemptOneOfThemWhileItWaits) {
  TestGate gate;
  ASSERT_TRUE(gate.ok());
  // Two dot_product sessions of d = 8 whose prompts fill a block each fill
  // the pool: the next token of each needs a block, and neither can end its
  // step to give one. Their prompts differ, so they share no block.
  StartServer({"--session-memory-bytes", kTwoDotSessions}, &gate);
  std::mt19937 rng(46);
  const v1::Tensor tokens = RandomTensor(1, kBlockRows + 1, 8, rng);
  const v1::Tensor other_prompt = RandomTensor(1, kBlockRows, 8, rng);
  SessionCall older(*stub_), newer(*stub_);
  v1::SessionRequest step;
  v1::SessionResponse answer;
  for (SessionCall* call : {&older, &newer}) {
    ASSERT_FALSE(call->Open(SelfOpen("gate")).has_error());
    *step.mutable_step()->mutable_queries() =
        call == &older ? other_prompt : Rows(tokens, 0, kBlockRows);
    ASSERT_TRUE(call->stream().Write(step));
    ASSERT_TRUE(gate.Release());
    ASSERT_TRUE(call->stream().Read(&answer));
    ASSERT_FALSE(answer.has_error()) << answer.error().message();
  }
  *step.mutable_step()->mutable_queries() = Rows(tokens, kBlockRows, kBlockRows + 1);
  ASSERT_TRUE(older.stream().Write(step));
  ASSERT_TRUE(newer.stream().Write(step));
  // Both steps in flight (at the gate, or one there and one queued) before
  // either runs: the two prompts and the two steps.
  ASSERT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
    return MetricValue(text, "attention_batch_size_count", {{"model", "gate"}}) == 3 &&
           MetricValue(text, "attention_batch_size_sum", {{"model", "gate"}}).value_or(0) +
                   MetricValue(text, "attention_queue_depth", {{"model", "gate"}}).value_or(0) ==
               4;
  })) << "the steps never reached the gate";
  ASSERT_TRUE(gate.Release(16));
  ExpectPreempted(older, Rows(tokens, kBlockRows, kBlockRows + 1));
  ASSERT_TRUE(newer.stream().Read(&answer));
  ASSERT_FALSE(answer.has_error()) << answer.error().message();
  EXPECT_EQ(answer.length(), kBlockRows + 1);
  EXPECT_LE(MaxDifference(answer.output(),
                          CausalPrefixAnswer(*stub_, "dot_product", tokens, kBlockRows + 1, 1)),
            kTolerance);
  EXPECT_EQ(Preemptions(*server_), 1);
  EXPECT_TRUE(newer.Close().ok());
}

TEST_F(SessionTest, WithPreemptionOffAFullPoolRefusesTheStep) {
  StartServer({"--session-memory-bytes", kTwoSmallSessions, "--session-preemption", "off"});
  std::mt19937 rng(43);
  const v1::Tensor tokens = RandomTensor(1, 8, 16, rng);
  SessionCall first(*stub_), second(*stub_), third(*stub_);
  for (SessionCall* call : {&first, &second, &third}) {
    ASSERT_FALSE(call->Open(SelfOpen("mh_torch_small")).has_error());
  }
  ASSERT_FALSE(first.Step(Rows(tokens, 0, 4)).has_error());
  ASSERT_FALSE(second.Step(Rows(tokens, 0, 4)).has_error());
  const v1::SessionResponse refused = third.Step(Rows(tokens, 0, 4));
  EXPECT_EQ(refused.error().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error().message(),
              HasSubstr("--session-memory-bytes " + kTwoSmallSessions));
  EXPECT_EQ(refused.length(), 0);
  for (SessionCall* call : {&first, &second}) {
    const v1::SessionResponse answer = call->Step(Rows(tokens, 4, 5));
    ASSERT_FALSE(answer.has_error()) << answer.error().message();
    EXPECT_EQ(answer.length(), 5);
  }
  EXPECT_EQ(Preemptions(*server_), 0);
  for (SessionCall* call : {&first, &second, &third}) EXPECT_TRUE(call->Close().ok());
}

TEST_F(SessionTest, ASessionLargerThanTheEmptyPoolIsRefusedAndPreemptsNone) {
  StartServer({"--session-memory-bytes", kTwoSmallSessions});
  std::mt19937 rng(44);
  SessionCall held(*stub_), big(*stub_);
  ASSERT_FALSE(held.Open(SelfOpen("mh_torch_small")).has_error());
  ASSERT_FALSE(big.Open(SelfOpen("mh_torch_small")).has_error());
  ASSERT_FALSE(held.Step(RandomTensor(1, 4, 16, rng)).has_error());
  // Three blocks of keys and three of values.
  const v1::SessionResponse refused = big.Step(RandomTensor(1, 2 * kBlockRows + 1, 16, rng));
  EXPECT_EQ(refused.error().code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error().message(),
              HasSubstr(absl::StrCat("would hold ", 6 * BlockBytes(16), " bytes")));
  EXPECT_THAT(refused.error().message(),
              HasSubstr("capacity of " + kTwoSmallSessions + " bytes"));
  EXPECT_EQ(refused.length(), 0);
  const v1::SessionResponse still = held.Step(RandomTensor(1, 1, 16, rng));
  ASSERT_FALSE(still.has_error()) << still.error().message();
  EXPECT_EQ(still.length(), 5);
  EXPECT_EQ(Preemptions(*server_), 0);
  EXPECT_TRUE(held.Close().ok());
  EXPECT_TRUE(big.Close().ok());
}

// The outputs of sessions that all open with `prompt`, then step `tokens`
// one row at a time, opened one after the other on the running server.
std::vector<v1::Tensor> SharedPromptOutputs(v1::AttentionService::Stub& stub, int sessions,
                                            const v1::Tensor& prompt, const v1::Tensor& tokens,
                                            std::vector<std::unique_ptr<SessionCall>>& calls) {
  std::vector<v1::Tensor> outputs;
  for (int s = 0; s < sessions; ++s) {
    calls.push_back(std::make_unique<SessionCall>(stub));
    SessionCall& call = *calls.back();
    EXPECT_FALSE(call.Open(SelfOpen("mh_torch_small")).has_error());
    const v1::SessionResponse answer = call.Step(prompt);
    EXPECT_FALSE(answer.has_error()) << answer.error().message();
    outputs.push_back(answer.output());
    for (int64_t t = 0; t < tokens.shape(1); ++t) {
      const v1::SessionResponse next = call.Step(Rows(tokens, t, t + 1));
      EXPECT_FALSE(next.has_error()) << next.error().message();
      outputs.push_back(next.output());
    }
  }
  return outputs;
}

TEST_F(SessionTest, SessionsWithOnePromptShareItsBlocksAndAnswerAsWithSharingOff) {
  std::mt19937 rng(47);
  const int64_t n = 2 * kBlockRows + 5;
  const v1::Tensor prompt = RandomTensor(1, n, 16, rng), tokens = RandomTensor(1, 2, 16, rng);
  std::vector<std::vector<v1::Tensor>> outputs;
  for (bool sharing : {true, false}) {
    SCOPED_TRACE(sharing ? "sharing" : "--no-prefix-sharing");
    std::vector<std::string> flags;
    if (!sharing) flags.push_back("--no-prefix-sharing");
    StartServer(flags);
    std::vector<std::unique_ptr<SessionCall>> calls;
    outputs.push_back(SharedPromptOutputs(*stub_, 3, prompt, tokens, calls));
    std::string metrics = ScrapeMetrics(server_->metrics_address());
    // The prompt's two full blocks of keys and of values are held once; each
    // session holds its last partial block apart.
    const int64_t full = sharing ? 2 : 0;
    EXPECT_EQ(MetricValue(metrics, "attention_session_prefix_query_tokens_total"),
              sharing ? 3 * n : 0);
    EXPECT_EQ(MetricValue(metrics, "attention_session_prefix_hit_tokens_total"),
              2 * full * kBlockRows);
    EXPECT_EQ(MetricValue(metrics, "attention_session_pool_shared_bytes"),
              2 * full * BlockBytes(16));
    EXPECT_EQ(MetricValue(metrics, "attention_session_pool_used_bytes"),
              (3 * 2 * 3 - 2 * 2 * full) * BlockBytes(16));
    for (auto& call : calls) EXPECT_TRUE(call->Close().ok());
    // The last session to end caches the shared blocks.
    EXPECT_TRUE(WaitForMetrics(server_->metrics_address(), [&](const std::string& text) {
      return MetricValue(text, "attention_sessions_open") == 0 &&
             MetricValue(text, "attention_session_pool_used_bytes") == 0 &&
             MetricValue(text, "attention_session_pool_cached_bytes") == 2 * full * BlockBytes(16);
    }));
    server_.reset();
  }
  ASSERT_EQ(outputs[0].size(), outputs[1].size());
  for (size_t i = 0; i < outputs[0].size(); ++i) {
    EXPECT_TRUE(std::equal(outputs[0][i].shape().begin(), outputs[0][i].shape().end(),
                           outputs[1][i].shape().begin(), outputs[1][i].shape().end()))
        << "answer " << i;
    EXPECT_TRUE(std::equal(outputs[0][i].data().begin(), outputs[0][i].data().end(),
                           outputs[1][i].data().begin(), outputs[1][i].data().end()))
        << "answer " << i << " differs with --no-prefix-sharing";
  }
}

TEST_F(SessionTest, APreemptedSessionLeavesTheBlocksItSharesToTheOthers) {
  // Two sessions of one prompt hold its two full blocks of keys and of
  // values once and a partial block each; a third of another prompt fills
  // the pool, and its next block takes the partial blocks of the session
  // stepped least recently.
  StartServer({"--session-memory-bytes", std::to_string(10 * BlockBytes(16))});
  std::mt19937 rng(48);
  const int64_t n = 2 * kBlockRows + 5;
  const v1::Tensor prompt = RandomTensor(1, n + 1, 16, rng);
  const v1::Tensor other = RandomTensor(1, kBlockRows + 5, 16, rng);
  SessionCall first(*stub_), second(*stub_), third(*stub_);
  const absl::Time began = absl::Now();
  for (SessionCall* call : {&first, &second}) {
    ASSERT_FALSE(call->Open(SelfOpen("mh_torch_small")).has_error());
    ASSERT_FALSE(call->Step(Rows(prompt, 0, n)).has_error());
  }
  ASSERT_FALSE(third.Open(SelfOpen("mh_torch_small")).has_error());
  ASSERT_FALSE(third.Step(Rows(other, 0, 5)).has_error());
  EXPECT_EQ(MetricValue(ScrapeMetrics(server_->metrics_address()),
                        "attention_session_pool_used_bytes"),
            10 * BlockBytes(16));
  // Past the time a session is kept after the step that took its blocks.
  absl::SleepFor(5 * (absl::Now() - began));
  const v1::SessionResponse grown = third.Step(Rows(other, 5, kBlockRows + 5));
  ASSERT_FALSE(grown.has_error()) << grown.error().message();
  ExpectPreempted(first, Rows(prompt, n, n + 1));
  const v1::SessionResponse kept = second.Step(Rows(prompt, n, n + 1));
  ASSERT_FALSE(kept.has_error()) << kept.error().message();
  EXPECT_EQ(kept.length(), n + 1);
  EXPECT_LE(MaxDifference(kept.output(), CausalPrefixAnswer(*stub_, "mh_torch_small", prompt,
                                                            n + 1, 1)),
            kTolerance);
  const std::string metrics = ScrapeMetrics(server_->metrics_address());
  EXPECT_EQ(MetricValue(metrics, "attention_session_pool_shared_bytes"), 0);
  EXPECT_EQ(Preemptions(*server_), 1);
  EXPECT_TRUE(second.Close().ok());
  EXPECT_TRUE(third.Close().ok());
}

TEST_F(SessionTest, IdleSessionsExpireAndTheirNextStepIsTold) {
  StartServer({"--session-idle-seconds", "0.3"});
  std::mt19937 rng(8);
  SessionCall call(*stub_);
  ASSERT_FALSE(call.Open(SelfOpen("mh_torch_small")).has_error());
  ASSERT_FALSE(call.Step(RandomTensor(1, 2, 16, rng)).has_error());
  std::this_thread::sleep_for(std::chrono::milliseconds(1800));
  const v1::SessionResponse late = call.Step(RandomTensor(1, 1, 16, rng));
  EXPECT_EQ(late.error().code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(late.error().message(), HasSubstr("--session-idle-seconds"));
  EXPECT_TRUE(call.Close().ok());
  const std::string metrics = ScrapeMetrics(server_->metrics_address());
  EXPECT_EQ(MetricValue(metrics, "attention_sessions_ended_total", {{"reason", "expired"}}), 1);
  EXPECT_EQ(MetricValue(metrics, "attention_sessions_open"), 0);
  EXPECT_EQ(MetricValue(metrics, "attention_session_pool_used_bytes"), 0);
}

TEST_F(SessionTest, ASessionKeepsItsVersionAcrossAReload) {
  TempDir repository;
  std::filesystem::create_directories(repository.path() / "m");
  std::filesystem::copy_file(kModels + "/mh_torch_small.safetensors",
                             repository.path() / "m" / "1.safetensors");
  auto server = ServerProcess::Start(
      {"--model-repository", repository.path().string(), "--repository-poll-seconds", "0.1"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  std::mt19937 rng(21);
  const v1::Tensor tokens = RandomTensor(1, 6, 16, rng);
  std::vector<v1::Tensor> expected;
  for (int64_t length = 3; length <= 6; ++length) {
    expected.push_back(CausalPrefixAnswer(*stub, "m", tokens, length, length == 3 ? 3 : 1));
  }
  SessionCall call(*stub);
  ASSERT_FALSE(call.Open(SelfOpen("m")).has_error());
  ASSERT_FALSE(call.Step(Rows(tokens, 0, 3)).has_error());
  // Version 2: other weights of the same sizes.
  std::filesystem::copy_file(kModels + "/mh_d2l_bf16.safetensors",
                             repository.path() / "m" / "2.tmp");
  std::filesystem::rename(repository.path() / "m" / "2.tmp",
                          repository.path() / "m" / "2.safetensors");
  bool reloaded = false;
  for (int i = 0; i < 100 && !reloaded; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    v1::ListModelsResponse models;
    grpc::ClientContext context;
    ASSERT_TRUE(stub->ListModels(&context, {}, &models).ok());
    for (const v1::ModelInfo& info : models.models()) reloaded |= info.name() == "m" && info.version() == 2;
  }
  ASSERT_TRUE(reloaded);
  for (int64_t length = 4; length <= 6; ++length) {
    const v1::SessionResponse answer = call.Step(Rows(tokens, length - 1, length));
    ASSERT_FALSE(answer.has_error()) << answer.error().message();
    EXPECT_EQ(answer.model_version(), 1);
    EXPECT_LE(MaxDifference(answer.output(), expected[length - 3]), kTolerance);
  }
  EXPECT_TRUE(call.Close().ok());
  SessionCall newer(*stub);
  EXPECT_EQ(newer.Open(SelfOpen("m")).model_version(), 2);
  EXPECT_TRUE(newer.Close().ok());
}

// A Triton sequence request: `queries` as raw FP32 with the sequence
// parameters.
inference::ModelInferRequest SequenceRequest(const std::string& model, const v1::Tensor& queries,
                                             const inference::InferParameter& id, bool start,
                                             bool end) {
  inference::ModelInferRequest request;
  request.set_model_name(model);
  auto* input = request.add_inputs();
  input->set_name("queries");
  input->set_datatype("FP32");
  for (int64_t size : queries.shape()) input->add_shape(size);
  request.add_raw_input_contents(
      std::string(reinterpret_cast<const char*>(queries.data().data()), queries.data_size() * 4));
  (*request.mutable_parameters())["sequence_id"] = id;
  if (start) (*request.mutable_parameters())["sequence_start"].set_bool_param(true);
  if (end) (*request.mutable_parameters())["sequence_end"].set_bool_param(true);
  return request;
}

v1::Tensor OutputOf(const inference::ModelInferResponse& response) {
  v1::Tensor tensor;
  if (response.outputs_size() == 0 || response.raw_output_contents_size() == 0) return tensor;
  for (int64_t size : response.outputs(0).shape()) tensor.add_shape(size);
  const std::string& raw = response.raw_output_contents(0);
  tensor.mutable_data()->Resize(static_cast<int>(raw.size() / 4), 0.0f);
  std::memcpy(tensor.mutable_data()->mutable_data(), raw.data(), raw.size());
  return tensor;
}

TEST_F(SessionTest, SigtermWithSessionsOpenGivesOnlyOkAndUnavailable) {
  StartServer({"--shutdown-grace-seconds", "1"});
  constexpr int kSessions = 4;
  std::atomic<int> bad{0}, ok_steps{0}, unavailable{0};
  std::atomic<int> opened{0};
  std::vector<std::thread> threads;
  for (int s = 0; s < kSessions; ++s) {
    threads.emplace_back([&, s] {
      std::mt19937 rng(s);
      SessionCall call(*stub_);
      if (call.Open(SelfOpen("mh_torch_small")).has_error()) ++bad;
      ++opened;
      for (int step = 0; step < 100000; ++step) {
        const v1::SessionResponse answer = call.Step(RandomTensor(1, 1, 16, rng));
        if (answer.error().code() == -1) break;  // the stream ended
        if (!answer.has_error()) {
          ++ok_steps;
        } else if (answer.error().code() == grpc::StatusCode::UNAVAILABLE) {
          ++unavailable;
        } else {
          ADD_FAILURE() << answer.error().code() << " " << answer.error().message();
          ++bad;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      const grpc::Status status = call.stream().Finish();
      if (status.error_code() != grpc::StatusCode::OK &&
          status.error_code() != grpc::StatusCode::UNAVAILABLE) {
        ADD_FAILURE() << status.error_code() << " " << status.error_message();
        ++bad;
      }
    });
  }
  // A Triton sequence on a ModelStreamInfer stream, stepped the same way.
  threads.emplace_back([&] {
    std::mt19937 rng(99);
    auto infer = InferStub(server_->Channel());
    grpc::ClientContext context;
    auto stream = infer.ModelStreamInfer(&context);
    inference::InferParameter id;
    id.set_int64_param(7);
    ++opened;
    for (int step = 0; step < 100000; ++step) {
      inference::ModelStreamInferResponse response;
      if (!stream->Write(SequenceRequest("mh_torch_small", RandomTensor(1, 1, 16, rng), id,
                                         step == 0, false)) ||
          !stream->Read(&response)) {
        break;
      }
      if (response.error_message().empty()) {
        ++ok_steps;
      } else if (response.error_message().rfind("UNAVAILABLE", 0) == 0) {
        ++unavailable;
      } else {
        ADD_FAILURE() << response.error_message();
        ++bad;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const grpc::Status status = stream->Finish();
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE) {
      ADD_FAILURE() << "ModelStreamInfer ended " << status.error_code() << " "
                    << status.error_message();
      ++bad;
    }
  });
  while (opened.load() < kSessions + 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int before = ok_steps.load();
  server_->Signal(SIGTERM);
  EXPECT_EQ(server_->Wait(), 0);
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(before, 0);
  // Steps went on during the grace period.
  EXPECT_GT(ok_steps.load(), before);
  EXPECT_THAT(server_->Log(), HasSubstr("sessions still open"));
}

// SIGTERM with Triton sequences open whose steps come as unary ModelInfer
// calls: their steps are still answered while the server drains, a new
// sequence and a new call are refused UNAVAILABLE, and the server exits once
// they have ended, before its grace period; a sequence left open holds the
// drain only until the grace period ends.
TEST_F(SessionTest, UnarySequencesOpenAtSigtermGoOnUntilTheyEnd) {
  for (const bool left_open : {false, true}) {
    SCOPED_TRACE(left_open ? "one left open" : "both ended");
    StartServer({"--shutdown-grace-seconds", left_open ? "2" : "30", "--http-address",
                 "127.0.0.1:0"});
    auto infer = InferStub(server_->Channel());
    std::mt19937 rng(21);
    // A sequence over REST too.
    HttpClient http(server_->http_address());
    auto rest_step = [&](bool start, bool end) {
      const v1::Tensor row = RandomTensor(1, 1, 16, rng);
      return http.Call("POST", "/v2/models/mh_torch_small/infer",
                       nlohmann::json{{"inputs",
                                       {{{"name", "queries"},
                                         {"datatype", "FP32"},
                                         {"shape", {1, 1, 16}},
                                         {"data", std::vector<float>(row.data().begin(),
                                                                     row.data().end())}}}},
                                      {"parameters",
                                       {{"sequence_id", "rest"},
                                        {"sequence_start", start},
                                        {"sequence_end", end}}}}
                           .dump());
    };
    ASSERT_EQ(rest_step(true, false).status, 200);
    auto step = [&](int64_t sequence, bool start, bool end) {
      inference::InferParameter id;
      id.set_int64_param(sequence);
      inference::ModelInferResponse response;
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      return infer.ModelInfer(
          &context, SequenceRequest("mh_torch_small", RandomTensor(1, 1, 16, rng), id, start, end),
          &response);
    };
    for (int64_t sequence : {1, 2}) ASSERT_TRUE(step(sequence, true, false).ok());
    const auto signalled = std::chrono::steady_clock::now();
    server_->Signal(SIGTERM);
    // No drain delay: refusals begin at once; give the signal a moment.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    for (int i = 0; i < 3; ++i) {
      for (int64_t sequence : {1, 2}) {
        const grpc::Status status = step(sequence, false, false);
        EXPECT_TRUE(status.ok()) << status.error_code() << " " << status.error_message();
      }
      const HttpResult rest = rest_step(false, false);
      EXPECT_EQ(rest.status, 200) << rest.body;
    }
    const grpc::Status opening = step(3, true, false);
    EXPECT_EQ(opening.error_code(), grpc::StatusCode::UNAVAILABLE) << opening.error_message();
    {
      v1::AttendRequest request;
      request.set_model("mh_torch_small");
      *request.mutable_queries() = RandomTensor(1, 2, 16, rng);
      v1::AttendResponse response;
      grpc::ClientContext context;
      EXPECT_EQ(stub_->Attend(&context, request, &response).error_code(),
                grpc::StatusCode::UNAVAILABLE);
    }
    EXPECT_TRUE(step(1, false, true).ok());
    EXPECT_EQ(rest_step(false, true).status, 200);
    if (!left_open) {
      EXPECT_TRUE(step(2, false, true).ok());
    }
    EXPECT_EQ(server_->Wait(), 0);
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled).count();
    if (left_open) {
      EXPECT_GE(took, 2.0);  // the grace period
    } else {
      EXPECT_LT(took, 10.0);  // well before it
    }
    EXPECT_THAT(server_->Log(), HasSubstr("sessions open: their steps are admitted"));
  }
}

TEST_F(SessionTest, TritonSequencesThroughModelInfer) {
  StartServer();
  auto infer = InferStub(server_->Channel());
  std::mt19937 rng(12);
  const v1::Tensor tokens = RandomTensor(1, 5, 16, rng);
  for (bool string_id : {false, true}) {
    inference::InferParameter id;
    if (string_id) {
      id.set_string_param("conversation-a");
    } else {
      id.set_int64_param(42);
    }
    int64_t length = 0;
    for (int64_t n : {3, 1, 1}) {
      inference::ModelInferResponse response;
      grpc::ClientContext context;
      const grpc::Status status = infer.ModelInfer(
          &context,
          SequenceRequest("mh_torch_small", Rows(tokens, length, length + n), id, length == 0,
                          length + n == 5),
          &response);
      length += n;
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_LE(MaxDifference(OutputOf(response),
                              CausalPrefixAnswer(*stub_, "mh_torch_small", tokens, length, n)),
                kTolerance);
    }
    // Ended: a further request without sequence_start is refused clearly.
    inference::ModelInferResponse response;
    grpc::ClientContext context;
    const grpc::Status after = infer.ModelInfer(
        &context, SequenceRequest("mh_torch_small", Rows(tokens, 0, 1), id, false, false),
        &response);
    EXPECT_EQ(after.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(after.error_message(), HasSubstr("sequence_start"));
    // Replicas hold their own sequences: the answer names the edge's routing header.
    EXPECT_THAT(after.error_message(), HasSubstr("attention-sequence-id"));
  }
}

// (B, n, H x d) as (B, n, H, d), and back: grouped tensors sliced by Rows().
v1::Tensor WithHeads(v1::Tensor tensor, int64_t heads) {
  const int64_t width = tensor.shape(2);
  tensor.set_shape(2, heads);
  tensor.add_shape(width / heads);
  return tensor;
}
v1::Tensor WithoutHeads(v1::Tensor tensor) {
  const int64_t width = tensor.shape(2) * tensor.shape(3);
  tensor.mutable_shape()->RemoveLast();
  tensor.set_shape(2, width);
  return tensor;
}

void AddInput(inference::ModelInferRequest& request, const std::string& name,
              const v1::Tensor& tensor) {
  auto* input = request.add_inputs();
  input->set_name(name);
  input->set_datatype("FP32");
  for (int64_t size : tensor.shape()) input->add_shape(size);
  request.add_raw_input_contents(
      std::string(reinterpret_cast<const char*>(tensor.data().data()), tensor.data_size() * 4));
}

// An attention offload's decode over the Open Inference Protocol: a
// dot_product sequence of grouped heads (8 query heads over 2 kv heads)
// whose every request brings its rows' queries, keys and values, opened with
// session_memory "self"; each answer equals a causal Attend of the whole
// prefix. Keys on a sequence opened as cross memory stay refused.
TEST_F(SessionTest, GroupedSequencesBringTheirOwnKeysAndValuesThroughModelInfer) {
  StartServer();
  auto infer = InferStub(server_->Channel());
  std::mt19937 rng(31);
  const v1::Tensor queries = RandomTensor(1, 6, 8 * 4, rng);
  const v1::Tensor keys = RandomTensor(1, 6, 2 * 4, rng), values = RandomTensor(1, 6, 2 * 4, rng);
  inference::InferParameter id;
  id.set_string_param("offload");
  int64_t length = 0;
  for (int64_t n : {3, 1, 1, 1}) {
    inference::ModelInferRequest request = SequenceRequest(
        "dot_product", WithHeads(Rows(queries, length, length + n), 8), id, length == 0, false);
    AddInput(request, "keys", WithHeads(Rows(keys, length, length + n), 2));
    AddInput(request, "values", WithHeads(Rows(values, length, length + n), 2));
    if (length == 0) (*request.mutable_parameters())["session_memory"].set_string_param("self");
    inference::ModelInferResponse response;
    grpc::ClientContext context;
    const grpc::Status status = infer.ModelInfer(&context, request, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    length += n;

    v1::AttendRequest whole;
    whole.set_model("dot_product");
    *whole.mutable_queries() = WithHeads(Rows(queries, 0, length), 8);
    *whole.mutable_keys() = WithHeads(Rows(keys, 0, length), 2);
    *whole.mutable_values() = WithHeads(Rows(values, 0, length), 2);
    whole.set_causal(true);
    v1::AttendResponse expected;
    grpc::ClientContext attend_context;
    ASSERT_TRUE(stub_->Attend(&attend_context, whole, &expected).ok());
    EXPECT_LE(MaxDifference(WithoutHeads(OutputOf(response)),
                            Rows(WithoutHeads(expected.output()), length - n, length)),
              kTolerance)
        << "at length " << length;
  }

  inference::InferParameter cross_id;
  cross_id.set_int64_param(77);
  const v1::Tensor cross_queries = RandomTensor(1, 2, 8, rng);
  inference::ModelInferRequest cross =
      SequenceRequest("dot_product", Rows(cross_queries, 0, 1), cross_id, true, false);
  AddInput(cross, "keys", keys);
  inference::ModelInferResponse opened;
  grpc::ClientContext open_context;
  const grpc::Status cross_status = infer.ModelInfer(&open_context, cross, &opened);
  ASSERT_TRUE(cross_status.ok()) << cross_status.error_message();
  inference::ModelInferRequest later =
      SequenceRequest("dot_product", Rows(cross_queries, 1, 2), cross_id, false, false);
  AddInput(later, "keys", Rows(keys, 0, 1));
  inference::ModelInferResponse refused;
  grpc::ClientContext later_context;
  const grpc::Status status = infer.ModelInfer(&later_context, later, &refused);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("inputs: 'keys' only on the sequence_start"));

  inference::ModelInferRequest unknown =
      SequenceRequest("dot_product", WithHeads(Rows(queries, 0, 1), 8), id, true, false);
  (*unknown.mutable_parameters())["session_memory"].set_string_param("both");
  grpc::ClientContext unknown_context;
  const grpc::Status bad = infer.ModelInfer(&unknown_context, unknown, &refused);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(),
              HasSubstr("parameters 'session_memory': expected \"self\" or \"cross\", got \"both\""));
}

TEST_F(SessionTest, APreemptedSequenceIsToldAtItsNextRequest) {
  StartServer({"--session-memory-bytes", kTwoSmallSessions});
  auto infer = InferStub(server_->Channel());
  std::mt19937 rng(45);
  const v1::Tensor tokens = RandomTensor(1, 6, 16, rng);
  inference::InferParameter id;
  id.set_int64_param(7);
  auto request = [&](int64_t from, int64_t to, bool start) {
    inference::ModelInferResponse response;
    grpc::ClientContext context;
    return infer.ModelInfer(
        &context, SequenceRequest("mh_torch_small", Rows(tokens, from, to), id, start, false),
        &response);
  };
  const absl::Time began = absl::Now();
  ASSERT_TRUE(request(0, 3, true).ok());
  SessionCall first(*stub_), second(*stub_);
  for (SessionCall* call : {&first, &second}) {
    ASSERT_FALSE(call->Open(SelfOpen("mh_torch_small")).has_error());
    // Past the kept time of the sessions before (as in
    // ANewSessionPreemptsTheLeastRecentlySteppedIdleOne): the sequence is
    // the least recently stepped.
    if (call == &second) absl::SleepFor(5 * (absl::Now() - began));
    const v1::SessionResponse answer = call->Step(Rows(tokens, 0, 4));
    ASSERT_FALSE(answer.has_error()) << answer.error().message();
  }
  const grpc::Status told = request(3, 4, false);
  EXPECT_EQ(told.error_code(), grpc::StatusCode::UNAVAILABLE) << told.error_message();
  EXPECT_THAT(told.error_message(), HasSubstr("preempted"));
  EXPECT_EQ(Preemptions(*server_), 1);
  EXPECT_TRUE(first.Close().ok());
  EXPECT_TRUE(second.Close().ok());
}

// What a session does not take is refused naming it, and the session goes
// on: a step's own keys where the session has no grouped heads (they reach
// the engine's check through the step message); positions on any request of
// a Triton sequence (its positions come from its length); a window or a
// soft-cap on a later request (the sequence keeps its opening's) or on an
// opening whose model is not dot_product (they reach the session's checks).
TEST_F(SessionTest, KeysPositionsWindowAndSoftcapASessionDoesNotTakeAreRefusedNamingThem) {
  StartServer();
  std::mt19937 rng(21);
  const v1::Tensor tokens = RandomTensor(1, 3, 16, rng);
  SessionCall call(*stub_);
  ASSERT_FALSE(call.Open(SelfOpen("mh_torch_small")).has_error());
  ASSERT_FALSE(call.Step(Rows(tokens, 0, 2)).has_error());
  v1::SessionRequest with_keys;
  *with_keys.mutable_step()->mutable_queries() = Rows(tokens, 2, 3);
  *with_keys.mutable_step()->mutable_keys() = Rows(tokens, 2, 3);
  const v1::SessionResponse refused = call.Send(with_keys);
  EXPECT_EQ(refused.error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error().message(), HasSubstr("keys: a step carries its own keys"));
  EXPECT_EQ(refused.length(), 2);
  ASSERT_FALSE(call.Step(Rows(tokens, 2, 3)).has_error()) << "the session goes on";
  EXPECT_TRUE(call.Close().ok());

  // The opening's window reaches the session: refused for multi_head.
  SessionCall windowed(*stub_);
  v1::SessionOpen open = SelfOpen("mh_torch_small");
  open.set_sliding_window(2);
  const v1::SessionResponse layer_window = windowed.Open(open);
  EXPECT_EQ(layer_window.error().code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(layer_window.error().message(), HasSubstr("sliding_window: only dot_product"));
  EXPECT_TRUE(windowed.Close().ok());

  auto infer = InferStub(server_->Channel());
  const auto expect_refused = [&](const inference::ModelInferRequest& request,
                                  const std::string& message) {
    inference::ModelInferResponse response;
    grpc::ClientContext context;
    const grpc::Status status = infer.ModelInfer(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << message;
    EXPECT_THAT(status.error_message(), HasSubstr(message));
  };
  inference::InferParameter id;
  id.set_int64_param(9);
  inference::ModelInferRequest positions =
      SequenceRequest("mh_torch_small", Rows(tokens, 0, 2), id, true, false);
  auto* ids = positions.add_inputs();
  ids->set_name("position_ids");
  ids->set_datatype("INT64");
  ids->add_shape(2);
  const std::vector<int64_t> two = {0, 1};
  positions.add_raw_input_contents(
      std::string(reinterpret_cast<const char*>(two.data()), two.size() * sizeof(int64_t)));
  expect_refused(positions, "inputs 'position_ids': expected none on a sequence request");
  inference::ModelInferRequest mh_window =
      SequenceRequest("mh_torch_small", Rows(tokens, 0, 2), id, true, false);
  (*mh_window.mutable_parameters())["sliding_window"].set_int64_param(2);
  expect_refused(mh_window, "sliding_window: only dot_product");

  // dot_product takes them at the start, and only there.
  inference::ModelInferRequest start =
      SequenceRequest("dot_product", Rows(tokens, 0, 2), id, true, false);
  (*start.mutable_parameters())["sliding_window"].set_int64_param(1);
  (*start.mutable_parameters())["softcap"].set_double_param(5);
  inference::ModelInferResponse started;
  grpc::ClientContext context;
  const grpc::Status status = infer.ModelInfer(&context, start, &started);
  ASSERT_TRUE(status.ok()) << status.error_message();
  for (const std::string parameter : {"sliding_window", "softcap"}) {
    inference::ModelInferRequest later =
        SequenceRequest("dot_product", Rows(tokens, 2, 3), id, false, false);
    if (parameter == "softcap") {
      (*later.mutable_parameters())[parameter].set_double_param(5);
    } else {
      (*later.mutable_parameters())[parameter].set_int64_param(1);
    }
    expect_refused(later, "parameters '" + parameter + "' only on the sequence_start request");
  }
}

// A sequence's step whose deadline passes between its pieces is answered
// DEADLINE_EXCEEDED and its session is as before it: the next step answers
// as if it never came.
TEST_F(SessionTest, AStepWhoseDeadlinePassesBetweenItsPiecesIsRolledBack) {
  TestGate gate;
  ASSERT_TRUE(gate.ok());
  StartServer({"--chunk-work", "20000"}, &gate);
  auto infer = InferStub(server_->Channel());
  std::mt19937 rng(32);
  const v1::Tensor first = RandomTensor(1, 1, 8, rng), prompt = RandomTensor(1, 200, 8, rng),
                   next = RandomTensor(1, 1, 8, rng);
  inference::InferParameter id;
  id.set_int64_param(7);
  ASSERT_TRUE(gate.Release(1));
  {
    inference::ModelInferResponse response;
    grpc::ClientContext context;
    ASSERT_TRUE(infer.ModelInfer(&context, SequenceRequest("gate", first, id, true, false),
                                 &response)
                    .ok());
  }
  {
    // Its first piece waits at the gate past the deadline; the second asks
    // the step's stop before it begins. The deadline leaves a loaded machine
    // time to admit the step (one that never reached the server would not
    // be counted below), and the step is seen in flight before it passes.
    const auto sent = std::chrono::system_clock::now();
    const auto deadline = sent + std::chrono::seconds(2);
    std::future<grpc::Status> late = std::async(std::launch::async, [&] {
      inference::ModelInferResponse response;
      grpc::ClientContext context;
      context.set_deadline(deadline);
      return infer.ModelInfer(&context, SequenceRequest("gate", prompt, id, false, false),
                              &response);
    });
    EXPECT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
      return MetricValue(text, "attention_inflight_requests") == 1;
    })) << "the step was never admitted";
    const auto admitted = std::chrono::system_clock::now();
    const grpc::Status status = late.get();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
    // gRPC sends the time left, so the server's deadline is the client's plus
    // the request's transit, which ended before the step was seen admitted:
    // past this, the second piece surely finds it passed (a third piece
    // would wait at the gate for a byte that never comes).
    std::this_thread::sleep_until(deadline + (admitted - sent) + std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(gate.Release(2));
  ASSERT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
    return MetricValue(text, "attention_requests_total",
                       {{"model", "gate"}, {"code", "DEADLINE_EXCEEDED"}}) == 1;
  })) << "the step was not answered DEADLINE_EXCEEDED: " << [&] {
    std::string lines;
    for (const absl::string_view line : absl::StrSplit(ScrapeMetrics(server_->metrics_address()), '\n')) {
      if (absl::StrContains(line, "gate")) absl::StrAppend(&lines, line, "\n");
    }
    return lines;
  }();
  ASSERT_TRUE(gate.Release(1));
  // The refusal is counted just before the sequence is free again: until
  // then a step is FAILED_PRECONDITION (refused before any batch).
  inference::ModelInferResponse response;
  grpc::Status status;
  for (int attempt = 0; attempt < 500; ++attempt) {
    grpc::ClientContext context;
    status = infer.ModelInfer(&context, SequenceRequest("gate", next, id, false, true), &response);
    if (status.error_code() != grpc::StatusCode::FAILED_PRECONDITION) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(status.ok()) << status.error_message();
  v1::Tensor both = first;
  both.set_shape(1, 2);
  both.mutable_data()->Add(next.data().begin(), next.data().end());
  EXPECT_LE(MaxDifference(OutputOf(response), CausalPrefixAnswer(*stub_, "dot_product", both, 2, 1)),
            kTolerance);
}

TEST_F(SessionTest, TritonSequencesThroughModelStreamInfer) {
  StartServer();
  auto infer = InferStub(server_->Channel());
  std::mt19937 rng(13);
  const v1::Tensor a = RandomTensor(1, 4, 16, rng), b = RandomTensor(1, 4, 16, rng);
  grpc::ClientContext context;
  auto stream = infer.ModelStreamInfer(&context);
  inference::InferParameter id_a, id_b;
  id_a.set_int64_param(1);
  id_b.set_string_param("b");
  // Sent without waiting, the two sequences interleaved.
  for (int64_t t = 0; t < 4; ++t) {
    ASSERT_TRUE(stream->Write(
        SequenceRequest("mh_torch_small", Rows(a, t, t + 1), id_a, t == 0, t == 3)));
    ASSERT_TRUE(stream->Write(
        SequenceRequest("mh_torch_small", Rows(b, t, t + 1), id_b, t == 0, t == 3)));
  }
  stream->WritesDone();
  for (int64_t t = 0; t < 4; ++t) {
    for (const v1::Tensor* tokens : {&a, &b}) {
      inference::ModelStreamInferResponse response;
      ASSERT_TRUE(stream->Read(&response));
      ASSERT_EQ(response.error_message(), "");
      EXPECT_LE(MaxDifference(OutputOf(response.infer_response()),
                              CausalPrefixAnswer(*stub_, "mh_torch_small", *tokens, t + 1, 1)),
                kTolerance);
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(SessionTest, TritonSequencesThroughRest) {
  StartServer({"--http-address", "127.0.0.1:0"});
  std::mt19937 rng(14);
  const v1::Tensor tokens = RandomTensor(1, 3, 16, rng);
  auto body = [&](int64_t from, int64_t to, nlohmann::json parameters) {
    const v1::Tensor rows = Rows(tokens, from, to);
    return nlohmann::json{
        {"inputs",
         {{{"name", "queries"},
           {"datatype", "FP32"},
           {"shape", {1, to - from, 16}},
           {"data", std::vector<float>(rows.data().begin(), rows.data().end())}}}},
        {"parameters", parameters}}
        .dump();
  };
  HttpClient http(server_->http_address());
  const std::string path = "/v2/models/mh_torch_small/infer";
  const HttpResult unknown = http.Call("POST", path, body(0, 1, {{"sequence_id", "rest"}}));
  EXPECT_EQ(unknown.status, 400) << unknown.body;
  EXPECT_THAT(unknown.body, HasSubstr("sequence_start"));
  const HttpResult first = http.Call(
      "POST", path, body(0, 2, {{"sequence_id", "rest"}, {"sequence_start", true}}));
  ASSERT_EQ(first.status, 200) << first.body;
  const HttpResult next = http.Call(
      "POST", path, body(2, 3, {{"sequence_id", "rest"}, {"sequence_end", true}}));
  ASSERT_EQ(next.status, 200) << next.body;
  const nlohmann::json answer = nlohmann::json::parse(next.body);
  v1::Tensor output;
  for (int64_t size : answer["outputs"][0]["shape"]) output.add_shape(size);
  for (float value : answer["outputs"][0]["data"]) output.add_data(value);
  EXPECT_LE(MaxDifference(output, CausalPrefixAnswer(*stub_, "mh_torch_small", tokens, 3, 1)),
            kTolerance);
}

TEST_F(SessionTest, ABrokenStreamReturnsItsSessionsMemory) {
  StartServer();
  std::mt19937 rng(31);
  SessionCall call(*stub_);
  ASSERT_FALSE(call.Open(SelfOpen("mh_torch_small")).has_error());
  ASSERT_FALSE(call.Step(RandomTensor(1, 300, 16, rng)).has_error());
  EXPECT_GT(MetricValue(ScrapeMetrics(server_->metrics_address()),
                        "attention_session_pool_used_bytes"),
            0);
  call.Cancel();
  EXPECT_TRUE(WaitForMetrics(server_->metrics_address(), [](const std::string& text) {
    return MetricValue(text, "attention_sessions_ended_total", {{"reason", "failed"}}) == 1 &&
           MetricValue(text, "attention_session_pool_used_bytes") == 0 &&
           MetricValue(text, "attention_sessions_open") == 0;
  }));
}

TEST_F(SessionTest, MemoryReturnsToThePoolAndRssStaysBounded) {
  StartServer();
  std::mt19937 rng(30);
  const v1::Tensor prompt = RandomTensor(1, 40, 16, rng), token = RandomTensor(1, 1, 16, rng);
  auto cycles = [&](int count) {
    for (int i = 0; i < count; ++i) {
      SessionCall call(*stub_);
      ASSERT_FALSE(call.Open(SelfOpen("mh_torch_small")).has_error());
      ASSERT_FALSE(call.Step(prompt).has_error());
      ASSERT_FALSE(call.Step(token).has_error());
      ASSERT_TRUE(call.Close().ok());
    }
  };
  cycles(100);
  const int64_t warm = ResidentBytes(server_->pid());
  cycles(1000);
  const int64_t after = ResidentBytes(server_->pid());
  // A sanitizer holds freed memory back (ASan's quarantine), so resident
  // sizes mean something in the plain build only; the pool is checked in both.
  if (!kSanitizedBuild) {
    EXPECT_LT(after - warm, 16 << 20) << "RSS grew from " << warm << " to " << after;
  }
  // Closing is asynchronous to the client's Finish by a moment.
  std::string metrics;
  for (int i = 0; i < 50; ++i) {
    metrics = ScrapeMetrics(server_->metrics_address());
    if (MetricValue(metrics, "attention_sessions_open") == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(MetricValue(metrics, "attention_sessions_open"), 0);
  EXPECT_EQ(MetricValue(metrics, "attention_session_pool_used_bytes"), 0);
  EXPECT_EQ(MetricValue(metrics, "attention_sessions_opened_total", {{"model", "mh_torch_small"}}),
            1100);
}

}  // namespace
}  // namespace attention::testing
