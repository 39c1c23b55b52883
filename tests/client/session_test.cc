// client_session_test.cc: Session (client/cpp/session.h) against real
// attention-servers: steps equal causal Attend on the prefix, a refused step
// leaves the session as it was; and sessions that lose their server halfway
// through a decode (kill -9, then a new server on the same port; SIGTERM,
// its grace run out, the other server of the target left): every step
// still succeeds, outputs equal an uninterrupted decode's on another server
// within 1e-4, and replays() is 1. With replay off the break is the stream's
// status; with rows past replay_limit_bytes an error that says so.
#include <csignal>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "client/cpp/attention_client.h"
#include "client/cpp/session.h"
#include "tests/support/metrics.h"
#include "tests/support/server_process.h"

namespace attention::client {
namespace {

using attention::testing::ConformanceDir;
using attention::testing::MetricValue;
using attention::testing::ScrapeMetrics;
using attention::testing::ServerProcess;
using attention::v1::SessionResponse;
using attention::v1::Tensor;
using ::testing::HasSubstr;

constexpr char kModel[] = "mh_torch_small";  // multi_head, E = 16: self memory
constexpr int kWidth = 16;
constexpr int kSteps = 8;  // a 3-row prompt, then one token a step
constexpr int kBreakAt = kSteps / 2;

std::unique_ptr<ServerProcess> StartServer(std::vector<std::string> flags = {}) {
  flags.insert(flags.end(), {"--threads", "1", "--model-repository",
                             (ConformanceDir() / "models").string()});
  absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(flags);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

std::unique_ptr<AttentionClient> Connect(const std::string& target) {
  ClientOptions options;
  options.target = target;
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

Tensor Random(std::vector<int64_t> shape, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1, 1);
  Tensor tensor;
  int64_t count = 1;
  for (int64_t size : shape) {
    tensor.add_shape(size);
    count *= size;
  }
  for (int64_t i = 0; i < count; ++i) tensor.add_data(uniform(rng));
  return tensor;
}

// The decode's steps: a prompt of 3 rows, then single tokens.
std::vector<Tensor> DecodeRows(int64_t batch, int seed, int64_t width = kWidth) {
  std::mt19937 rng(seed);
  std::vector<Tensor> steps;
  for (int i = 0; i < kSteps; ++i) steps.push_back(Random({batch, i == 0 ? 3 : 1, width}, rng));
  return steps;
}

SessionOptions SelfMemory(int64_t batch = 1) {
  SessionOptions options;
  options.open.set_model(kModel);
  options.open.set_batch(batch);
  return options;
}

// Every step's output, or the first error; before_break() runs before step
// kBreakAt.
absl::StatusOr<std::vector<Tensor>> Decode(Session& session, const std::vector<Tensor>& steps,
                                           const std::function<void()>& before_break = {}) {
  std::vector<Tensor> outputs;
  for (int i = 0; i < static_cast<int>(steps.size()); ++i) {
    if (i == kBreakAt && before_break) before_break();
    absl::StatusOr<SessionResponse> step = session.Step(steps[i]);
    if (!step.ok()) return step.status();
    outputs.push_back(step->output());
  }
  return outputs;
}

void ExpectClose(const Tensor& actual, const Tensor& expected, const std::string& what) {
  ASSERT_THAT(actual.shape(), ::testing::ElementsAreArray(expected.shape())) << what;
  double max_diff = 0;
  for (int i = 0; i < expected.data_size(); ++i) {
    max_diff = std::max(max_diff, std::abs(double{actual.data(i)} - expected.data(i)));
  }
  EXPECT_LE(max_diff, 1e-4) << what;
}

class ClientSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    reference_server_ = StartServer();
    ASSERT_NE(reference_server_, nullptr);
    reference_ = Connect(reference_server_->address());
  }

  // The outputs of `steps` on the reference server, uninterrupted.
  std::vector<Tensor> Uninterrupted(const SessionOptions& options,
                                    const std::vector<Tensor>& steps) {
    absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(*reference_, options);
    EXPECT_TRUE(session.ok()) << session.status();
    if (!session.ok()) return {};
    absl::StatusOr<std::vector<Tensor>> outputs = Decode(**session, steps);
    EXPECT_TRUE(outputs.ok()) << outputs.status();
    return outputs.ok() ? *outputs : std::vector<Tensor>{};
  }

  void ExpectSameDecode(const std::vector<Tensor>& outputs, const std::vector<Tensor>& expected) {
    ASSERT_EQ(outputs.size(), expected.size());
    for (size_t i = 0; i < outputs.size(); ++i) {
      ExpectClose(outputs[i], expected[i], "step " + std::to_string(i));
    }
  }

  // kill -9 `server`, then a new one on its port: the same target.
  std::function<void()> KillAndRestart(std::unique_ptr<ServerProcess>& server) {
    return [&server] {
      const std::string address = server->address();
      server->Signal(SIGKILL);
      server->Wait();
      server = StartServer({"--address", address});
      ASSERT_NE(server, nullptr);
    };
  }

  std::unique_ptr<ServerProcess> reference_server_;
  std::unique_ptr<AttentionClient> reference_;
};

TEST_F(ClientSessionTest, SelfStepsEqualCausalAttendOnThePrefix) {
  std::mt19937 rng(1);
  const Tensor tokens = Random({1, 6, kWidth}, rng);
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(*reference_, SelfMemory());
  ASSERT_TRUE(session.ok()) << session.status();
  EXPECT_EQ((*session)->length(), 0);
  int64_t length = 0;
  for (int64_t n : {3, 1, 2}) {
    Tensor rows;
    rows.add_shape(1), rows.add_shape(n), rows.add_shape(kWidth);
    rows.mutable_data()->Add(tokens.data().begin() + length * kWidth,
                             tokens.data().begin() + (length + n) * kWidth);
    absl::StatusOr<SessionResponse> step = (*session)->Step(rows);
    ASSERT_TRUE(step.ok()) << step.status();
    length += n;
    EXPECT_EQ(step->length(), length);
    attention::v1::AttendRequest whole;
    whole.set_model(kModel);
    whole.set_causal(true);
    whole.mutable_queries()->add_shape(1), whole.mutable_queries()->add_shape(length);
    whole.mutable_queries()->add_shape(kWidth);
    whole.mutable_queries()->mutable_data()->Add(tokens.data().begin(),
                                                 tokens.data().begin() + length * kWidth);
    absl::StatusOr<attention::v1::AttendResponse> expected = reference_->Attend(whole);
    ASSERT_TRUE(expected.ok()) << expected.status();
    Tensor last;
    last.add_shape(1), last.add_shape(n), last.add_shape(kWidth);
    last.mutable_data()->Add(expected->output().data().begin() + (length - n) * kWidth,
                             expected->output().data().end());
    ExpectClose(step->output(), last, "after " + std::to_string(length) + " rows");
  }
  EXPECT_EQ((*session)->replays(), 0);
}

TEST_F(ClientSessionTest, RefusedStepLeavesTheSessionAsItWas) {
  std::mt19937 rng(2);
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(*reference_, SelfMemory());
  ASSERT_TRUE(session.ok()) << session.status();
  ASSERT_TRUE((*session)->Step(Random({1, 2, kWidth}, rng)).ok());
  absl::StatusOr<SessionResponse> wrong = (*session)->Step(Random({1, 1, 5}, rng));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument) << wrong.status();
  EXPECT_EQ((*session)->length(), 2);
  // A whole SessionStep reaches the server as it is: its own keys, which a
  // session without grouped heads refuses, naming them.
  attention::v1::SessionStep with_keys;
  *with_keys.mutable_queries() = Random({1, 1, kWidth}, rng);
  *with_keys.mutable_keys() = Random({1, 1, kWidth}, rng);
  absl::StatusOr<SessionResponse> keys = (*session)->Step(with_keys);
  EXPECT_EQ(keys.status().code(), absl::StatusCode::kInvalidArgument) << keys.status();
  EXPECT_THAT(std::string(keys.status().message()), HasSubstr("keys"));
  EXPECT_EQ((*session)->length(), 2);
  absl::StatusOr<SessionResponse> next = (*session)->Step(Random({1, 1, kWidth}, rng));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->length(), 3);

  SessionOptions unknown;
  unknown.open.set_model("no_such_model");
  EXPECT_EQ(Session::Open(*reference_, unknown).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ClientSessionTest, KillNineMidDecodeReplaysOnceOnTheRestartedServer) {
  const std::vector<Tensor> steps = DecodeRows(2, 11);  // B = 2: rows kept per example
  std::unique_ptr<ServerProcess> server = StartServer();
  ASSERT_NE(server, nullptr);
  std::unique_ptr<AttentionClient> client = Connect(server->address());
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(*client, SelfMemory(2));
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<std::vector<Tensor>> outputs = Decode(**session, steps, KillAndRestart(server));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  EXPECT_EQ((*session)->replays(), 1);
  EXPECT_EQ((*session)->length(), 3 + kSteps - 1);
  // `server` is the restarted one now.
  EXPECT_EQ(MetricValue(ScrapeMetrics(server->metrics_address()), "attention_sessions_open"), 1);
  ExpectSameDecode(*outputs, Uninterrupted(SelfMemory(2), steps));
}

TEST_F(ClientSessionTest, SigtermMovesTheSessionToTheOtherServerOfTheTarget) {
  const std::vector<Tensor> steps = DecodeRows(1, 12);
  std::unique_ptr<ServerProcess> servers[] = {StartServer({"--shutdown-grace-seconds", "1"}),
                                              StartServer({"--shutdown-grace-seconds", "1"})};
  ASSERT_NE(servers[0], nullptr);
  ASSERT_NE(servers[1], nullptr);
  std::unique_ptr<AttentionClient> client =
      Connect(servers[0]->address() + "," + servers[1]->address());
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(*client, SelfMemory());
  ASSERT_TRUE(session.ok()) << session.status();
  const int holder =
      MetricValue(ScrapeMetrics(servers[0]->metrics_address()), "attention_sessions_open") == 1
          ? 0
          : 1;
  ASSERT_EQ(MetricValue(ScrapeMetrics(servers[holder]->metrics_address()),
                        "attention_sessions_open"),
            1);
  // The stopped server ends the session with UNAVAILABLE once its grace runs
  // out (docs/api.md section 11.5) and exits; then the step.
  absl::StatusOr<std::vector<Tensor>> outputs =
      Decode(**session, steps, [&] { EXPECT_EQ(servers[holder]->Stop(), 0); });
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  EXPECT_EQ((*session)->replays(), 1);
  EXPECT_EQ(MetricValue(ScrapeMetrics(servers[1 - holder]->metrics_address()),
                        "attention_sessions_opened_total"),
            1);
  ExpectSameDecode(*outputs, Uninterrupted(SelfMemory(), steps));
}

TEST_F(ClientSessionTest, CrossMemoryIsReplayedFromItsOpening) {
  std::mt19937 rng(13);
  SessionOptions cross;
  cross.open.set_model("additive_small");
  cross.open.set_memory(attention::v1::SESSION_MEMORY_CROSS);
  *cross.open.mutable_keys() = Random({1, 5, 5}, rng);
  *cross.open.mutable_values() = Random({1, 5, 3}, rng);
  cross.open.add_valid_lens(4);
  std::vector<Tensor> steps;
  for (int i = 0; i < kSteps; ++i) steps.push_back(Random({1, 1, 6}, rng));
  std::unique_ptr<ServerProcess> server = StartServer();
  ASSERT_NE(server, nullptr);
  std::unique_ptr<AttentionClient> client = Connect(server->address());
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(*client, cross);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<std::vector<Tensor>> outputs = Decode(**session, steps, KillAndRestart(server));
  ASSERT_TRUE(outputs.ok()) << outputs.status();
  EXPECT_EQ((*session)->replays(), 1);
  EXPECT_EQ((*session)->length(), 5);
  ExpectSameDecode(*outputs, Uninterrupted(cross, steps));
}

TEST_F(ClientSessionTest, WithoutReplayTheBreakIsTheStreamsStatus) {
  std::unique_ptr<ServerProcess> server = StartServer();
  ASSERT_NE(server, nullptr);
  std::unique_ptr<AttentionClient> client = Connect(server->address());
  SessionOptions options = SelfMemory();
  options.replay = false;
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(*client, options);
  ASSERT_TRUE(session.ok()) << session.status();
  absl::StatusOr<std::vector<Tensor>> outputs =
      Decode(**session, DecodeRows(1, 16), KillAndRestart(server));
  EXPECT_EQ(outputs.status().code(), absl::StatusCode::kUnavailable) << outputs.status();
  EXPECT_THAT(outputs.status().message(), ::testing::Not(HasSubstr("replay")));
  EXPECT_EQ((*session)->replays(), 0);
}

TEST_F(ClientSessionTest, RowsPastTheLimitMakeTheBreakFailSayingWhy) {
  std::unique_ptr<ServerProcess> server = StartServer();
  ASSERT_NE(server, nullptr);
  std::unique_ptr<AttentionClient> client = Connect(server->address());
  SessionOptions options = SelfMemory();
  options.replay_limit_bytes = 300;  // the prompt (192 bytes) fits; two more tokens do not
  absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(*client, options);
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<Tensor> steps = DecodeRows(1, 17);
  absl::StatusOr<std::vector<Tensor>> outputs = Decode(**session, steps, KillAndRestart(server));
  EXPECT_EQ(outputs.status().code(), absl::StatusCode::kUnavailable) << outputs.status();
  EXPECT_THAT(outputs.status().message(), HasSubstr("replay_limit_bytes=300"));
  EXPECT_EQ((*session)->replays(), 0);
  EXPECT_EQ((*session)->Step(steps.back()).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace attention::client
