// http_client.cc: HttpClient over Beast's synchronous API, on a TCP stream or
// a TLS stream over one.
#include "tests/support/http_client.h"

#include <algorithm>
#include <cctype>
#include <limits>
#include <utility>

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <openssl/ssl.h>
#include <openssl/x509.h>

namespace attention::testing {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = asio::ssl;

struct HttpClient::Connection {
  asio::io_context io;
  ssl::context context{ssl::context::tls_client};
  beast::tcp_stream stream{io};
  std::unique_ptr<beast::ssl_stream<beast::tcp_stream&>> tls;  // over `stream`
  beast::flat_buffer buffer;
  std::string error;
};

namespace {

// One request and its answer on `stream`.
template <class Stream>
HttpResult Exchange(Stream& stream, beast::flat_buffer& buffer,
                    const http::request<http::string_body>& request) {
  HttpResult result;
  beast::error_code ec;
  http::write(stream, request, ec);
  http::response_parser<http::string_body> parser;
  parser.body_limit(std::numeric_limits<uint64_t>::max());
  if (!ec) http::read(stream, buffer, parser, ec);
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

}  // namespace

HttpClient::HttpClient(const std::string& address, std::optional<HttpTls> tls)
    : connection_(std::make_unique<Connection>()) {
  Connection& c = *connection_;
  const size_t colon = address.rfind(':');
  const std::string host = address.substr(0, colon);
  beast::error_code ec;
  asio::ip::tcp::resolver resolver(c.io);
  const auto endpoints = resolver.resolve(host, address.substr(colon + 1), ec);
  if (!ec) c.stream.connect(endpoints, ec);
  if (ec) {
    c.error = "connect: " + ec.message();
    return;
  }
  if (!tls) return;
  c.context.add_certificate_authority(asio::buffer(tls->ca_pem), ec);
  if (!ec && !tls->cert_pem.empty()) {
    c.context.use_certificate_chain(asio::buffer(tls->cert_pem), ec);
    if (!ec) c.context.use_private_key(asio::buffer(tls->key_pem), ssl::context::pem, ec);
  }
  if (ec) {
    c.error = "TLS set-up: " + ec.message();
    return;
  }
  c.context.set_verify_mode(ssl::verify_peer);
  c.context.set_verify_callback(ssl::host_name_verification(host));
  c.tls = std::make_unique<beast::ssl_stream<beast::tcp_stream&>>(c.stream, c.context);
  c.stream.expires_after(std::chrono::seconds(20));
  c.tls->handshake(ssl::stream_base::client, ec);
  if (ec) c.error = "handshake: " + ec.message();
}

HttpClient::~HttpClient() = default;

const std::string& HttpClient::error() const { return connection_->error; }

std::string HttpClient::ServerCertificateSubject() const {
  if (connection_->tls == nullptr) return "";
  X509* certificate = SSL_get0_peer_certificate(connection_->tls->native_handle());
  if (certificate == nullptr) return "";
  BIO* text = BIO_new(BIO_s_mem());
  X509_NAME_print_ex(text, X509_get_subject_name(certificate), 0, XN_FLAG_ONELINE);
  char* data = nullptr;
  const long length = BIO_get_mem_data(text, &data);
  std::string subject(data, static_cast<size_t>(length));
  BIO_free(text);
  return subject;
}

HttpResult HttpClient::Call(const std::string& method, const std::string& target,
                            const std::string& body,
                            const std::map<std::string, std::string>& headers,
                            std::chrono::milliseconds timeout) {
  if (!connection_->error.empty()) {
    HttpResult result;
    result.error = connection_->error;
    return result;
  }
  http::request<http::string_body> request(http::string_to_verb(method), target, 11);
  request.set(http::field::host, "127.0.0.1");
  request.set(http::field::content_type, "application/json");
  for (const auto& [name, value] : headers) request.set(name, value);
  request.body() = body;
  request.prepare_payload();
  connection_->stream.expires_after(timeout);
  if (connection_->tls != nullptr) return Exchange(*connection_->tls, connection_->buffer, request);
  return Exchange(connection_->stream, connection_->buffer, request);
}

HttpResult HttpCall(const std::string& address, const std::string& method,
                    const std::string& target, const std::string& body,
                    const std::map<std::string, std::string>& headers) {
  return HttpClient(address).Call(method, target, body, headers);
}

}  // namespace attention::testing
