// http_transport.h: the HTTP/1.1 server that the REST API (rest_api.h) runs
// on: Boost.Beast over Asio, asynchronous, with every resource a client can
// hold bounded.
//
// Bounds (docs/api.md, "REST"): connections beyond `max_connections` are
// closed as they are accepted; a request's header block beyond
// `max_header_bytes` gets 431 and its body beyond `max_body_bytes` 413, both
// before the excess is read; a connection that takes longer than `timeout`
// to send a whole request (or to start the next one), or to take a whole
// response, is closed. One request per connection is read at a time, so a
// client that pipelines waits for each answer.
//
// With `tls` set, every connection is TLS (plaintext gets no answer): its
// handshake, bounded by `timeout` too, uses the context current when it was
// accepted (rotation: tls_context.h), and with client certificates required
// the request carries the certificate's names for the allow-list check.
//
// Beast and Asio stay inside http_transport.cc: callers see plain structs.
//
//   auto server = HttpServer::Start(options, [](std::shared_ptr<HttpExchange> exchange) {
//     exchange->Respond({.status = 200, .content_type = "text/plain", .body = "hi"});
//   });
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace attention::server {

class RotatingTlsContext;

struct HttpOptions {
  std::string address;  // host:port; port 0 picks a free one
  int threads = 1;
  int max_connections = 1024;
  int64_t max_header_bytes = 16 << 10;
  int64_t max_body_bytes = 64 << 20;
  absl::Duration timeout = absl::Seconds(30);
  std::shared_ptr<RotatingTlsContext> tls;  // null: plaintext
};

struct HttpRequest {
  std::string method;  // "GET", "POST"...
  std::string target;  // path and query, as sent
  // Header names in lower case; a repeated header's values joined with ", ".
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  std::string peer;  // "ipv4:127.0.0.1:40000", as gRPC names peers
  // Over TLS, the names of the client's certificate (PeerCertificateNames,
  // tls_context.h); empty without one.
  std::vector<std::string> client_certificate_names;

  // The value of header `name` (lower case), or nullptr.
  const std::string* Header(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;  // besides the content type and length
  std::string body;
};

// One request and the right to answer it, once, from any thread.
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;

  HttpRequest& request() { return request_; }
  const HttpRequest& request() const { return request_; }
  // Sends `response`; `sent` runs once it is written or the connection has
  // failed, on the transport's thread. A second call is ignored.
  virtual void Respond(HttpResponse response, std::function<void()> sent = nullptr) = 0;
  // Whether the client has closed its connection while the answer is due
  // (HTTP/1.1's only way to cancel).
  virtual bool client_gone() const = 0;

 protected:
  HttpRequest request_;
};

using HttpHandler = std::function<void(std::shared_ptr<HttpExchange> exchange)>;

class HttpServer {
 public:
  // Listens on `options.address` and serves each request to `handler`, on
  // one of the transport's threads.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(const HttpOptions& options,
                                                           HttpHandler handler);
  // Stops: the listener closes, open connections are closed, the threads end.
  ~HttpServer();

  int port() const;

 private:
  struct State;
  explicit HttpServer(std::shared_ptr<State> state) : state_(std::move(state)) {}

  std::shared_ptr<State> state_;
};

}  // namespace attention::server
