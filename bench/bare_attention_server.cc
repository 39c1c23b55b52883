// bare_attention_server: a benchmark anchor, not a server. A minimal gRPC C++
// callback server of attention.v1 that answers every Attend at once with the
// request's queries as its output (and to ListModels with the built-in
// dot_product, which the client's generated requests need): the cost of a unary call and its messages
// with nothing of ours in it, to set attention-server's per-call cost against
// (bench/service_targets.py runs both with the same client). Links only the
// proto.
//
//   bare-attention-server [--address HOST:PORT] [--port-file FILE]
//
// The port file gets 'grpc HOST:PORT' once serving, as attention-server's.
// Runs until killed.
#include <fstream>
#include <iostream>
#include <memory>
#include <string>

#include "attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace {

namespace v1 = ::attention::v1;

class BareAttention final : public v1::AttentionService::CallbackService {
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override {
    *response->mutable_output() = request->queries();
    response->set_request_id(request->request_id());
    response->set_model(request->model());
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  // attention-client bench shapes its request from the model's description.
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* /*request*/,
                                       v1::ListModelsResponse* response) override {
    v1::ModelInfo* model = response->add_models();
    model->set_name("dot_product");
    model->set_kind("dot_product");
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
};

// The value after `flag` in argv, or `fallback`.
std::string FlagValue(int argc, char** argv, const std::string& flag, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == flag) return argv[i + 1];
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string address = FlagValue(argc, argv, "--address", "127.0.0.1:0");
  const std::string port_file = FlagValue(argc, argv, "--port-file", "");
  BareAttention service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  // As attention-server's default --max-concurrent-streams, which shapes how
  // a connection's calls are read.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 256);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "cannot listen on " << address << "\n";
    return 1;
  }
  const std::string bound = address.substr(0, address.rfind(':') + 1) + std::to_string(port);
  if (!port_file.empty()) std::ofstream(port_file) << "grpc " << bound << "\n";
  std::cerr << "bare-attention-server on " << bound << "\n";
  server->Wait();
  return 0;
}
