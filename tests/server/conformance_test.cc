// server_conformance_test.cc: the conformance data through a real
// attention-server: every case via Attend and via one AttendStream, every
// errors.json entry gets its code, plus ListModels, health and reflection.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "google/protobuf/util/json_util.h"
#include "reflection.grpc.pb.h"
#include "health.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/support/conformance_cases.h"
#include "tests/support/files.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

using ::testing::Contains;
using ::testing::IsEmpty;
using ::testing::Not;

using Case = ConformanceCase;

// Shape equal, every element within atol + rtol * |expected|.
void ExpectTensorNear(const v1::Tensor& actual, const nlohmann::json& expected, const Case& c,
                      const char* what) {
  const std::vector<int64_t> shape(actual.shape().begin(), actual.shape().end());
  ASSERT_EQ(shape, expected["shape"].get<std::vector<int64_t>>()) << c.name << " " << what;
  const std::vector<double> want = expected["data"].get<std::vector<double>>();
  ASSERT_EQ(actual.data_size(), static_cast<int>(want.size())) << c.name << " " << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_LE(std::abs(actual.data(i) - want[i]), c.atol + c.rtol * std::abs(want[i]))
        << c.name << " " << what << "[" << i << "]";
  }
}

void ExpectMatchesCase(const v1::AttendResponse& response, const Case& c) {
  ExpectTensorNear(response.output(), c.expected["output"], c, "output");
  ExpectTensorNear(response.attention_weights(), c.expected["attention_weights"], c,
                   "attention_weights");
  EXPECT_EQ(response.request_id(), c.request.request_id());
  EXPECT_EQ(response.model(), c.request.model());
}

class ServerConformanceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto started = ServerProcess::Start(
        {"--model-repository", (ConformanceDir() / "models").string(), "--strict"});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = started->release();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) {
      EXPECT_EQ(server_->Stop(), 0) << server_->Log();
    }
    delete server_;
    server_ = nullptr;
  }

  static ServerProcess* server_;
};

ServerProcess* ServerConformanceTest::server_ = nullptr;

TEST_F(ServerConformanceTest, EveryCaseThroughAttend) {
  const std::vector<Case> cases = LoadConformanceCases();
  ASSERT_THAT(cases, Not(IsEmpty()));
  auto stub = server_->Stub();
  for (const Case& c : cases) {
    grpc::ClientContext context;
    v1::AttendResponse response;
    const grpc::Status status = stub->Attend(&context, c.request, &response);
    ASSERT_TRUE(status.ok()) << c.name << ": " << CodeName(status.error_code()) << " "
                             << status.error_message();
    ExpectMatchesCase(response, c);
  }
}

TEST_F(ServerConformanceTest, EveryCaseThroughOneStreamInOrder) {
  const std::vector<Case> cases = LoadConformanceCases();
  auto stub = server_->Stub();
  grpc::ClientContext context;
  auto stream = stub->AttendStream(&context);
  for (const Case& c : cases) {
    ASSERT_TRUE(stream->Write(c.request));
  }
  ASSERT_TRUE(stream->WritesDone());
  for (const Case& c : cases) {
    v1::AttendResponse response;
    ASSERT_TRUE(stream->Read(&response)) << "no answer for " << c.name;
    ASSERT_FALSE(response.has_error()) << c.name << ": " << response.error().message();
    ExpectMatchesCase(response, c);
  }
  v1::AttendResponse extra;
  EXPECT_FALSE(stream->Read(&extra));
  const grpc::Status status = stream->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
}

TEST_F(ServerConformanceTest, EveryErrorsEntryGetsItsCode) {
  const nlohmann::json errors = ReadJson(ConformanceDir() / "errors.json");
  ASSERT_FALSE(errors.empty());
  auto stub = server_->Stub();
  for (const nlohmann::json& entry : errors) {
    const std::string name = entry["name"];
    grpc::ClientContext context;
    v1::AttendResponse response;
    const grpc::Status status = stub->Attend(&context, ParseRequest(entry["request"]), &response);
    EXPECT_EQ(CodeName(status.error_code()), entry["expected_code"].get<std::string>())
        << name << ": " << status.error_message();
    EXPECT_FALSE(status.error_message().empty()) << name;
  }
}

TEST_F(ServerConformanceTest, ErrorsInsideAStreamAreAnsweredAndTheStreamGoesOn) {
  const nlohmann::json errors = ReadJson(ConformanceDir() / "errors.json");
  const std::vector<Case> cases = LoadConformanceCases();
  auto stub = server_->Stub();
  grpc::ClientContext context;
  auto stream = stub->AttendStream(&context);
  // good, bad, good, bad, ...: each bad one gets its own code, in place.
  for (size_t i = 0; i < errors.size(); ++i) {
    ASSERT_TRUE(stream->Write(cases[i % cases.size()].request));
    v1::AttendRequest bad = ParseRequest(errors[i]["request"]);
    bad.set_request_id(errors[i]["name"]);
    ASSERT_TRUE(stream->Write(bad));
  }
  ASSERT_TRUE(stream->WritesDone());
  for (size_t i = 0; i < errors.size(); ++i) {
    v1::AttendResponse good;
    ASSERT_TRUE(stream->Read(&good));
    EXPECT_FALSE(good.has_error()) << good.error().message();
    ExpectMatchesCase(good, cases[i % cases.size()]);
    v1::AttendResponse bad;
    ASSERT_TRUE(stream->Read(&bad));
    const std::string name = errors[i]["name"];
    EXPECT_EQ(bad.request_id(), name);
    ASSERT_TRUE(bad.has_error()) << name;
    EXPECT_EQ(CodeName(static_cast<grpc::StatusCode>(bad.error().code())),
              errors[i]["expected_code"].get<std::string>())
        << name << ": " << bad.error().message();
    EXPECT_FALSE(bad.error().message().empty());
    EXPECT_EQ(bad.output().data_size(), 0);
  }
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServerConformanceTest, ListModelsHasBuiltInsAndEveryRepositoryFile) {
  auto stub = server_->Stub();
  grpc::ClientContext context;
  v1::ListModelsResponse response;
  ASSERT_TRUE(stub->ListModels(&context, v1::ListModelsRequest(), &response).ok());
  std::vector<std::string> names;
  for (const v1::ModelInfo& model : response.models()) names.push_back(model.name());
  EXPECT_THAT(names, Contains("dot_product"));
  EXPECT_THAT(names, Contains("distance"));
  for (const auto& entry : std::filesystem::directory_iterator(ConformanceDir() / "models")) {
    EXPECT_THAT(names, Contains(entry.path().stem().string()));
  }
  for (const v1::ModelInfo& model : response.models()) {
    if (model.kind() == "multi_head") {
      EXPECT_GT(model.num_heads(), 0) << model.name();
      EXPECT_GT(model.output_size(), 0) << model.name();
    }
  }
}

TEST_F(ServerConformanceTest, HealthIsServing) {
  auto health = grpc::health::v1::Health::NewStub(server_->Channel());
  for (const std::string service :
       {"", "attention.v1.AttentionService", "inference.GRPCInferenceService"}) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    ASSERT_TRUE(health->Check(&context, request, &response).ok()) << service;
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
}

TEST_F(ServerConformanceTest, ReflectionListsTheService) {
  auto reflection = grpc::reflection::v1alpha::ServerReflection::NewStub(server_->Channel());
  grpc::ClientContext context;
  auto stream = reflection->ServerReflectionInfo(&context);
  grpc::reflection::v1alpha::ServerReflectionRequest request;
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->WritesDone());
  grpc::reflection::v1alpha::ServerReflectionResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> services;
  for (const auto& service : response.list_services_response().service()) {
    services.push_back(service.name());
  }
  EXPECT_THAT(services, Contains("attention.v1.AttentionService"));
  EXPECT_THAT(services, Contains("grpc.health.v1.Health"));
  EXPECT_TRUE(stream->Finish().ok());
}

}  // namespace
}  // namespace attention::testing
