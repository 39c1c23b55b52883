// http_client.h: a blocking HTTP/1.1 client for the REST tests (Boost.Beast),
// one connection per HttpClient, so tests can also hold connections open;
// over TLS (with a client certificate, for mutual TLS) when given HttpTls.
//
//   HttpClient client("127.0.0.1:8000");
//   HttpResult result = client.Call("POST", "/v2/models/m/infer", body);
//   EXPECT_EQ(result.status, 200) << result.body;
//   HttpClient secure("127.0.0.1:8443", HttpTls{.ca_pem = pki.Pem("ca.crt")});
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace attention::testing {

struct HttpResult {
  int status = 0;                              // 0: no answer (connection failed or closed)
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;
  std::string error;  // why status is 0
};

// TLS for an HttpClient: the server's certificate must be signed by
// `ca_pem` and name the address's host.
struct HttpTls {
  std::string ca_pem;
  // A client certificate and its key, both PEM; empty: none.
  std::string cert_pem;
  std::string key_pem;
};

class HttpClient {
 public:
  // Connects to `address` (HOST:PORT), with a TLS handshake when `tls` is
  // set; Call() reports a failed connection or handshake.
  explicit HttpClient(const std::string& address, std::optional<HttpTls> tls = std::nullopt);
  ~HttpClient();

  // Why the connection or its handshake failed; empty when it stands.
  const std::string& error() const;
  // The subject of the server's certificate, one line ("CN = server");
  // empty without TLS.
  std::string ServerCertificateSubject() const;

  // One request on this connection (kept alive between calls).
  HttpResult Call(const std::string& method, const std::string& target,
                  const std::string& body = "",
                  const std::map<std::string, std::string>& headers = {},
                  std::chrono::milliseconds timeout = std::chrono::seconds(60));

 private:
  struct Connection;
  std::unique_ptr<Connection> connection_;
};

// One request on a fresh connection.
HttpResult HttpCall(const std::string& address, const std::string& method,
                    const std::string& target, const std::string& body = "",
                    const std::map<std::string, std::string>& headers = {});

}  // namespace attention::testing
