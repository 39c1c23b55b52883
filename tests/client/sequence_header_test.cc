// client_sequence_header_test.cc: AttentionClient::InferAsync sends the
// routing header `attention-sequence-id` (docs/api.md section 11.3) with the
// sequence id of a request that has one, and no such header otherwise.
//
// The real server ignores the header, so a fake GRPCInferenceService in this
// process (127.0.0.1, port picked by the system) records what each call
// carried.
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include "absl/synchronization/notification.h"
#include "client/cpp/attention_client.h"
#include "inference/grpc_service.grpc.pb.h"

namespace attention::client {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;

// Records the routing header of the last ModelInfer call (nullopt: none).
class RecordingService final : public inference::GRPCInferenceService::Service {
 public:
  grpc::Status ModelInfer(grpc::ServerContext* context, const ModelInferRequest* request,
                          ModelInferResponse* response) override {
    const auto found = context->client_metadata().find("attention-sequence-id");
    std::lock_guard<std::mutex> lock(mu_);
    header_ = found == context->client_metadata().end()
                  ? std::nullopt
                  : std::optional<std::string>(std::string(found->second.data(),
                                                           found->second.size()));
    response->set_model_name(request->model_name());
    return grpc::Status::OK;
  }

  std::optional<std::string> header() {
    std::lock_guard<std::mutex> lock(mu_);
    return header_;
  }

 private:
  std::mutex mu_;
  std::optional<std::string> header_;
};

class ClientSequenceHeaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions options;
    options.target = "127.0.0.1:" + std::to_string(port);
    absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  void TearDown() override {
    client_.reset();
    server_->Shutdown();
  }

  // The header the service saw for one ModelInfer call of `request`.
  std::optional<std::string> HeaderOf(const ModelInferRequest& request) {
    absl::Notification done;
    client_->InferAsync(&request, [&](absl::StatusOr<ModelInferResponse> response) {
      EXPECT_TRUE(response.ok()) << response.status();
      done.Notify();
    });
    done.WaitForNotification();
    return service_.header();
  }

  RecordingService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<AttentionClient> client_;
};

ModelInferRequest Step() {
  ModelInferRequest request;
  request.set_model_name("mh_torch_small");
  return request;
}

TEST_F(ClientSequenceHeaderTest, Int64SequenceIdIsSentInDecimal) {
  ModelInferRequest request = Step();
  (*request.mutable_parameters())["sequence_id"].set_int64_param(-42);
  (*request.mutable_parameters())["sequence_start"].set_bool_param(true);
  EXPECT_EQ(HeaderOf(request), "-42");
  (*request.mutable_parameters())["sequence_id"].set_int64_param(9007199254740993);
  EXPECT_EQ(HeaderOf(request), "9007199254740993");
}

TEST_F(ClientSequenceHeaderTest, Uint64SequenceIdIsSentInDecimal) {
  ModelInferRequest request = Step();
  (*request.mutable_parameters())["sequence_id"].set_uint64_param(18446744073709551615u);
  EXPECT_EQ(HeaderOf(request), "18446744073709551615");
}

TEST_F(ClientSequenceHeaderTest, StringSequenceIdIsSentAsItIs) {
  ModelInferRequest request = Step();
  (*request.mutable_parameters())["sequence_id"].set_string_param("chat-7");
  EXPECT_EQ(HeaderOf(request), "chat-7");
}

TEST_F(ClientSequenceHeaderTest, NoSequenceMeansNoHeader) {
  ModelInferRequest request = Step();
  EXPECT_EQ(HeaderOf(request), std::nullopt);
  (*request.mutable_parameters())["scale"].set_double_param(0.5);
  EXPECT_EQ(HeaderOf(request), std::nullopt);
  // 0 and "" name no sequence (docs/api.md section 11.3).
  (*request.mutable_parameters())["sequence_id"].set_int64_param(0);
  EXPECT_EQ(HeaderOf(request), std::nullopt);
  (*request.mutable_parameters())["sequence_id"].set_string_param("");
  EXPECT_EQ(HeaderOf(request), std::nullopt);
  // Not a valid header value: the call goes without it rather than failing.
  (*request.mutable_parameters())["sequence_id"].set_string_param("caf\xc3\xa9");
  EXPECT_EQ(HeaderOf(request), std::nullopt);
}

}  // namespace
}  // namespace attention::client
