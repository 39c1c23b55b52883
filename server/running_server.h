// running_server.h: what a running attention-server owns (RunningServer):
// built by Start (start_up.cc), served and taken down by RunServer
// (run_server.cc).
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "core/engine/engine.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/exposer.h"
#include "server/api/attention/attention_api.h"
#include "server/api/inference/inference_api.h"
#include "server/api/inference/inference_operations.h"
#include "server/api/rest/http_transport.h"
#include "server/api/rest/rest_api.h"
#include "server/config/server_config.h"
#include "server/dispatch/dispatcher.h"
#include "server/dispatch/test_gate.h"
#include "server/observability/metrics.h"
#include "server/observability/refusal_log.h"
#include "server/repository/manager.h"
#include "server/repository/poller.h"
#include "server/repository/registry.h"
#include "server/repository/scan.h"
#include "server/sessions/session_table.h"

namespace attention::server {

// What a running server owns, in the order start-up builds it, so that it
// is torn down in reverse.
struct RunningServer {
  DispatchOptions dispatch_options;
  std::shared_ptr<grpc::ServerCredentials> credentials;
  ModelRegistry registry;
  std::unique_ptr<TestGate> test_gate;
  std::unique_ptr<ServerMetrics> metrics;
  std::unique_ptr<RepositoryManager> manager;
  RepositoryListing initial;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Dispatcher> dispatcher;
  std::unique_ptr<SessionTable> sessions;
  // Refusals of the early token check, logged as the dispatcher logs its own
  // (at most Dispatcher::kRefusalLinesPerSecond lines a second).
  RefusalLogLimiter unauthenticated_log{Dispatcher::kRefusalLinesPerSecond};
  std::unique_ptr<AttentionApi> attention_api;
  std::unique_ptr<InferenceOperations> inference_operations;
  std::unique_ptr<InferenceApi> inference_api;
  std::unique_ptr<grpc::Server> grpc;
  std::string grpc_address;
  std::unique_ptr<RestApi> rest_api;
  std::unique_ptr<HttpServer> http;
  std::string http_address;
  std::unique_ptr<prometheus::Exposer> exposer;
  std::string metrics_address;
  std::unique_ptr<RepositoryPoller> poller;
};

// Everything up to serving: the kernel path, credentials, models, the
// dispatcher, gRPC, REST, metrics, polling, the warm-up and the port file.
// On failure, what was started is left in `s` for its destructor.
absl::Status Start(const ServerConfig& config, RunningServer& s);

// Health of the server ("") and of each service it serves, by name.
void SetHealth(grpc::Server& server, bool serving);

}  // namespace attention::server
