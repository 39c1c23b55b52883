// inference_operations.h: the Open Inference Protocol's operations, whatever
// carries them: gRPC (inference_api.h) and REST (rest_api.h) are each a
// thin transport over this one class, so a model is described, counted,
// loaded and inferred the same way through both.
//
// Requests and answers are the protocol's protobuf messages, which both
// transports map their own encodings to. A caller is a CallOrigin, whose
// credentials are checked here; ServerLive and ServerReady need none, like
// grpc.health.v1.Health, so orchestrators can probe them. Loading and
// unloading are refused (FAILED_PRECONDITION) unless the server runs with
// --model-control explicit.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "inference/grpc_service.pb.h"
#include "server/api/inference/inference_adapter.h"
#include "server/dispatch/call_origin.h"
#include "server/dispatch/dispatcher.h"
#include "server/observability/metrics.h"
#include "server/repository/manager.h"
#include "server/repository/registry.h"
#include "server/sessions/session_table.h"

namespace attention::server {

class InferenceOperations {
 public:
  // Not owned; all must outlive this. `manager`: the explicit model control
  // of RepositoryModelLoad/Unload; nullptr refuses them.
  InferenceOperations(Dispatcher* dispatcher, const ModelRegistry* registry,
                      RepositoryManager* manager, ServerMetrics* metrics, SessionTable* sessions)
      : dispatcher_(dispatcher),
        registry_(registry),
        manager_(manager),
        metrics_(metrics),
        sessions_(sessions) {}

  absl::Status ServerLive(const CallOrigin& origin, const inference::ServerLiveRequest& request,
                          inference::ServerLiveResponse* response) const;
  absl::Status ServerReady(const CallOrigin& origin, const inference::ServerReadyRequest& request,
                           inference::ServerReadyResponse* response) const;
  absl::Status ModelReady(const CallOrigin& origin, const inference::ModelReadyRequest& request,
                          inference::ModelReadyResponse* response) const;
  absl::Status ServerMetadata(const CallOrigin& origin,
                              const inference::ServerMetadataRequest& request,
                              inference::ServerMetadataResponse* response) const;
  absl::Status ModelMetadata(const CallOrigin& origin,
                             const inference::ModelMetadataRequest& request,
                             inference::ModelMetadataResponse* response) const;
  absl::Status ModelConfig(const CallOrigin& origin, const inference::ModelConfigRequest& request,
                           inference::ModelConfigResponse* response) const;
  absl::Status ModelStatistics(const CallOrigin& origin,
                               const inference::ModelStatisticsRequest& request,
                               inference::ModelStatisticsResponse* response) const;
  absl::Status RepositoryIndex(const CallOrigin& origin,
                               const inference::RepositoryIndexRequest& request,
                               inference::RepositoryIndexResponse* response) const;
  absl::Status RepositoryModelLoad(const CallOrigin& origin,
                                   const inference::RepositoryModelLoadRequest& request,
                                   inference::RepositoryModelLoadResponse* response) const;
  absl::Status RepositoryModelUnload(const CallOrigin& origin,
                                     const inference::RepositoryModelUnloadRequest& request,
                                     inference::RepositoryModelUnloadResponse* response) const;

  // One inference request, as Dispatcher::Submit() takes it: `proto` is
  // decoded into `decoded` once admitted; `api` labels its metrics and log
  // line; `readable`, `served_version` and `credentials_checked` as in
  // Dispatcher::Request. `encoding`: why the transport could not turn its
  // body into `proto` when the model is known without it (REST's path names
  // it), answered as a decoding fault once the model is found. `proto`,
  // `decoded` and `served_version` stay alive until `done` runs.
  // A request with Triton's sequence parameters is a step of the model's
  // session of that sequence id (SubmitStep), which sequence_start opens and
  // sequence_end closes. `stream_end`: set when it came on a stream, which
  // sends a sequence's requests one at a time: its steps are admitted while
  // draining (Dispatcher::Request::continues_session), and a sequence it
  // opens calls it when the server's shutdown ends the sequence.
  void Infer(const CallOrigin& origin, std::string_view api,
             const inference::ModelInferRequest& proto, absl::Status readable,
             DecodedInferRequest* decoded, int64_t* served_version, bool credentials_checked,
             Dispatcher::Done done, absl::Status encoding = absl::OkStatus(),
             SessionTable::OnEnd stream_end = nullptr);

  // Whether new requests are accepted (false once draining).
  bool accepting() const { return dispatcher_->accepting(); }

 private:
  // The model `name` at `version` ("": the newest ready), or NOT_FOUND
  // naming which.
  absl::StatusOr<ServedModel> FindModel(std::string_view name, std::string_view version) const;
  // The same for a caller whose credentials are accepted; their error first.
  absl::StatusOr<ServedModel> FindModelFor(const CallOrigin& origin, std::string_view name,
                                           std::string_view version) const;
  struct SequenceCall;
  // Infer() for a request of `sequence`.
  void InferStep(const CallOrigin& origin, const Dispatcher::Request& request,
                 const inference::ModelInferRequest& proto, const SequenceParameters& sequence,
                 DecodedInferRequest* decoded, Dispatcher::Done done,
                 const absl::Status& encoding, const SessionTable::OnEnd& stream_end);
  // The session a sequence request steps: opened by sequence_start (on
  // `resolved`), found otherwise; busy for this step.
  absl::StatusOr<Dispatcher::Step> BeginSequenceStep(const inference::ModelInferRequest& proto,
                                                     const SequenceParameters& sequence,
                                                     const absl::StatusOr<ServedModel>& resolved,
                                                     const DecodedInferRequest& decoded,
                                                     const SessionTable::OnEnd& stream_end,
                                                     SequenceCall& call);
  // The ready versions of `name`, ascending.
  std::vector<int64_t> ReadyVersions(std::string_view name) const;
  // Why `origin` may not load or unload models; OK when it may.
  absl::Status CheckControl(const CallOrigin& origin) const;
  // RepositoryModelLoad and RepositoryModelUnload: `change` (`verb`, e.g.
  // "loaded") of `name`, once the caller may control the repository.
  absl::Status ChangeRepository(const CallOrigin& origin, std::string_view method,
                                std::string_view name, std::string_view verb,
                                absl::Status (RepositoryManager::*change)(std::string_view)) const;

  Dispatcher* const dispatcher_;         // not owned
  const ModelRegistry* const registry_;  // not owned
  RepositoryManager* const manager_;     // not owned; nullptr: no explicit control
  ServerMetrics* const metrics_;         // not owned
  SessionTable* const sessions_;         // not owned
};

}  // namespace attention::server
