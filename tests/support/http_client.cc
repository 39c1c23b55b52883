// http_client.cc: HttpClient over Beast's synchronous API.
#include "tests/support/http_client.h"

#include <algorithm>
#include <cctype>
#include <limits>
#include <utility>

#include <algorithm>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cctype>

namespace attention::testing {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;

struct HttpClient::Connection {
  asio::io_context io;
  beast::tcp_stream stream{io};
  beast::flat_buffer buffer;
  std::string error;
};

HttpClient::HttpClient(const std::string& address) : connection_(std::make_unique<Connection>()) {
  const size_t colon = address.rfind(':');
  beast::error_code ec;
  asio::ip::tcp::resolver resolver(connection_->io);
  const auto endpoints = resolver.resolve(address.substr(0, colon), address.substr(colon + 1), ec);
  if (!ec) connection_->stream.connect(endpoints, ec);
  if (ec) connection_->error = "connect: " + ec.message();
}

HttpClient::~HttpClient() = default;

HttpResult HttpClient::Call(const std::string& method, const std::string& target,
                            const std::string& body,
                            const std::map<std::string, std::string>& headers,
                            std::chrono::milliseconds timeout) {
  HttpResult result;
  if (!connection_->error.empty()) {
    result.error = connection_->error;
    return result;
  }
  http::request<http::string_body> request(http::string_to_verb(method), target, 11);
  request.set(http::field::host, "127.0.0.1");
  request.set(http::field::content_type, "application/json");
  for (const auto& [name, value] : headers) request.set(name, value);
  request.body() = body;
  request.prepare_payload();
  beast::error_code ec;
  connection_->stream.expires_after(timeout);
  http::write(connection_->stream, request, ec);
  http::response_parser<http::string_body> parser;
  parser.body_limit(std::numeric_limits<uint64_t>::max());
  if (!ec) http::read(connection_->stream, connection_->buffer, parser, ec);
  if (ec) {
    result.error = ec.message();
    return result;
  }
  const auto& response = parser.get();
  result.status = static_cast<int>(response.result_int());
  for (const auto& field : response) {
    std::string name(field.name_string().data(), field.name_string().size());
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    result.headers[name] = std::string(field.value().data(), field.value().size());
  }
  result.body = response.body();
  return result;
}

HttpResult HttpCall(const std::string& address, const std::string& method,
                    const std::string& target, const std::string& body,
                    const std::map<std::string, std::string>& headers) {
  return HttpClient(address).Call(method, target, body, headers);
}

}  // namespace attention::testing
