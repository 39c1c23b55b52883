// rest_api.h: the Open Inference Protocol over HTTP/REST (KServe v2,
// Triton's HTTP API) on --http-address: health, server and model metadata,
// readiness, config, statistics, the repository, and infer in JSON or with
// Triton's binary tensor data extension (rest_codec.h).
//
// A third front door to the same server: each endpoint is the protocol's
// operation (inference_operations.h), shared with the gRPC API, so infer
// requests are authenticated (Authorization: Bearer), admitted, limited,
// batched with gRPC requests, counted (api="http") and logged as those are,
// and drain waits for their answers. What is its own is the HTTP mapping:
// routes, the deadline header, and errors as {"error": "..."} with the
// HTTP status of their code (docs/api.md, "REST").
#pragma once

#include <memory>

#include "server/api/rest/http_transport.h"
#include "server/api/inference/inference_operations.h"
#include "server/dispatch/dispatcher.h"

namespace attention::server {

// The header that carries a client's deadline, in milliseconds from when
// the request arrives (gRPC clients send theirs in grpc-timeout).
inline constexpr char kTimeoutHeader[] = "inference-timeout-ms";

class RestApi {
 public:
  // Not owned; both must outlive the API.
  RestApi(Dispatcher* dispatcher, InferenceOperations* operations)
      : dispatcher_(dispatcher), operations_(operations) {}

  // Answers `exchange` (HttpServer's handler).
  void Handle(std::shared_ptr<HttpExchange> exchange);

  // What a request's method and path ask for (rest_api.cc).
  struct Route;

 private:
  struct InferCall;

  void Infer(std::shared_ptr<HttpExchange> exchange, const Route& route);
  Dispatcher::Done Finisher(InferCall* call) const;
  // The non-infer endpoints: answered at once.
  void Describe(HttpExchange& exchange, const Route& route);

  Dispatcher* const dispatcher_;           // not owned
  InferenceOperations* const operations_;  // not owned
};

}  // namespace attention::server
