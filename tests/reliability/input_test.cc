// input_test.cc: hostile bytes and connections at the gRPC port.
//
// Messages above --max-message-bytes (unary, in a stream, many at once),
// bytes that are not an AttendRequest (gRPC refuses those before the service
// sees them), bytes that are not HTTP/2, and
// hundreds of connections that never send a request. Each is refused or
// closed without harm: afterwards the server answers correctly, is SERVING,
// and has given back the file descriptors of the connections that closed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

constexpr int kMaxMessageBytes = 1 << 20;

// A request of about `bytes` bytes on the wire.
v1::AttendRequest RequestOfBytes(int bytes, int seed) {
  const int floats = bytes / 4;
  return SelfAttentionRequest(1, floats / 64, 64, seed);
}

std::string CallCode(v1::AttentionService::Stub& stub, const v1::AttendRequest& request,
                     std::string* wrong = nullptr) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::AttendResponse response;
  const grpc::Status status = stub.Attend(&context, request, &response);
  if (status.ok() && wrong != nullptr) *wrong = CheckAnswer(request, response);
  return CodeName(status.error_code());
}

int OpenFds(pid_t pid) {
  int count = 0;
  std::error_code error;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", error);
       it != std::filesystem::directory_iterator(); ++it) {
    ++count;
  }
  return count;
}

class FaultInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto started =
        ServerProcess::Start({"--max-message-bytes", std::to_string(kMaxMessageBytes)});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    stub_ = v1::AttentionService::NewStub(
        grpc::CreateCustomChannel(server_->address(), grpc::InsecureChannelCredentials(), args));
  }
  void TearDown() override {
    if (server_) {
      stub_.reset();
      EXPECT_EQ(server_->Stop(), 0) << server_->Log();
    }
  }

  // The server still answers, right, and says it serves.
  void ExpectHealthy() {
    std::string wrong;
    EXPECT_EQ(CallCode(*stub_, SelfAttentionRequest(2, 16, 8, 7), &wrong), "OK");
    EXPECT_EQ(wrong, "");
    EXPECT_EQ(HealthStatus(server_->Channel()), "SERVING");
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

TEST_F(FaultInputTest, OversizedMessagesAreRefusedUnaryInStreamsAndInBulk) {
  std::string wrong;
  EXPECT_EQ(CallCode(*stub_, RequestOfBytes(kMaxMessageBytes / 2, 1), &wrong), "OK");
  EXPECT_EQ(wrong, "");
  EXPECT_EQ(CallCode(*stub_, RequestOfBytes(2 * kMaxMessageBytes, 2)), "RESOURCE_EXHAUSTED");

  {
    grpc::ClientContext context;
    auto stream = stub_->AttendStream(&context);
    const v1::AttendRequest small = SelfAttentionRequest(1, 4, 4, 3);
    ASSERT_TRUE(stream->Write(small));
    v1::AttendResponse response;
    ASSERT_TRUE(stream->Read(&response));
    EXPECT_EQ(CheckAnswer(small, response), "");
    stream->Write(RequestOfBytes(2 * kMaxMessageBytes, 4));
    stream->WritesDone();
    while (stream->Read(&response)) {
    }
    EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }

  std::vector<std::thread> senders;
  std::vector<std::string> codes(16);
  for (int i = 0; i < 16; ++i) {
    senders.emplace_back(
        [&, i] { codes[i] = CallCode(*stub_, RequestOfBytes(4 * kMaxMessageBytes, 10 + i)); });
  }
  for (std::thread& sender : senders) sender.join();
  EXPECT_THAT(codes, ::testing::Each("RESOURCE_EXHAUSTED"));
  ExpectHealthy();
}

TEST_F(FaultInputTest, BytesThatAreNotARequestOrNotHttp2AreRefused) {
  // Not a protobuf AttendRequest: field 2 (queries) declared 1000 bytes long.
  grpc::GenericStub generic(server_->Channel());
  for (const std::string& bytes :
       {std::string("\x12\xe8\x07garbage", 10), std::string("\xff\xff\xff\xff\xff\xff", 6)}) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&context, "/attention.v1.AttentionService/Attend", grpc::StubOptions(),
                      &request, &response,
                      [&done](grpc::Status status) { done.set_value(std::move(status)); });
    const grpc::Status status = done.get_future().get();
    // The service parses its requests itself (server/api/grpc/wire_message.h),
    // so the error names the message expected instead of gRPC's own answer
    // (UNIMPLEMENTED, no message: "no such method" to a client author).
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), ::testing::HasSubstr("attention.v1.AttendRequest"));
  }

  // Not HTTP/2 at all: the server closes the connection.
  for (const std::string& bytes :
       {std::string("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), std::string(4096, '\xab'),
        std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + std::string(64, '\xff')}) {
    TcpConnection connection(server_->address());
    ASSERT_TRUE(connection.connected());
    ASSERT_TRUE(connection.Send(bytes));
    EXPECT_TRUE(connection.ReadUntilClosed()) << "the server kept a garbage connection open";
  }
  ExpectHealthy();
}

TEST_F(FaultInputTest, HundredsOfIdleConnectionsLeaveServiceAndDescriptorsIntact) {
  const std::optional<pid_t> pid = ListeningProcess(server_->address());
  ASSERT_TRUE(pid.has_value());
  const int fds_before = OpenFds(*pid);
  {
    // Connections that never send a byte, ones that stop halfway through the
    // HTTP/2 preface, and gRPC channels that connect and then say nothing.
    std::vector<std::unique_ptr<TcpConnection>> connections;
    for (int i = 0; i < 400; ++i) {
      connections.push_back(std::make_unique<TcpConnection>(server_->address()));
      ASSERT_TRUE(connections.back()->connected()) << "connection " << i;
      if (i % 4 == 0) {
        ASSERT_TRUE(connections.back()->Send("PRI * HTTP/2.0\r\n"));
      }
    }
    std::vector<std::shared_ptr<grpc::Channel>> channels;
    for (int i = 0; i < 100; ++i) {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      channels.push_back(grpc::CreateCustomChannel(server_->address(),
                                                   grpc::InsecureChannelCredentials(), args));
      ASSERT_TRUE(channels.back()->WaitForConnected(std::chrono::system_clock::now() +
                                                    std::chrono::seconds(30)))
          << "channel " << i;
    }
    EXPECT_GE(OpenFds(*pid), fds_before + 500) << "the connections did not reach the server";
    ExpectHealthy();
  }
  // Every connection is closed by now; the server lets go of their sockets.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (OpenFds(*pid) > fds_before + 8 && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_LE(OpenFds(*pid), fds_before + 8) << "sockets of closed connections stay open";
  ExpectHealthy();
}

}  // namespace
}  // namespace attention::testing
