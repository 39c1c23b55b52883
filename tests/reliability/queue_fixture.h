// queue_fixture.h: the fixture of the queue tests (overload_test,
// deadline_test, cancel_test): a server with one engine thread and one request
// per batch whose batches of the model gate wait until the test releases them
// (tests/support/gate.h), so the queue behind them stays put while the test
// acts and looks at it through /metrics.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/gate.h"
#include "tests/support/metrics.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {

class QueueTest : public ::testing::Test {
 protected:
  void Start(const std::string& queue_capacity, std::vector<std::string> more_flags = {}) {
    ASSERT_TRUE(gate_.ok()) << "mkfifo failed";
    std::vector<std::string> flags = {"--max-batch-size", "1", "--max-queue-delay-us", "0",
                                      "--threads", "1", "--queue-capacity", queue_capacity};
    flags.insert(flags.end(), more_flags.begin(), more_flags.end());
    auto started = ServerProcess::Start(gate_.Flags(flags));
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    stub_ = server_->Stub();
  }
  void TearDown() override {
    // A test that failed half-way may still hold calls at the gate.
    if (!background_.empty()) gate_.Release(static_cast<int>(background_.size()));
    for (auto& call : background_) call.join();
    if (server_) {
      EXPECT_EQ(server_->Stop(), 0) << server_->Log();
    }
  }

  // Sends `count` requests of the model gate from background threads, one
  // after the other: the first is held in the engine, the others queue behind
  // it in order. Their codes land in held_codes_ once the gate lets them
  // through. Each call is sent once the one before it has reached the server
  // (or, beyond `at_server`, without waiting: those may wait in the client).
  void SendHeld(int count, int at_server = -1) {
    if (at_server < 0) at_server = count;
    held_codes_.resize(count, grpc::StatusCode::UNKNOWN);
    for (int i = 0; i < count; ++i) {
      background_.emplace_back([this, i] {
        grpc::ClientContext context;
        v1::AttendResponse response;
        held_codes_[i] =
            stub_->Attend(&context, GateRequest(1, 2, 2, i), &response).error_code();
      });
      if (i >= at_server) continue;
      ASSERT_TRUE(WaitForMetrics([i](const std::string& m) {
        return MetricValue(m, "attention_inflight_requests") == i + 1 &&
               MetricValue(m, "attention_batch_size_count", {{"model", "gate"}}) == 1;
      })) << "held call " << i << " did not reach the server";
    }
  }

  bool WaitForMetrics(const std::function<bool(const std::string&)>& done) {
    return attention::testing::WaitForMetrics(server_->metrics_address(), done);
  }
  bool WaitForInflight(double n) {
    return WaitForMetrics(
        [n](const std::string& m) { return MetricValue(m, "attention_inflight_requests") == n; });
  }
  std::optional<double> Count(const std::string& code) {
    return MetricValue(ScrapeMetrics(server_->metrics_address()), "attention_requests_total",
                       {{"model", "gate"}, {"code", code}});
  }
  // A client's cancel reaches the server on the connection some time after
  // the client has ended the call. Frames on one connection are read in
  // order, so once a later call on the same channel has been answered the
  // server has seen every cancel sent before it.
  void AwaitCancelsSeen() {
    grpc::ClientContext context;
    v1::AttendResponse response;
    const grpc::Status status =
        stub_->Attend(&context, SelfAttentionRequest(1, 2, 2, 0), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
  void JoinHeld() {
    for (auto& call : background_) call.join();
    background_.clear();
  }
  // Two held requests ran ahead of one request that ended with `code` while
  // they were held: once released, the server answers it when it reaches it,
  // without computing it.
  void ReleaseAndExpectDroppedAfterTheHeldOnes(const std::string& code) {
    ASSERT_TRUE(gate_.Release(2));
    JoinHeld();
    EXPECT_THAT(held_codes_, ::testing::Each(grpc::StatusCode::OK));
    ASSERT_TRUE(WaitForMetrics([&code](const std::string& m) {
      return MetricValue(m, "attention_requests_total", {{"code", code}}) == 1;
    })) << server_->Log();
    const std::string metrics = ScrapeMetrics(server_->metrics_address());
    EXPECT_EQ(MetricValue(metrics, "attention_batch_size_sum", {{"model", "gate"}}), 2)
        << "the " << code << " request was computed";
    EXPECT_EQ(MetricValue(metrics, "attention_queue_depth", {{"model", "gate"}}), 0);
    EXPECT_EQ(MetricValue(metrics, "attention_inflight_requests"), 0);
    EXPECT_THAT(server_->Log(), ::testing::HasSubstr("code=" + code));
  }

  TestGate gate_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::vector<std::thread> background_;
  std::vector<grpc::StatusCode> held_codes_;
};

}  // namespace attention::testing
