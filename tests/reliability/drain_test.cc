// drain_test.cc: SIGTERM loses nothing (docs/api.md, section 6.5).
//
// Under closed-loop load that goes on through the drain and past the exit,
// every call ends OK or UNAVAILABLE (retriable), never CANCELLED, over 20
// SIGTERMs; every request the server computed reached its client as OK. And
// with --drain-delay-seconds the server turns NOT_SERVING at once, serves the
// calls that still arrive for that long, then refuses new calls while an
// accepted request still completes. (The Python grpcio side: drain_python_test.py.)
#include <signal.h>
#include <sys/wait.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "health.grpc.pb.h"
#include "inference/grpc_service.grpc.pb.h"
#include "tests/support/gate.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::HasSubstr;
using HealthStatus = grpc::health::v1::HealthCheckResponse;

constexpr int kLoadThreads = 16;
constexpr int kSigterms = 20;

// A raw channel: no retries, so the test sees each call's own status.
std::shared_ptr<grpc::Channel> RawChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

v1::AttendRequest LoadRequest(std::mt19937& random, const std::string& id) {
  v1::AttendRequest request;
  request.set_model("dot_product");
  request.set_request_id(id);
  const int num_queries = 1 + static_cast<int>(random() % 32);
  v1::Tensor* queries = request.mutable_queries();
  for (int s : {1, num_queries, 32}) queries->add_shape(s);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (int i = 0; i < num_queries * 32; ++i) queries->add_data(value(random));
  return request;
}

// Request ids the server's debug log says it computed and answered OK.
std::set<std::string> ComputedIds(const std::string& log) {
  std::set<std::string> ids;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    const size_t at = line.find("request done: ");
    if (at == absl::string_view::npos) continue;
    const size_t begin = line.find("request_id='", at);
    if (begin == absl::string_view::npos) continue;
    const size_t end = line.find('\'', begin + 12);
    ids.emplace(line.substr(begin + 12, end - begin - 12));
  }
  return ids;
}

struct RunResult {
  std::map<std::string, int> codes;  // status name -> calls
  std::set<std::string> ok_ids;
  int exit_code = -1;
  std::string log;
};

RunResult SigtermUnderLoad(int run) {
  RunResult result;
  auto server = ServerProcess::Start({"--log-level", "debug", "--max-batch-size", "8"});
  if (!server.ok()) {
    ADD_FAILURE() << server.status();
    return result;
  }
  std::shared_ptr<grpc::Channel> channel = RawChannel((*server)->address());
  auto stub = v1::AttentionService::NewStub(channel);
  std::mutex mu;
  std::atomic<int> answers{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kLoadThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(run * 1000 + t);
      for (int n = 0; !stop.load(); ++n) {
        const v1::AttendRequest request = LoadRequest(random, absl::StrCat(t, "-", n));
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        v1::AttendResponse response;
        const grpc::Status status = stub->Attend(&context, request, &response);
        {
          std::lock_guard<std::mutex> lock(mu);
          ++result.codes[CodeName(status.error_code())];
          if (status.ok()) result.ok_ids.insert(request.request_id());
        }
        ++answers;
        // A client that has not noticed the drain keeps going, briefly paced.
        if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      }
    });
  }
  std::mt19937 random(run);
  const int answers_before_sigterm = 30 + static_cast<int>(random() % 270);
  while (answers.load() < answers_before_sigterm) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  (*server)->Signal(SIGTERM);
  result.exit_code = (*server)->Wait();
  // Calls after the exit must fail UNAVAILABLE too.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  stop = true;
  for (std::thread& thread : threads) thread.join();
  result.log = (*server)->Log();
  return result;
}

TEST(DrainTest, SigtermUnderClosedLoopLoadAnswersOnlyOkOrUnavailable) {
  std::map<std::string, int> total;
  for (int run = 0; run < kSigterms; ++run) {
    SCOPED_TRACE(absl::StrCat("SIGTERM ", run + 1, " of ", kSigterms));
    RunResult result = SigtermUnderLoad(run);
    for (const auto& [code, calls] : result.codes) total[code] += calls;
    EXPECT_EQ(result.exit_code, 0) << result.log;
    for (const auto& [code, calls] : result.codes) {
      EXPECT_TRUE(code == "OK" || code == "UNAVAILABLE")
          << calls << " calls ended " << code << " (only OK and UNAVAILABLE are allowed)";
    }
    EXPECT_GT(result.codes["OK"], 0);
    for (const std::string& id : ComputedIds(result.log)) {
      EXPECT_TRUE(result.ok_ids.count(id) == 1)
          << "request " << id << " was computed but its client did not get OK";
    }
  }
  std::string summary;
  for (const auto& [code, calls] : total) absl::StrAppend(&summary, code, "=", calls, " ");
  std::printf("over %d SIGTERMs: %s\n", kSigterms, summary.c_str());
}

class DrainDelayTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(gate_.ok()); }

  TestGate gate_;
};

bool Exited(pid_t pid) {
  siginfo_t info = {};
  return waitid(P_PID, pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid;
}

// Set through the environment, as the Kubernetes manifest does. NOT_SERVING
// at once; the calls that still arrive during the delay (a load balancer has
// not seen NOT_SERVING yet) are served; after it, new calls are refused
// while accepted work completes.
TEST_F(DrainDelayTest, NotServingAtOnceServingForTheDelayThenRefusing) {
  constexpr auto kDelay = std::chrono::seconds(3);
  auto server = ServerProcess::Start(gate_.Flags({"--max-batch-size", "1"}),
                                     {{"ATTENTION_DRAIN_DELAY_SECONDS", "3"}});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = RawChannel((*server)->address());
  auto stub = v1::AttentionService::NewStub(channel);
  auto health = grpc::health::v1::Health::NewStub(channel);

  v1::AttendRequest held_request = [] {
    std::mt19937 random(1);
    v1::AttendRequest request = LoadRequest(random, "held");
    request.set_model("gate");
    return request;
  }();
  std::future<grpc::Status> held = std::async(std::launch::async, [&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::AttendResponse response;
    return stub->Attend(&context, held_request, &response);
  });
  ASSERT_EQ(held.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout);

  const auto signalled = std::chrono::steady_clock::now();
  (*server)->Signal(SIGTERM);
  HealthStatus::ServingStatus seen = HealthStatus::SERVING;
  while (seen != HealthStatus::NOT_SERVING &&
         std::chrono::steady_clock::now() - signalled < std::chrono::seconds(2)) {
    grpc::ClientContext context;
    HealthStatus response;
    if (health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok()) {
      seen = response.status();
    }
  }
  EXPECT_EQ(seen, HealthStatus::NOT_SERVING);
  // Readiness too (what the edge and Kubernetes check, REST included).
  auto inference = inference::GRPCInferenceService::NewStub(channel);
  grpc::ClientContext ready_context;
  inference::ServerReadyResponse ready;
  ASSERT_TRUE(inference->ServerReady(&ready_context, {}, &ready).ok());
  EXPECT_FALSE(ready.ready());

  std::mt19937 random(2);
  auto attend = [&](const char* id) {
    grpc::ClientContext context;
    v1::AttendResponse response;
    return stub->Attend(&context, LoadRequest(random, id), &response);
  };
  ASSERT_LT(std::chrono::steady_clock::now() - signalled, kDelay);
  const grpc::Status during = attend("during the delay");
  EXPECT_TRUE(during.ok()) << during.error_message();

  // The held call keeps the server up past the delay.
  std::this_thread::sleep_until(signalled + kDelay + std::chrono::milliseconds(300));
  ASSERT_FALSE(Exited((*server)->pid())) << (*server)->Log();
  const grpc::Status refused = attend("after the delay");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("shutting down"));

  ASSERT_TRUE(gate_.Release());
  const grpc::Status held_status = held.get();
  EXPECT_TRUE(held_status.ok()) << held_status.error_message();
  EXPECT_EQ((*server)->Wait(), 0) << (*server)->Log();
  EXPECT_LT(std::chrono::steady_clock::now() - signalled, kDelay + std::chrono::seconds(10));
  EXPECT_THAT((*server)->Log(), HasSubstr("--drain-delay-seconds 3"));
}

}  // namespace
}  // namespace attention::testing
