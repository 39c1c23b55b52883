// unparsable_test.cc: bytes that are not the method's request message get
// INVALID_ARGUMENT naming the message type expected, on every RPC of both
// services (attention.v1 and the Open Inference Protocol); in a stream, the
// error is that request's answer and the stream goes on (docs/api.md,
// sections 3 and 9).
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attention.grpc.pb.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "inference/grpc_service.grpc.pb.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention {
namespace {

using testing::ServerProcess;

// A length-delimited field 1 that announces 100 bytes and brings 3: no
// message parses it, whatever its field 1 is.
const std::string kTruncated("\x0a\x64" "abc", 5);
// Field 1 with wire type 7, which does not exist.
const std::string kBadWireType("\x0f\x01", 2);

// Field `number` of a message, length-delimited, holding `payload`.
std::string Field(int number, const std::string& payload) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.WriteTag(static_cast<uint32_t>(number << 3 | 2));
    coded.WriteVarint32(static_cast<uint32_t>(payload.size()));
    coded.WriteString(payload);
  }
  return out;
}

int FieldNumber(const google::protobuf::Descriptor* type, const std::string& name) {
  return type->FindFieldByName(name)->number();
}

grpc::ByteBuffer Bytes(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

grpc::ByteBuffer Bytes(const google::protobuf::Message& message) {
  return Bytes(message.SerializeAsString());
}

std::string Text(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string text;
  for (const grpc::Slice& slice : slices) {
    text.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return text;
}

// Blocks for the completion queue's next event, which must be `tag`.
void Await(grpc::CompletionQueue& queue, void* tag, bool want_ok = true) {
  void* got = nullptr;
  bool ok = false;
  ASSERT_TRUE(queue.Next(&got, &ok));
  EXPECT_EQ(got, tag);
  EXPECT_EQ(ok, want_ok);
}

class UnparsableTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = ServerProcess::Start({});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = std::make_unique<grpc::GenericStub>(server_->Channel());
  }

  grpc::Status Unary(const std::string& method, const std::string& bytes) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    grpc::CompletionQueue queue;
    std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
        stub_->PrepareUnaryCall(&context, method, Bytes(bytes), &queue);
    call->StartCall();
    grpc::ByteBuffer response;
    grpc::Status status;
    call->Finish(&response, &status, this);
    Await(queue, this);
    return status;
  }

  // Writes `requests` on one stream of `method`, then reads one answer each.
  std::vector<std::string> Stream(const std::string& method,
                                  const std::vector<grpc::ByteBuffer>& requests,
                                  grpc::Status* status) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    grpc::CompletionQueue queue;
    std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
        stub_->PrepareCall(&context, method, &queue);
    call->StartCall(this);
    Await(queue, this);
    for (const grpc::ByteBuffer& request : requests) {
      call->Write(request, this);
      Await(queue, this);
    }
    call->WritesDone(this);
    Await(queue, this);
    std::vector<std::string> answers;
    for (size_t i = 0; i < requests.size(); ++i) {
      grpc::ByteBuffer answer;
      call->Read(&answer, this);
      Await(queue, this);
      answers.push_back(Text(answer));
    }
    call->Finish(status, this);
    Await(queue, this);
    return answers;
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<grpc::GenericStub> stub_;
};

TEST_F(UnparsableTest, EveryUnaryMethodNamesItsRequestMessage) {
  const std::vector<std::pair<std::string, std::string>> methods = {
      {"/attention.v1.AttentionService/Attend", "attention.v1.AttendRequest"},
      {"/attention.v1.AttentionService/ListModels", "attention.v1.ListModelsRequest"},
      {"/inference.GRPCInferenceService/ServerLive", "inference.ServerLiveRequest"},
      {"/inference.GRPCInferenceService/ServerReady", "inference.ServerReadyRequest"},
      {"/inference.GRPCInferenceService/ModelReady", "inference.ModelReadyRequest"},
      {"/inference.GRPCInferenceService/ServerMetadata", "inference.ServerMetadataRequest"},
      {"/inference.GRPCInferenceService/ModelMetadata", "inference.ModelMetadataRequest"},
      {"/inference.GRPCInferenceService/ModelInfer", "inference.ModelInferRequest"},
      {"/inference.GRPCInferenceService/ModelConfig", "inference.ModelConfigRequest"},
      {"/inference.GRPCInferenceService/ModelStatistics", "inference.ModelStatisticsRequest"},
      {"/inference.GRPCInferenceService/RepositoryIndex", "inference.RepositoryIndexRequest"},
      {"/inference.GRPCInferenceService/RepositoryModelLoad",
       "inference.RepositoryModelLoadRequest"},
      {"/inference.GRPCInferenceService/RepositoryModelUnload",
       "inference.RepositoryModelUnloadRequest"},
  };
  for (const auto& [method, message] : methods) {
    for (const std::string& bytes : {kTruncated, kBadWireType}) {
      const grpc::Status status = Unary(method, bytes);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
      EXPECT_NE(status.error_message().find("not a valid " + message + " message"),
                std::string::npos)
          << method << ": " << status.error_message();
    }
  }
}

TEST_F(UnparsableTest, APackedRunOfBrokenLengthIsNamedByItsField) {
  // queries.data as 7 bytes: not a whole number of float32 values.
  const std::string tensor =
      Field(FieldNumber(v1::Tensor::descriptor(), "data"), std::string(7, '\x01'));
  const grpc::Status attend =
      Unary("/attention.v1.AttentionService/Attend",
            Field(FieldNumber(v1::AttendRequest::descriptor(), "queries"), tensor));
  EXPECT_EQ(attend.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(attend.error_message().find(
                "queries.data: 7 bytes of packed float values, not a multiple of 4"),
            std::string::npos)
      << attend.error_message();

  // The Open Inference Protocol's typed contents: inputs[1].contents.fp32_contents.
  const google::protobuf::Descriptor* input =
      inference::ModelInferRequest::InferInputTensor::descriptor();
  const std::string contents = Field(
      FieldNumber(inference::InferTensorContents::descriptor(), "fp32_contents"), "abcde");
  const int inputs = FieldNumber(inference::ModelInferRequest::descriptor(), "inputs");
  const grpc::Status infer = Unary(
      "/inference.GRPCInferenceService/ModelInfer",
      Field(inputs, Field(FieldNumber(input, "name"), "keys")) +
          Field(inputs, Field(FieldNumber(input, "contents"), contents)));
  EXPECT_EQ(infer.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(infer.error_message().find("inputs[1].contents.fp32_contents: 5 bytes of packed "
                                       "float values, not a multiple of 4"),
            std::string::npos)
      << infer.error_message();

  // A model name that is not UTF-8.
  const grpc::Status name = Unary("/attention.v1.AttentionService/Attend",
                                  Field(FieldNumber(v1::AttendRequest::descriptor(), "model"),
                                        std::string("\xff\xfe", 2)));
  EXPECT_NE(name.error_message().find("model: not valid UTF-8"), std::string::npos)
      << name.error_message();
}

TEST_F(UnparsableTest, AttendAfterBadBytesStillAnswers) {
  ASSERT_EQ(Unary("/attention.v1.AttentionService/Attend", kTruncated).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  const v1::AttendRequest request = testing::SelfAttentionRequest(1, 4, 8, 1);
  v1::AttendResponse response;
  ASSERT_TRUE(testing::AttendWithin(*server_->Stub(), std::chrono::seconds(20), request, &response)
                  .ok());
  EXPECT_EQ(testing::CheckAnswer(request, response), "");
}

TEST_F(UnparsableTest, AttendStreamAnswersBadBytesInPlace) {
  const v1::AttendRequest first = testing::SelfAttentionRequest(1, 4, 8, 1);
  const v1::AttendRequest last = testing::SelfAttentionRequest(2, 3, 8, 2);
  grpc::Status status;
  const std::vector<std::string> answers = Stream(
      "/attention.v1.AttentionService/AttendStream",
      {Bytes(first), Bytes(kTruncated), Bytes(last)}, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(answers.size(), 3u);
  v1::AttendResponse response;
  ASSERT_TRUE(response.ParseFromString(answers[0]));
  EXPECT_EQ(testing::CheckAnswer(first, response), "");
  ASSERT_TRUE(response.ParseFromString(answers[1]));
  EXPECT_EQ(response.error().code(), static_cast<int32_t>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_NE(response.error().message().find("not a valid attention.v1.AttendRequest message"),
            std::string::npos)
      << response.error().message();
  ASSERT_TRUE(response.ParseFromString(answers[2]));
  EXPECT_EQ(testing::CheckAnswer(last, response), "");
}

TEST_F(UnparsableTest, ModelStreamInferAnswersBadBytesInPlace) {
  inference::ModelInferRequest good;
  good.set_model_name("dot_product");
  good.set_id("good");
  inference::ModelInferRequest::InferInputTensor* queries = good.add_inputs();
  queries->set_name("queries");
  queries->set_datatype("FP32");
  for (int64_t size : {1, 2, 2}) queries->add_shape(size);
  for (float value : {1.0f, 0.0f, 0.0f, 1.0f}) queries->mutable_contents()->add_fp32_contents(value);
  grpc::Status status;
  const std::vector<std::string> answers =
      Stream("/inference.GRPCInferenceService/ModelStreamInfer",
             {Bytes(kBadWireType), Bytes(good)}, &status);
  EXPECT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(answers.size(), 2u);
  inference::ModelStreamInferResponse response;
  ASSERT_TRUE(response.ParseFromString(answers[0]));
  EXPECT_EQ(response.error_message().rfind("INVALID_ARGUMENT: ", 0), 0u)
      << response.error_message();
  EXPECT_NE(response.error_message().find("not a valid inference.ModelInferRequest message"),
            std::string::npos)
      << response.error_message();
  ASSERT_TRUE(response.ParseFromString(answers[1]));
  EXPECT_EQ(response.error_message(), "");
  EXPECT_EQ(response.infer_response().id(), "good");
  ASSERT_EQ(response.infer_response().outputs_size(), 1);
  EXPECT_EQ(response.infer_response().outputs(0).name(), "output");
}

}  // namespace
}  // namespace attention
