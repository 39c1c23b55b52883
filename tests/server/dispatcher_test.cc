// dispatcher_test.cc: the request pipeline without any transport: requests
// from a fake CallOrigin are checked, batched, computed and answered in the
// order of checks docs/api.md section 3 gives, and drain waits for open calls;
// a session's steps take the same way (SubmitStep) and batch with requests.
#include "server/dispatch/dispatcher.h"

#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/sessions/session.h"
#include "prometheus/text_serializer.h"
#include "server/observability/metrics.h"
#include "server/repository/registry.h"
#include "server/security/access_policy.h"
#include "tests/support/metrics.h"

namespace attention::server {
namespace {

// A caller that sends `token` (checked against the policy's tokens as a
// bearer token would be) and can be cancelled.
class FakeOrigin final : public CallOrigin {
 public:
  explicit FakeOrigin(std::string token = "") : token_(std::move(token)) {}

  absl::Time deadline() const override { return absl::InfiniteFuture(); }
  bool cancelled() const override { return cancelled_.load(); }
  std::string peer() const override { return "fake:1"; }
  absl::Status Authenticate(const AccessPolicy& access) const override {
    ++authentications_;
    const std::shared_ptr<const std::vector<std::string>> tokens = access.tokens();
    if (tokens->empty()) return absl::OkStatus();
    for (const std::string& accepted : *tokens) {
      if (accepted == token_) return absl::OkStatus();
    }
    return absl::UnauthenticatedError("fake: no accepted token");
  }

  int authentications() const { return authentications_.load(); }

 private:
  const std::string token_;
  std::atomic<bool> cancelled_{false};
  mutable std::atomic<int> authentications_{0};
};

// One request's answer, waited for.
struct Answer {
  absl::Notification done;
  absl::Status status;
  std::vector<float> output;
  std::thread::id thread;  // the one that answered
};

class DispatcherTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> tokens = {},
             int64_t inline_work = DispatchOptions{}.inline_work) {
    ASSERT_TRUE(registry_.AddBuiltIn(DotProductModel()).ok());
    metrics_ = std::make_unique<ServerMetrics>(std::vector<std::string>{"dot_product"}, 8, 64);
    DispatchOptions options;
    options.auth_tokens = std::move(tokens);
    options.inline_work = inline_work;
    auto dispatcher = Dispatcher::Create(&registry_, &engine_, metrics_.get(), options);
    ASSERT_TRUE(dispatcher.ok()) << dispatcher.status();
    dispatcher_ = *std::move(dispatcher);
  }

  // Submits self-attention over queries (1, 2, 2) to `model`; `decoded`
  // counts the calls of the request's Decode.
  void Submit(const FakeOrigin& origin, Answer* answer, std::string_view model = "dot_product",
              absl::Status readable = absl::OkStatus(), bool credentials_checked = false,
              int* decoded = nullptr) {
    dispatcher_->Submit(
        origin,
        Dispatcher::Request{.api = "test",
                            .model = model,
                            .request_id = "r",
                            .message_bytes = 16,
                            .credentials_checked = credentials_checked,
                            .readable = std::move(readable)},
        [this, decoded]() -> absl::StatusOr<AttentionRequest> {
          if (decoded != nullptr) ++*decoded;
          AttentionRequest request;
          request.queries = TensorView{{1, 2, 2}, queries_};
          return request;
        },
        [answer](const absl::Status& status, const AttentionResult* result) {
          answer->status = status;
          if (result != nullptr) answer->output = result->output.data;
          answer->thread = std::this_thread::get_id();
          answer->done.Notify();
        });
  }

  // Submits a step of `session` with the (1, n, 2) `rows`; `decoded` counts
  // the calls of its DecodeStep.
  void SubmitStep(const FakeOrigin& origin, Answer* answer, Session& session,
                  const std::vector<float>& rows, bool continues_session = false,
                  int* decoded = nullptr) {
    dispatcher_->SubmitStep(
        origin,
        Dispatcher::Request{.api = "test",
                            .model = "dot_product",
                            .request_id = "s",
                            .message_bytes = 16,
                            .readable = absl::OkStatus(),
                            .continues_session = continues_session},
        [&, decoded](const absl::StatusOr<ServedModel>& resolved)
            -> absl::StatusOr<Dispatcher::Step> {
          if (decoded != nullptr) ++*decoded;
          if (!resolved.ok()) return resolved.status();
          const int64_t n = static_cast<int64_t>(rows.size()) / 2;
          return Dispatcher::Step{.session = &session,
                                  .served = *resolved,
                                  .step = SessionStep{.queries = TensorView{{1, n, 2}, rows}}};
        },
        [answer](const absl::Status& status, const AttentionResult* result) {
          answer->status = status;
          if (result != nullptr) answer->output = result->output.data;
          answer->thread = std::this_thread::get_id();
          answer->done.Notify();
        });
  }

  static absl::Status Wait(Answer& answer) {
    EXPECT_TRUE(answer.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    return answer.status;
  }

  const std::vector<float> queries_ = {1.0f, 0.0f, 0.0f, 1.0f};
  ModelRegistry registry_;
  Engine engine_{EngineOptions{.num_threads = 1}};
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<Dispatcher> dispatcher_;
};

TEST_F(DispatcherTest, ComputesARequestAndAnswersOnce) {
  Start();
  FakeOrigin origin;
  Answer answer;
  Submit(origin, &answer);
  ASSERT_TRUE(Wait(answer).ok()) << answer.status;
  // Each query attends mostly to itself: softmax([1, 0] / sqrt(2)).
  const float self = 1.0f / (1.0f + std::exp(-1.0f / std::sqrt(2.0f)));
  EXPECT_THAT(answer.output, ::testing::Pointwise(::testing::FloatNear(1e-5f),
                                                  {self, 1 - self, 1 - self, self}));
  EXPECT_EQ(origin.authentications(), 1);
}

// A request within --inline-work that finds its batcher idle is computed and
// answered inside Submit(), on the caller's thread, with the same result.
TEST_F(DispatcherTest, ASmallRequestOnAnIdleBatcherIsComputedOnTheCallersThread) {
  Start();
  FakeOrigin origin;
  Answer answer;
  Submit(origin, &answer);
  ASSERT_TRUE(answer.done.HasBeenNotified()) << "not answered inside Submit()";
  ASSERT_TRUE(answer.status.ok()) << answer.status;
  EXPECT_EQ(answer.thread, std::this_thread::get_id());
  const float self = 1.0f / (1.0f + std::exp(-1.0f / std::sqrt(2.0f)));
  EXPECT_THAT(answer.output, ::testing::Pointwise(::testing::FloatNear(1e-5f),
                                                  {self, 1 - self, 1 - self, self}));
  // Counted as a batch of one that left the queue.
  const std::string text = prometheus::TextSerializer().Serialize(metrics_->registry()->Collect());
  const std::map<std::string, std::string> model = {{"model", "dot_product"}};
  EXPECT_EQ(testing::MetricValue(text, "attention_batch_size_count", model), 1);
  EXPECT_EQ(testing::MetricValue(text, "attention_batch_size_sum", model), 1);
  EXPECT_EQ(testing::MetricValue(text, "attention_queue_depth", model), 0);
}

// Over --inline-work (1 unit: less than any request), or with it 0, a
// request goes to the batcher's thread.
class DispatcherInlineWorkTest : public DispatcherTest,
                                 public ::testing::WithParamInterface<int64_t> {};

TEST_P(DispatcherInlineWorkTest, ARequestOverItGoesToTheBatchersThread) {
  Start({}, /*inline_work=*/GetParam());
  FakeOrigin origin;
  Answer answer;
  Submit(origin, &answer);
  ASSERT_TRUE(Wait(answer).ok()) << answer.status;
  EXPECT_NE(answer.thread, std::this_thread::get_id());
  EXPECT_EQ(answer.output.size(), 4u);
}

INSTANTIATE_TEST_SUITE_P(OneUnitOrNone, DispatcherInlineWorkTest,
                         ::testing::Values(int64_t{1}, int64_t{0}));

TEST_F(DispatcherTest, ChecksRunInTheDocumentedOrderAndRefusedCallsAreNeverDecoded) {
  Start({"secret"});
  int decoded = 0;
  // Credentials first: an unknown model and unreadable bytes are not looked at.
  FakeOrigin stranger("wrong");
  Answer refused;
  Submit(stranger, &refused, "no_such_model", absl::InvalidArgumentError("bad bytes"), false,
         &decoded);
  EXPECT_EQ(Wait(refused).code(), absl::StatusCode::kUnauthenticated);

  // Then the bytes, before the model name.
  FakeOrigin client("secret");
  Answer unreadable;
  Submit(client, &unreadable, "no_such_model", absl::InvalidArgumentError("bad bytes"), false,
         &decoded);
  EXPECT_EQ(Wait(unreadable).message(), "bad bytes");

  // Then the model: NOT_FOUND, still not decoded.
  Answer unknown;
  Submit(client, &unknown, "no_such_model", absl::OkStatus(), false, &decoded);
  EXPECT_EQ(Wait(unknown).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(decoded, 0);

  // A stream's request, its credentials checked when the stream opened.
  FakeOrigin opened("wrong");
  Answer streamed;
  Submit(opened, &streamed, "dot_product", absl::OkStatus(), /*credentials_checked=*/true,
         &decoded);
  EXPECT_TRUE(Wait(streamed).ok()) << streamed.status;
  EXPECT_EQ(opened.authentications(), 0);
  EXPECT_EQ(decoded, 1);
}

TEST_F(DispatcherTest, ReplacedTokensApplyToTheNextCall) {
  Start({"old"});
  FakeOrigin client("new");
  Answer before;
  Submit(client, &before);
  EXPECT_EQ(Wait(before).code(), absl::StatusCode::kUnauthenticated);
  dispatcher_->access().ReplaceTokens({"new"});
  Answer after;
  Submit(client, &after);
  EXPECT_TRUE(Wait(after).ok()) << after.status;
}

TEST_F(DispatcherTest, DrainRefusesNewCallsAndWaitsForOpenOnes) {
  Start();
  ASSERT_TRUE(dispatcher_->OpenCall("requests").ok());
  dispatcher_->StopAccepting();
  EXPECT_FALSE(dispatcher_->accepting());
  FakeOrigin origin;
  const absl::Status stream = dispatcher_->OpenStream(origin, "test", "Test/Stream");
  EXPECT_EQ(stream.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(stream.message()), ::testing::HasSubstr("takes no new streams"));

  // Until StopSequenceSteps(), a unary call is still counted open (it may
  // continue a sequence), and refused at its admission when it does not.
  ASSERT_TRUE(dispatcher_->OpenCall("requests").ok());
  Answer late;
  Submit(origin, &late);
  EXPECT_EQ(Wait(late).code(), absl::StatusCode::kUnavailable);
  dispatcher_->CloseCall();
  dispatcher_->StopSequenceSteps();
  const absl::Status refused = dispatcher_->OpenCall("requests");
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("takes no new requests"));

  // The call opened before StopAccepting keeps the drain waiting until closed.
  EXPECT_FALSE(dispatcher_->WaitForIdle(absl::Now() + absl::Milliseconds(50)));
  dispatcher_->CloseCall();
  EXPECT_TRUE(dispatcher_->WaitForIdle(absl::Now() + absl::Seconds(10)));
}


TEST_F(DispatcherTest, StepsGoThroughTheBatcherAndEqualCausalAttendOnThePrefix) {
  Start();
  KvBlockPool pool(1 << 20);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open(std::make_shared<const Model>(DotProductModel()), pool, {});
  ASSERT_TRUE(session.ok()) << session.status();
  FakeOrigin origin;
  const std::vector<float> prompt = {1.0f, 0.0f}, token = {0.0f, 1.0f};
  Answer first, second, request;
  SubmitStep(origin, &first, **session, prompt);
  ASSERT_TRUE(Wait(first).ok()) << first.status;
  // A step and a plain request of the same model, answered side by side.
  SubmitStep(origin, &second, **session, token);
  Submit(origin, &request);
  ASSERT_TRUE(Wait(second).ok()) << second.status;
  ASSERT_TRUE(Wait(request).ok()) << request.status;
  EXPECT_EQ((*session)->length(), 2);
  // The token attends to the prompt and itself, as Attend's last causal row.
  EXPECT_THAT(second.output, ::testing::Pointwise(::testing::FloatNear(1e-5f),
                                                  {request.output[2], request.output[3]}));
}

TEST_F(DispatcherTest, StepsOfOpenSessionsAreAdmittedWhileDrainingAndRefusedOnesNeverDecoded) {
  Start({"secret"});
  KvBlockPool pool(1 << 20);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open(std::make_shared<const Model>(DotProductModel()), pool, {});
  ASSERT_TRUE(session.ok()) << session.status();
  const std::vector<float> row = {1.0f, 0.0f};
  int decoded = 0;
  FakeOrigin stranger("wrong");
  Answer refused;
  SubmitStep(stranger, &refused, **session, row, false, &decoded);
  EXPECT_EQ(Wait(refused).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(decoded, 0);

  dispatcher_->StopAccepting();
  FakeOrigin client("secret");
  Answer new_call, stream_step;
  SubmitStep(client, &new_call, **session, row, false, &decoded);
  EXPECT_EQ(Wait(new_call).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(decoded, 0);
  SubmitStep(client, &stream_step, **session, row, /*continues_session=*/true, &decoded);
  EXPECT_TRUE(Wait(stream_step).ok()) << stream_step.status;
  EXPECT_EQ(decoded, 1);
  EXPECT_EQ((*session)->length(), 1);
}

}  // namespace
}  // namespace attention::server
