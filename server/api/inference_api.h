// inference_api.h: inference.GRPCInferenceService, the Open Inference
// Protocol (KServe v2, Triton's gRPC API) on attention-server's port.
//
// A second front door to the same server, not a second server: every
// ModelInfer request goes through Dispatcher::Submit(), so it is
// authenticated, admitted, validated, limited, batched (merged with Attend
// requests for the same model), counted and logged exactly as an Attend
// request is, and drain waits for its call. What is its own is the mapping
// of tensors (inference_adapter.h) and the protocol's model descriptions.
//
// ServerLive and ServerReady answer without credentials, like
// grpc.health.v1.Health, so orchestrators can probe them; every other RPC
// needs the bearer token when the server has tokens. RepositoryModelLoad and
// RepositoryModelUnload are refused (FAILED_PRECONDITION) unless the server
// runs with --model-control explicit.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/api/inference_adapter.h"
#include "server/dispatch/call_origin.h"
#include "server/dispatch/dispatcher.h"
#include "server/observability/metrics.h"
#include "server/repository/manager.h"
#include "server/repository/registry.h"

namespace attention::server {

// Every method raw: the handlers parse their requests themselves
// (wire_message.h), so bytes that do not parse get INVALID_ARGUMENT.
using InferenceWireService = inference::GRPCInferenceService::WithRawCallbackMethod_ServerLive<
    inference::GRPCInferenceService::WithRawCallbackMethod_ServerReady<
        inference::GRPCInferenceService::WithRawCallbackMethod_ModelReady<
            inference::GRPCInferenceService::WithRawCallbackMethod_ServerMetadata<
                inference::GRPCInferenceService::WithRawCallbackMethod_ModelMetadata<
                    inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
                        inference::GRPCInferenceService::WithRawCallbackMethod_ModelStreamInfer<
                            inference::GRPCInferenceService::WithRawCallbackMethod_ModelConfig<
                                inference::GRPCInferenceService::WithRawCallbackMethod_ModelStatistics<
                                    inference::GRPCInferenceService::
                                        WithRawCallbackMethod_RepositoryIndex<
                                            inference::GRPCInferenceService::
                                                WithRawCallbackMethod_RepositoryModelLoad<
                                                    inference::GRPCInferenceService::
                                                        WithRawCallbackMethod_RepositoryModelUnload<
                                                            inference::GRPCInferenceService::
                                                                Service>>>>>>>>>>>>;

class InferenceApi final : public InferenceWireService {
 public:
  // Not owned; all must outlive the service. `manager`: the explicit model
  // control of RepositoryModelLoad/Unload; nullptr refuses them.
  InferenceApi(Dispatcher* dispatcher, const ModelRegistry* registry, RepositoryManager* manager,
               ServerMetrics* metrics);

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

  // The typed answers of the methods answered at once (AnswerAtOnce).
  absl::Status AnswerServerLive(const grpc::CallbackServerContext& context,
                                const inference::ServerLiveRequest& request,
                                inference::ServerLiveResponse* response) const;
  absl::Status AnswerServerReady(const grpc::CallbackServerContext& context,
                                 const inference::ServerReadyRequest& request,
                                 inference::ServerReadyResponse* response) const;
  absl::Status AnswerModelReady(const grpc::CallbackServerContext& context,
                                const inference::ModelReadyRequest& request,
                                inference::ModelReadyResponse* response) const;
  absl::Status AnswerServerMetadata(const grpc::CallbackServerContext& context,
                                    const inference::ServerMetadataRequest& request,
                                    inference::ServerMetadataResponse* response) const;
  absl::Status AnswerModelMetadata(const grpc::CallbackServerContext& context,
                                   const inference::ModelMetadataRequest& request,
                                   inference::ModelMetadataResponse* response) const;
  absl::Status AnswerModelConfig(const grpc::CallbackServerContext& context,
                                 const inference::ModelConfigRequest& request,
                                 inference::ModelConfigResponse* response) const;
  absl::Status AnswerModelStatistics(const grpc::CallbackServerContext& context,
                                     const inference::ModelStatisticsRequest& request,
                                     inference::ModelStatisticsResponse* response) const;
  absl::Status AnswerRepositoryIndex(const grpc::CallbackServerContext& context,
                                     const inference::RepositoryIndexRequest& request,
                                     inference::RepositoryIndexResponse* response) const;
  absl::Status AnswerRepositoryModelLoad(const grpc::CallbackServerContext& context,
                                         const inference::RepositoryModelLoadRequest& request,
                                         inference::RepositoryModelLoadResponse* response) const;
  absl::Status AnswerRepositoryModelUnload(
      const grpc::CallbackServerContext& context,
      const inference::RepositoryModelUnloadRequest& request,
      inference::RepositoryModelUnloadResponse* response) const;

  // The model `name` at `version` ("": the newest ready), or NOT_FOUND
  // naming which.
  absl::StatusOr<ServedModel> FindModel(std::string_view name, std::string_view version) const;
  // The same for a caller whose credentials are accepted; their error first.
  absl::StatusOr<ServedModel> FindModelFor(const grpc::CallbackServerContext& context,
                                           std::string_view name, std::string_view version) const;
  // The ready versions of `name`, ascending.
  std::vector<int64_t> ReadyVersions(std::string_view name) const;
  // Why `context` may not load or unload models; OK when it may.
  absl::Status CheckControl(const grpc::CallbackServerContext& context) const;
  // RepositoryModelLoad and RepositoryModelUnload: `change` (`verb`, e.g.
  // "loaded") of `name`, once the caller may control the repository.
  absl::Status ChangeRepository(const grpc::CallbackServerContext& context, std::string_view method,
                                std::string_view name, std::string_view verb,
                                absl::Status (RepositoryManager::*change)(std::string_view)) const;
  // Submits `proto`, decoded into `decoded` once admitted; as for
  // Dispatcher::Submit(), `readable` and `served_version` as in
  // Dispatcher::Request.
  void Infer(const CallOrigin& origin, const inference::ModelInferRequest& proto,
             absl::Status readable, DecodedInferRequest* decoded, int64_t* served_version,
             bool credentials_checked, Dispatcher::Done done);

  Dispatcher* const dispatcher_;         // not owned
  const ModelRegistry* const registry_;  // not owned
  RepositoryManager* const manager_;     // not owned; nullptr: no explicit control
  ServerMetrics* const metrics_;         // not owned
};

}  // namespace attention::server
