// server_conformance_test.cc: the conformance data through a real
// attention-server: every case (cases/ and layers/cases/) via Attend and via
// one AttendStream, the causal layer cases as AttendSession steps, positions
// that change a layer's answer, every errors.json entry gets its code, plus
// ListModels (with the layers' heads, rotary and window as their files'
// configs say), health and reflection.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
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
  if (c.request.return_attention_weights()) {
    ExpectTensorNear(response.attention_weights(), c.expected["attention_weights"], c,
                     "attention_weights");
  } else {
    EXPECT_FALSE(response.has_attention_weights()) << c.name;
  }
  EXPECT_EQ(response.request_id(), c.request.request_id());
  EXPECT_EQ(response.model(), c.request.model());
}

// The cases of cases/ and of layers/cases/, whose models the server's
// repository holds side by side.
std::vector<Case> AllCases() {
  std::vector<Case> cases = LoadConformanceCases();
  std::vector<Case> layers = LoadLayerCases();
  EXPECT_THAT(layers, Not(IsEmpty()));
  cases.insert(cases.end(), layers.begin(), layers.end());
  return cases;
}

// The `__metadata__` of a safetensors file: its header's, as JSON.
nlohmann::json FileMetadata(const std::filesystem::path& path) {
  const std::string bytes = ReadFile(path);
  uint64_t length = 0;
  if (bytes.size() < sizeof(length)) return nlohmann::json();
  std::memcpy(&length, bytes.data(), sizeof(length));
  if (bytes.size() < sizeof(length) + length) return nlohmann::json();
  return nlohmann::json::parse(bytes.substr(sizeof(length), length))["__metadata__"];
}

// config[key] when it is a number; `fallback` when it is absent or null, as
// Hugging Face reads a config.
template <typename T>
T NumberOr(const nlohmann::json& config, const char* key, T fallback) {
  const auto it = config.find(key);
  return it != config.end() && it->is_number() ? it->get<T>() : fallback;
}

class ServerConformanceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto started =
        ServerProcess::Start({"--model-repository", ConformanceRepository().string(), "--strict"});
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
  const std::vector<Case> cases = AllCases();
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
  const std::vector<Case> cases = AllCases();
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

// The causal layer cases whose examples are whole and whose positions are
// 0, 1, ... as a self session over AttendSession: a prefill, then one step
// per row; every step's rows are the case's (a session turns each token at
// its place in the session).
TEST_F(ServerConformanceTest, CausalLayerCasesThroughAttendSession) {
  auto stub = server_->Stub();
  int replayed = 0;
  for (const Case& c : LoadLayerCases()) {
    const v1::AttendRequest& request = c.request;
    if (!request.causal() || !request.valid_lens().empty() || !request.position_ids().empty()) {
      continue;
    }
    const int64_t batch = request.queries().shape(0), n = request.queries().shape(1);
    const int64_t width = request.queries().shape(2);
    const std::vector<double> want = c.expected["output"]["data"].get<std::vector<double>>();
    const int64_t out_width = c.expected["output"]["shape"][2].get<int64_t>();
    grpc::ClientContext context;
    auto stream = stub->AttendSession(&context);
    v1::SessionRequest open;
    open.mutable_open()->set_model(request.model());
    open.mutable_open()->set_batch(batch);
    v1::SessionResponse answer;
    ASSERT_TRUE(stream->Write(open) && stream->Read(&answer)) << c.name;
    ASSERT_FALSE(answer.has_error()) << c.name << ": " << answer.error().message();
    const int64_t prefill = std::min<int64_t>(3, n);
    for (int64_t begin = 0; begin < n;) {
      const int64_t rows = begin == 0 ? prefill : 1;
      v1::SessionRequest step;
      v1::Tensor* queries = step.mutable_step()->mutable_queries();
      for (int64_t size : {batch, rows, width}) queries->add_shape(size);
      for (int64_t b = 0; b < batch; ++b) {
        const auto first = request.queries().data().begin() + (b * n + begin) * width;
        queries->mutable_data()->Add(first, first + rows * width);
      }
      ASSERT_TRUE(stream->Write(step) && stream->Read(&answer)) << c.name;
      ASSERT_FALSE(answer.has_error()) << c.name << ": " << answer.error().message();
      EXPECT_EQ(answer.length(), begin + rows) << c.name;
      ASSERT_EQ(answer.output().data_size(), batch * rows * out_width) << c.name;
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < rows * out_width; ++i) {
          const double expected = want[(b * n + begin) * out_width + i];
          ASSERT_LE(std::abs(answer.output().data(b * rows * out_width + i) - expected),
                    c.atol + c.rtol * std::abs(expected))
              << c.name << " example " << b << " row " << begin + i / out_width;
        }
      }
      begin += rows;
    }
    ASSERT_TRUE(stream->WritesDone());
    EXPECT_TRUE(stream->Finish().ok()) << c.name;
    ++replayed;
  }
  EXPECT_GT(replayed, 0);
}

// The positions reach the engine: a layer case with positions whose
// distances differ from 0, 1, 2, ... answers otherwise than without them
// (the cases' own positions are shifts, which rotary does not see).
TEST_F(ServerConformanceTest, PositionIdsChangeTheAnswer) {
  auto stub = server_->Stub();
  for (const PositionsCase& positions : RotaryPositionsCases(*stub)) {
    const Case& c = positions.c;
    for (bool per_query : {true, false}) {
      v1::AttendResponse with;
      const grpc::Status status = AttendWithin(*stub, std::chrono::seconds(60),
                                               WithSpreadPositions(c.request, per_query), &with);
      ASSERT_TRUE(status.ok()) << c.name << ": " << status.error_message();
      const double largest =
          LargestDifference(with.output().data(), positions.without.output().data());
      EXPECT_GT(largest, 1e-3) << c.name << (per_query ? " (B*n_q)" : " (n_q)");
      EXPECT_LT(largest, 1e30) << c.name << ": the answers' sizes differ";
    }
  }
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
  const std::vector<Case> cases = AllCases();
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
  for (const auto& entry : std::filesystem::directory_iterator(ConformanceRepository())) {
    EXPECT_THAT(names, Contains(entry.path().stem().string()));
  }
  for (const v1::ModelInfo& model : response.models()) {
    if (model.kind() == "multi_head") {
      EXPECT_GT(model.num_heads(), 0) << model.name();
      EXPECT_GT(model.output_size(), 0) << model.name();
      EXPECT_GT(model.num_kv_heads(), 0) << model.name();
      EXPECT_EQ(model.num_heads() % model.num_kv_heads(), 0) << model.name();
      EXPECT_GT(model.head_dim(), 0) << model.name();
    } else {
      EXPECT_EQ(model.num_kv_heads(), 0) << model.name();
      EXPECT_EQ(model.rope_type(), "") << model.name();
    }
  }
}

// Each layer file's ModelInfo says what its config.json says: heads, kv
// heads, head_dim, rotary (or ALiBi) and, where the config has them, a
// window and a soft-cap.
TEST_F(ServerConformanceTest, ListModelsDescribesEachLayerAsItsConfigDoes) {
  auto stub = server_->Stub();
  grpc::ClientContext context;
  v1::ListModelsResponse response;
  ASSERT_TRUE(stub->ListModels(&context, v1::ListModelsRequest(), &response).ok());
  std::map<std::string, v1::ModelInfo> infos;
  for (const v1::ModelInfo& model : response.models()) infos[model.name()] = model;
  int described = 0, windowed = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(ConformanceDir() / "layers" / "models")) {
    const std::string name = entry.path().stem().string();
    ASSERT_TRUE(infos.contains(name)) << name;
    const v1::ModelInfo& info = infos[name];
    const nlohmann::json metadata = FileMetadata(entry.path());
    ASSERT_TRUE(metadata.is_object()) << name;
    const nlohmann::json config = nlohmann::json::parse(metadata["config"].get<std::string>());
    const int64_t heads = config["num_attention_heads"];
    EXPECT_EQ(info.kind(), "multi_head") << name;
    EXPECT_EQ(info.num_heads(), heads) << name;
    EXPECT_EQ(info.num_kv_heads(), NumberOr(config, "num_key_value_heads", heads)) << name;
    EXPECT_EQ(info.head_dim(),
              NumberOr(config, "head_dim", config["hidden_size"].get<int64_t>() / heads))
        << name;
    const bool alibi = metadata.value("alibi", "") == "true";
    EXPECT_EQ(info.alibi(), alibi) << name;
    if (alibi) {
      EXPECT_EQ(info.rope_type(), "") << name;
    } else {
      const nlohmann::json rope = config.value("rope_scaling", nlohmann::json::object());
      const nlohmann::json scaling = rope.is_object() ? rope : nlohmann::json::object();
      EXPECT_EQ(info.rope_type(), scaling.value("rope_type", scaling.value("type", "default")))
          << name;
      EXPECT_EQ(info.rope_theta(), NumberOr(config, "rope_theta", 10000.0)) << name;
      EXPECT_EQ(info.rope_interleaved(), metadata.value("rope_interleaved", "") == "true") << name;
      EXPECT_EQ(info.rotary_dim(),
                static_cast<int64_t>(static_cast<double>(info.head_dim()) *
                                     NumberOr(config, "partial_rotary_factor", 1.0)))
          << name;
    }
    // Whether this layer slides depends on its index (docs/api.md 5.6); a
    // window it reports is the config's.
    if (info.sliding_window() != 0) {
      EXPECT_EQ(info.sliding_window(), NumberOr<int64_t>(config, "sliding_window", 0)) << name;
    }
    EXPECT_EQ(info.softcap(), NumberOr(config, "attn_logit_softcapping", 0.0f)) << name;
    windowed += info.sliding_window() != 0;
    ++described;
  }
  EXPECT_GT(described, 0);
  EXPECT_GT(windowed, 0) << "no layer reports its window";
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
