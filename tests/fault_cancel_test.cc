// fault_cancel_test.cc: clients that give up. Calls cancelled while their
// requests wait in the queue, and streams cancelled after reading part of
// their answers, next to calls and streams that go on: the others get every
// answer right, the cancelled requests are never computed, and the server
// ends with nothing in flight, still SERVING, and exits 0.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/fault_util.h"
#include "tests/server_test_util.h"

namespace attention::testing {
namespace {

constexpr int kCalls = 48;
constexpr int kStreams = 12;
constexpr int kRequestsPerStream = 8;

class FaultCancelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The slow request ([1, 8192, 128]) is over the default work budget.
    auto started = ServerProcess::Start({"--max-batch-size", "4", "--max-queue-delay-us", "0",
                                         "--threads", "1", "--queue-capacity", "256",
                                         "--max-request-work", "0"});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    stub_ = v1::AttentionService::NewStub(
        grpc::CreateCustomChannel(server_->address(), grpc::InsecureChannelCredentials(), args));
  }
  void TearDown() override {
    if (server_) {
      EXPECT_EQ(server_->Stop(), 0) << server_->Log();
    }
  }

  std::string Metrics() { return ScrapeMetrics(server_->metrics_address()); }
  double Metric(const std::string& text, const std::string& name,
                const std::map<std::string, std::string>& labels = {}) {
    return MetricValue(text, name, labels);
  }
  bool WaitForMetrics(const std::function<bool(const std::string&)>& done) {
    return attention::testing::WaitForMetrics(server_->metrics_address(), done);
  }
  // Batches started so far (each is observed before it computes).
  double Batches(const std::string& text) {
    return Metric(text, "attention_batch_size_count", {{"model", "dot_product"}});
  }
  double Computed(const std::string& text) {
    return Metric(text, "attention_batch_size_sum", {{"model", "dot_product"}});
  }
  bool WaitForIdle() {
    return WaitForMetrics([this](const std::string& m) {
      return Metric(m, "attention_inflight_requests") == 0 &&
             Metric(m, "attention_queue_depth", {{"model", "dot_product"}}) == 0;
    });
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

struct AsyncCall {
  grpc::ClientContext context;
  v1::AttendRequest request;
  v1::AttendResponse response;
  grpc::Status status;
  bool done = false;
};

TEST_F(FaultCancelTest, CallsCancelledInTheQueueAreNeverComputedAndTheRestAreRight) {
  std::mutex mu;
  std::condition_variable changed;
  int pending = 0;
  const auto start = [&](AsyncCall& call) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++pending;
    }
    stub_->async()->Attend(&call.context, &call.request, &call.response,
                           [&](grpc::Status status) {
                             std::lock_guard<std::mutex> lock(mu);
                             call.status = std::move(status);
                             call.done = true;
                             --pending;
                             changed.notify_all();
                           });
  };

  // A slow request occupies the one engine thread; the calls queue behind it.
  const double batches_before = Batches(Metrics());
  AsyncCall slow;
  slow.request = DotProductRequest(1, 8192, 128, -1);
  start(slow);
  ASSERT_TRUE(WaitForMetrics([&](const std::string& m) { return Batches(m) == batches_before + 1; }));

  std::vector<std::unique_ptr<AsyncCall>> calls;
  for (int i = 0; i < kCalls; ++i) {
    calls.push_back(std::make_unique<AsyncCall>());
    calls.back()->request = DotProductRequest(1, 16, 8, i);
    start(*calls.back());
  }
  ASSERT_TRUE(WaitForMetrics([&](const std::string& m) {
    return Metric(m, "attention_queue_depth", {{"model", "dot_product"}}) == kCalls;
  }));
  const double computed_before = Computed(Metrics());
  // Every other call gives up while the slow request still computes.
  for (int i = 0; i < kCalls; i += 2) calls[i]->context.TryCancel();
  {
    std::unique_lock<std::mutex> lock(mu);
    changed.wait(lock, [&] { return pending == 0; });
  }

  ASSERT_TRUE(slow.status.ok()) << slow.status.error_message();
  EXPECT_EQ(CheckAnswer(slow.request, slow.response), "");
  for (int i = 0; i < kCalls; ++i) {
    const AsyncCall& call = *calls[i];
    if (i % 2 == 0) {
      EXPECT_EQ(call.status.error_code(), grpc::StatusCode::CANCELLED) << "call " << i;
    } else {
      ASSERT_TRUE(call.status.ok()) << "call " << i << ": " << call.status.error_message();
      EXPECT_EQ(CheckAnswer(call.request, call.response), "") << "call " << i;
    }
  }
  ASSERT_TRUE(WaitForIdle()) << server_->Log();
  const std::string metrics = Metrics();
  // The slow request was counted when its batch started, before the cancels.
  EXPECT_EQ(Computed(metrics) - computed_before, kCalls / 2)
      << "requests of cancelled calls were computed";
  EXPECT_EQ(Metric(metrics, "attention_requests_total", {{"code", "CANCELLED"}}), kCalls / 2);
  EXPECT_EQ(Metric(metrics, "attention_requests_total", {{"code", "OK"}}), kCalls / 2 + 1);
  EXPECT_EQ(HealthStatus(server_->Channel()), "SERVING");
}

TEST_F(FaultCancelTest, StreamsCancelledMidwayLeaveTheOthersWhole) {
  struct Stream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::AttendRequest, v1::AttendResponse>> rw;
    std::vector<v1::AttendRequest> requests;
    int answers_wanted = 0;  // kRequestsPerStream: read everything, then half-close
  };
  // A slow request first, so the streams' requests wait in the queue and the
  // streams that read nothing cancel them there.
  const double batches_before = Batches(Metrics());
  grpc::Status slow_status;
  std::thread slow([&] {
    grpc::ClientContext context;
    v1::AttendResponse response;
    slow_status = stub_->Attend(&context, DotProductRequest(1, 8192, 128, -1), &response);
  });
  ASSERT_TRUE(WaitForMetrics([&](const std::string& m) { return Batches(m) == batches_before + 1; }));

  std::vector<std::unique_ptr<Stream>> streams;
  for (int s = 0; s < kStreams; ++s) {
    auto stream = std::make_unique<Stream>();
    // Stream s reads s % kRequestsPerStream answers before it cancels (none:
    // while all its requests are queued); those with s % 3 == 0 read all and
    // end normally.
    stream->answers_wanted = s % 3 == 0 ? kRequestsPerStream : s % kRequestsPerStream;
    stream->rw = stub_->AttendStream(&stream->context);
    for (int r = 0; r < kRequestsPerStream; ++r) {
      stream->requests.push_back(DotProductRequest(2, 64, 32, s * 100 + r));
      ASSERT_TRUE(stream->rw->Write(stream->requests.back())) << "stream " << s;
    }
    streams.push_back(std::move(stream));
  }

  std::vector<std::thread> readers;
  std::vector<std::string> failures(kStreams);
  for (int s = 0; s < kStreams; ++s) {
    readers.emplace_back([&, s] {
      Stream& stream = *streams[s];
      std::string& failure = failures[s];
      for (int r = 0; r < stream.answers_wanted; ++r) {
        v1::AttendResponse response;
        if (!stream.rw->Read(&response)) {
          failure = "stream ended after " + std::to_string(r) + " answers";
          return;
        }
        if (response.has_error()) {
          failure = "answer " + std::to_string(r) + " is an error: " + response.error().message();
          return;
        }
        // Answers come in request order.
        if (const std::string wrong = CheckAnswer(stream.requests[r], response); !wrong.empty()) {
          failure = "answer " + std::to_string(r) + ": " + wrong;
          return;
        }
      }
      grpc::StatusCode expected = grpc::StatusCode::OK;
      if (stream.answers_wanted == kRequestsPerStream) {
        stream.rw->WritesDone();
        v1::AttendResponse extra;
        if (stream.rw->Read(&extra)) failure = "an answer beyond the requests";
      } else {
        stream.context.TryCancel();
        expected = grpc::StatusCode::CANCELLED;
      }
      const grpc::Status status = stream.rw->Finish();
      if (status.error_code() != expected) {
        failure = "finished with " + CodeName(status.error_code()) + ", expected " +
                  CodeName(expected) + ": " + status.error_message();
      }
    });
  }
  for (std::thread& reader : readers) reader.join();
  slow.join();
  EXPECT_TRUE(slow_status.ok()) << slow_status.error_message();
  for (int s = 0; s < kStreams; ++s) EXPECT_EQ(failures[s], "") << "stream " << s;

  ASSERT_TRUE(WaitForIdle()) << "cancelled streams left requests behind\n" << server_->Log();
  EXPECT_EQ(HealthStatus(server_->Channel()), "SERVING");
  // A stream after all that gets all of its answers.
  grpc::ClientContext context;
  auto rw = stub_->AttendStream(&context);
  const v1::AttendRequest request = DotProductRequest(1, 8, 4, 999);
  ASSERT_TRUE(rw->Write(request));
  rw->WritesDone();
  v1::AttendResponse response;
  ASSERT_TRUE(rw->Read(&response));
  EXPECT_EQ(CheckAnswer(request, response), "");
  EXPECT_TRUE(rw->Finish().ok());
}

}  // namespace
}  // namespace attention::testing
