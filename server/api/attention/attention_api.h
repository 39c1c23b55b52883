// attention_api.h: attention.v1.AttentionService, the server's typed API.
//
// A thin adapter over the dispatcher (dispatch/dispatcher.h): Attend and each
// request of AttendStream become a Dispatcher::Request whose engine form
// views the proto (attention_adapter.h), and each answer is written back
// into the response. Its methods take and give the messages' bytes
// (wire_message.h), so bytes that do not parse get INVALID_ARGUMENT. AttendStream is authenticated
// once, when it opens, and answers in request order; a bad request gets its error as an answer and
// the stream goes on (ordered_stream.h). AttendSession is a decoding session
// (attend_session.h). ListModels describes the registry.
#pragma once

#include "attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "server/api/grpc/raw_service.h"
#include "server/dispatch/call_origin.h"
#include "server/dispatch/dispatcher.h"
#include "server/repository/registry.h"
#include "server/sessions/session_table.h"

namespace attention::server {

// Every method raw: the handlers parse their requests themselves.
using AttentionWireService = RawCallbackService<
    v1::AttentionService::Service, v1::AttentionService::WithRawCallbackMethod_Attend,
    v1::AttentionService::WithRawCallbackMethod_AttendStream,
    v1::AttentionService::WithRawCallbackMethod_ListModels,
    v1::AttentionService::WithRawCallbackMethod_AttendSession>;

class AttentionApi final : public AttentionWireService {
 public:
  // Not owned; all must outlive the service.
  AttentionApi(Dispatcher* dispatcher, const ModelRegistry* registry, SessionTable* sessions)
      : dispatcher_(dispatcher), registry_(registry), sessions_(sessions) {}

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttendStream(
      grpc::CallbackServerContext* context) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttendSession(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;

 private:
  absl::Status List(const CallOrigin& origin, const v1::ListModelsRequest& request,
                    v1::ListModelsResponse* response) const;

  Dispatcher* const dispatcher_;         // not owned
  const ModelRegistry* const registry_;  // not owned
  SessionTable* const sessions_;         // not owned
};

}  // namespace attention::server
