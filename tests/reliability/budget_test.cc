// budget_test.cc: the per-request work and scratch budgets (docs/api.md,
// section 6.2). Valid but enormous requests are refused at validation, before
// any engine time or scratch is spent: `dot_product` with queries [1,60000,1]
// (240 KB on the wire) would hold the engine about 2.8 s past its own
// deadline, and values [1,1,8000000] would raise the server's RSS to 2.2 GB
// and keep it.
#include <signal.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/model/model.h"
#include "core/engine/request.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

Tensor Filled(std::vector<int64_t> shape) {
  int64_t size = 1;
  for (int64_t d : shape) size *= d;
  return {std::move(shape), std::vector<float>(size, 0.25f)};
}

TEST(RequestWorkTest, DotProductCostsScoresTimesFeatureSizesPlusSoftmax) {
  AttentionDims dims;
  dims.batch = 2;
  dims.num_queries = 3;
  dims.num_keys = 5;
  dims.query_size = dims.key_size = 4;
  dims.value_size = dims.output_size = 6;
  EXPECT_DOUBLE_EQ(RequestWork(DotProductModel(), dims), 2.0 * 3 * 5 * (4 + 6 + kSoftmaxWork));
  EXPECT_DOUBLE_EQ(RequestScratch(dims), 64.0 * (4 + 4 + 6 + 6));
}

TEST(RequestWorkTest, RefusedAboveTheBudgetNamingTheNumbersAndTheLimit) {
  const Tensor queries = Filled({1, 10, 4});  // self-attention: 100 scores x (4 + 4 + 16)
  AttentionRequest request{.queries = queries.view()};
  const double work = 100 * (4 + 4 + kSoftmaxWork);

  Limits exact;
  exact.max_request_work = static_cast<int64_t>(work);
  EXPECT_TRUE(Validate(DotProductModel(), request, exact).ok());

  Limits below = exact;
  below.max_request_work = static_cast<int64_t>(work) - 1;
  absl::StatusOr<AttentionDims> refused = Validate(DotProductModel(), request, below);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              AllOf(HasSubstr("at most 2399 work units"), HasSubstr("got 2400"),
                    HasSubstr("n_q=10 n_k=10 d_k=4 d_v=4"), HasSubstr("dot_product")));

  Limits off = below;
  off.max_request_work = 0;
  EXPECT_TRUE(Validate(DotProductModel(), request, off).ok());
}

TEST(RequestWorkTest, DefaultBudgetRefusesTheFreezingRequest) {
  const Tensor queries = Filled({1, 60000, 1});
  AttentionRequest request{.queries = queries.view()};
  absl::StatusOr<AttentionDims> refused = Validate(DotProductModel(), request);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("work units"));
}

TEST(RequestWorkTest, DefaultScratchBudgetRefusesVeryWideValues) {
  const Tensor one = Filled({1, 1, 1});
  const Tensor values = Filled({1, 1, 70000});
  AttentionRequest request{.queries = one.view(), .keys = one.view(), .values = values.view()};
  absl::StatusOr<AttentionDims> refused = Validate(DotProductModel(), request);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              AllOf(HasSubstr("floats of engine scratch"), HasSubstr("d_v=70000")));
}

void AddTensor(v1::Tensor* tensor, std::vector<int64_t> shape) {
  int64_t size = 1;
  for (int64_t d : shape) {
    tensor->add_shape(d);
    size *= d;
  }
  tensor->mutable_data()->Resize(static_cast<int>(size), 0.25f);
}

v1::AttendRequest Small() {
  v1::AttendRequest request;
  request.set_model("dot_product");
  AddTensor(request.mutable_queries(), {1, 4, 8});
  return request;
}

TEST(ServerBudgetTest, FreezingRequestIsRefusedAtOnceAndOthersGoOn) {
  auto server = ServerProcess::Start({"--threads", "1"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  v1::AttendRequest freezing;
  freezing.set_model("dot_product");
  AddTensor(freezing.mutable_queries(), {1, 60000, 1});

  const auto start = std::chrono::steady_clock::now();
  const grpc::Status refused = AttendWithin(*stub, std::chrono::seconds(60), freezing);
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_THAT(refused.error_message(),
              AllOf(HasSubstr("at most 17179869184 work units"), HasSubstr("n_q=60000")));
  // Computed, it held the engine for seconds.
  EXPECT_LT(took, std::chrono::milliseconds(500));
  EXPECT_TRUE(AttendWithin(*stub, std::chrono::seconds(60), Small()).ok());
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

TEST(ServerBudgetTest, ScratchBlowUpIsRefusedWithoutTheMemory) {
  auto server = ServerProcess::Start({"--threads", "1"});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  v1::AttendRequest wide;  // a 32 MB message
  wide.set_model("dot_product");
  AddTensor(wide.mutable_queries(), {1, 1, 1});
  AddTensor(wide.mutable_keys(), {1, 1, 1});
  AddTensor(wide.mutable_values(), {1, 1, 8000000});

  const grpc::Status refused = AttendWithin(*stub, std::chrono::seconds(60), wide);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
  EXPECT_THAT(refused.error_message(), HasSubstr("floats of engine scratch"));
  // The message itself (wire bytes and parsed floats) costs about 100 MB;
  // computed, the request took the server to 2.2 GB.
  const int64_t peak = PeakResidentBytes((*server)->pid());
  EXPECT_GT(peak, 0);
  if (!kSanitizedBuild) {
    EXPECT_LT(peak, int64_t{512} << 20) << "peak RSS " << peak / (1 << 20) << " MiB";
  }
  EXPECT_TRUE(AttendWithin(*stub, std::chrono::seconds(60), Small()).ok());
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
}

TEST(ServerBudgetTest, BudgetsAreSetByFlagOrEnvironment) {
  auto server = ServerProcess::Start({"--max-request-scratch-elements", "1000"},
                                     {{"ATTENTION_MAX_REQUEST_WORK", "100"}});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->Stub();
  v1::AttendRequest request = Small();  // 16 scores x (8 + 8 + 16) = 512
  grpc::Status refused = AttendWithin(*stub, std::chrono::seconds(60), request);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), AllOf(HasSubstr("at most 100 work units"),
                                             HasSubstr("got 512")));
  stub.reset();
  EXPECT_EQ((*server)->Stop(), 0);
  EXPECT_THAT((*server)->Log(), HasSubstr("--max-request-work 100 --max-request-scratch-elements 1000"));

  auto wide = ServerProcess::Start({"--max-request-scratch-elements", "1000"});
  ASSERT_TRUE(wide.ok()) << wide.status();
  stub = (*wide)->Stub();
  refused = AttendWithin(*stub, std::chrono::seconds(60), request);  // 64 x (8 + 8 + 8 + 8) = 2048 floats
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.error_message(), AllOf(HasSubstr("at most 1000 floats of engine scratch"),
                                             HasSubstr("got 2048")));
  stub.reset();
  EXPECT_EQ((*wide)->Stop(), 0);
}

}  // namespace
}  // namespace attention::testing
