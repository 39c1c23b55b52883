// http_client.h: a blocking HTTP/1.1 client for the REST tests (Boost.Beast),
// one connection per Exchange, so tests can also hold connections open.
//
//   HttpClient client("127.0.0.1:8000");
//   HttpResult result = client.Call("POST", "/v2/models/m/infer", body);
//   EXPECT_EQ(result.status, 200) << result.body;
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>

namespace attention::testing {

struct HttpResult {
  int status = 0;                              // 0: no answer (connection failed or closed)
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;
  std::string error;  // why status is 0
};

class HttpClient {
 public:
  // Connects to `address` (HOST:PORT); Call() reports a failed connection.
  explicit HttpClient(const std::string& address);
  ~HttpClient();

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
