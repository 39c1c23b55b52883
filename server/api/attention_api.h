// attention_api.h: attention.v1.AttentionService, the server's typed API.
//
// A thin adapter over the dispatcher (dispatch/dispatcher.h): Attend and each
// request of AttendStream become a Dispatcher::Request whose engine form
// views the proto (attention_adapter.h), and each answer is written back
// into the response. AttendStream is authenticated once, when it opens, and
// answers in request order; a bad request gets its error as an answer and the
// stream goes on (ordered_stream.h). ListModels describes the registry.
#pragma once

#include "attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/dispatch/dispatcher.h"
#include "server/repository/registry.h"

namespace attention::server {

class AttentionApi final : public v1::AttentionService::CallbackService {
 public:
  // Not owned; both must outlive the service.
  AttentionApi(Dispatcher* dispatcher, const ModelRegistry* registry)
      : dispatcher_(dispatcher), registry_(registry) {}

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const v1::AttendRequest* request,
                                   v1::AttendResponse* response) override;
  grpc::ServerBidiReactor<v1::AttendRequest, v1::AttendResponse>* AttendStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const v1::ListModelsRequest* request,
                                       v1::ListModelsResponse* response) override;

 private:
  Dispatcher* const dispatcher_;         // not owned
  const ModelRegistry* const registry_;  // not owned
};

}  // namespace attention::server
