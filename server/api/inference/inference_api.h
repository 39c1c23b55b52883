// inference_api.h: inference.GRPCInferenceService, the Open Inference
// Protocol (KServe v2, Triton's gRPC API) on attention-server's port.
//
// A second front door to the same server, not a second server: every method
// is the protocol's operation (inference_operations.h), which the REST API
// (rest_api.h) shares, and every ModelInfer request goes through
// Dispatcher::Submit(), so it is authenticated, admitted, validated,
// limited, batched (merged with Attend and REST requests for the same
// model), counted and logged exactly as an Attend request is, and drain
// waits for its call. What is its own is the gRPC transport: raw messages
// and the ModelStreamInfer stream.
#pragma once

#include "grpcpp/grpcpp.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/api/grpc/raw_service.h"
#include "server/api/inference/inference_adapter.h"
#include "server/api/inference/inference_operations.h"
#include "server/dispatch/dispatcher.h"

namespace attention::server {

// Every method raw: the handlers parse their requests themselves
// (wire_message.h), so bytes that do not parse get INVALID_ARGUMENT.
using InferenceGrpc = inference::GRPCInferenceService;
using InferenceWireService = RawCallbackService<
    InferenceGrpc::Service, InferenceGrpc::WithRawCallbackMethod_ServerLive,
    InferenceGrpc::WithRawCallbackMethod_ServerReady,
    InferenceGrpc::WithRawCallbackMethod_ModelReady,
    InferenceGrpc::WithRawCallbackMethod_ServerMetadata,
    InferenceGrpc::WithRawCallbackMethod_ModelMetadata,
    InferenceGrpc::WithRawCallbackMethod_ModelInfer,
    InferenceGrpc::WithRawCallbackMethod_ModelStreamInfer,
    InferenceGrpc::WithRawCallbackMethod_ModelConfig,
    InferenceGrpc::WithRawCallbackMethod_ModelStatistics,
    InferenceGrpc::WithRawCallbackMethod_RepositoryIndex,
    InferenceGrpc::WithRawCallbackMethod_RepositoryModelLoad,
    InferenceGrpc::WithRawCallbackMethod_RepositoryModelUnload>;

class InferenceApi final : public InferenceWireService {
 public:
  // Not owned; both must outlive the service.
  InferenceApi(Dispatcher* dispatcher, InferenceOperations* operations)
      : dispatcher_(dispatcher), operations_(operations) {}

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const grpc::ByteBuffer* request,
                                           grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* context,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* context,
                                            const grpc::ByteBuffer* request,
                                            grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RepositoryModelLoad(grpc::CallbackServerContext* context,
                                                const grpc::ByteBuffer* request,
                                                grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* RepositoryModelUnload(grpc::CallbackServerContext* context,
                                                  const grpc::ByteBuffer* request,
                                                  grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ModelStreamInfer(
      grpc::CallbackServerContext* context) override;

 private:
  class StreamReactor;

  Dispatcher* const dispatcher_;           // not owned
  InferenceOperations* const operations_;  // not owned
};

}  // namespace attention::server
