// http_transport.cc: HttpServer on Boost.Beast: an acceptor, one Connection
// per client (all of its work on one strand), over a TCP socket or a TLS
// stream on it, and the exchanges they hand out.
#include "server/api/rest/http_transport.h"

#include <poll.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <thread>
#include <type_traits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "boost/asio.hpp"
#include "boost/beast/core.hpp"
#include "boost/beast/http.hpp"
#include "boost/beast/ssl.hpp"
#include "core/thread_name.h"
#include "server/api/rest/rest_codec.h"
#include "server/security/tls_context.h"

namespace attention::server {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;
using TlsStream = beast::ssl_stream<tcp::socket>;

const std::string* HttpRequest::Header(std::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return &value;
  }
  return nullptr;
}

namespace {

// While an answer is due, how often a connection that has sent bytes since
// its request is looked at again for its end.
constexpr auto kCloseRecheck = std::chrono::milliseconds(50);

// A connection as the server holds it, whatever its stream.
class OpenConnection {
 public:
  virtual ~OpenConnection() = default;
  virtual void Start() = 0;
  // Closes it, from any thread.
  virtual void Close() = 0;
};

// What the server, its connections and exchanges share; alive while any of
// them is, so an answer given after Stop() posts to a live io_context.
struct TransportState {
  explicit TransportState(const HttpOptions& options, HttpHandler handler)
      : options(options), handler(std::move(handler)), acceptor(io) {}

  const HttpOptions options;
  const HttpHandler handler;
  asio::io_context io;
  tcp::acceptor acceptor;
  std::atomic<int> connections{0};
  absl::Mutex mu;
  std::vector<std::weak_ptr<OpenConnection>> open ABSL_GUARDED_BY(mu);
};

std::string PeerName(const tcp::socket& socket) {
  beast::error_code ec;
  const tcp::endpoint peer = socket.remote_endpoint(ec);
  if (ec) return "unknown";
  const asio::ip::address address = peer.address();
  if (address.is_v6()) return absl::StrCat("ipv6:[", address.to_string(), "]:", peer.port());
  return absl::StrCat("ipv4:", address.to_string(), ":", peer.port());
}

// Whether the peer of `socket` has ended its side (or reset it), even with
// bytes it sent before still unread.
bool PeerClosed(tcp::socket& socket) {
  pollfd polled{.fd = socket.native_handle(), .events = POLLRDHUP, .revents = 0};
  return ::poll(&polled, 1, 0) == 1 && (polled.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// One client connection over `Stream`: a tcp::socket (plaintext) or a
// TlsStream on one; everything else is the same code. Every handler runs on
// the connection's strand. A single timer per phase (the TLS handshake,
// reading a request, writing an answer) bounds a slow client, armed once per
// phase rather than per socket operation (a 1 MB body arrives in dozens of
// reads).
template <class Stream>
class Connection final : public OpenConnection,
                         public std::enable_shared_from_this<Connection<Stream>> {
  static constexpr bool kTls = std::is_same_v<Stream, TlsStream>;

 public:
  // `context`: the TLS context to handshake with; null for plaintext.
  Connection(std::shared_ptr<TransportState> state, tcp::socket socket,
             std::shared_ptr<ssl::context> context)
      : state_(std::move(state)),
        peer_(PeerName(socket)),
        context_(std::move(context)),
        stream_(Open(std::move(socket), context_.get())),
        timer_(stream_.get_executor()) {}
  ~Connection() override { state_->connections.fetch_sub(1); }

  void Start() override {
    asio::dispatch(stream_.get_executor(), [self = this->shared_from_this()] {
      if constexpr (kTls) {
        self->Handshake();
      } else {
        self->Read();
      }
    });
  }

  void Close() override {
    asio::post(stream_.get_executor(), [self = this->shared_from_this()] { self->Shutdown(); });
  }

  // From the exchange, on any thread.
  void Respond(HttpResponse response, std::function<void()> sent) {
    asio::post(stream_.get_executor(),
               [self = this->shared_from_this(), response = std::move(response),
                sent = std::move(sent)]() mutable {
                 self->Write(std::move(response), std::move(sent));
               });
  }

 private:
  static Stream Open(tcp::socket socket, ssl::context* context) {
    if constexpr (kTls) {
      return Stream(std::move(socket), *context);
    } else {
      return socket;
    }
  }

  tcp::socket& socket() { return beast::get_lowest_layer(stream_); }

  // A client that stalls its handshake is dropped as one that stalls its
  // request is; one whose handshake fails (plaintext, a certificate
  // refused) at once.
  void Handshake() {
    ArmTimer();
    stream_.async_handshake(ssl::stream_base::server,
                            [self = this->shared_from_this()](beast::error_code ec) {
                              if (ec) return self->Shutdown();
                              self->client_certificate_names_ =
                                  PeerCertificateNames(self->stream_.native_handle());
                              self->Read();
                            });
  }

  // Closes the connection unless the phase ends first.
  void ArmTimer() {
    timer_.expires_after(absl::ToChronoMicroseconds(state_->options.timeout));
    timer_.async_wait([weak = this->weak_from_this()](beast::error_code ec) {
      if (ec) return;  // re-armed or cancelled
      if (auto self = weak.lock()) self->Shutdown();
    });
  }

  void Shutdown() {
    beast::error_code ignored;
    timer_.cancel();
    socket().shutdown(tcp::socket::shutdown_both, ignored);
    socket().close(ignored);
  }

  void Read() {
    parser_.emplace();
    parser_->header_limit(static_cast<uint32_t>(state_->options.max_header_bytes));
    parser_->body_limit(static_cast<uint64_t>(state_->options.max_body_bytes));
    ArmTimer();
    http::async_read_header(stream_, buffer_, *parser_,
                            [self = this->shared_from_this()](beast::error_code ec, size_t) {
                              self->OnHeader(ec);
                            });
  }

  void OnHeader(beast::error_code ec) {
    if (ec) return Fail(ec);
    const auto length = parser_->content_length();
    if (length && *length > static_cast<uint64_t>(state_->options.max_body_bytes)) {
      return Refuse(http::status::payload_too_large, "the body is larger than the server accepts");
    }
    if (beast::iequals(parser_->get()[http::field::expect], "100-continue")) {
      // curl waits a second for this before it sends a large body.
      static const std::string kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      asio::async_write(stream_, asio::buffer(kContinue),
                        [self = this->shared_from_this()](beast::error_code ec, size_t) {
                          if (ec) return self->Fail(ec);
                          self->ReadBody();
                        });
      return;
    }
    ReadBody();
  }

  // A body of known length goes straight from the stream into its string;
  // a chunked one through Beast's parser.
  void ReadBody() {
    const auto length = parser_->content_length();
    if (!length || parser_->is_done()) {
      http::async_read(stream_, buffer_, *parser_,
                       [self = this->shared_from_this()](beast::error_code ec, size_t) {
                         self->OnRequest(ec);
                       });
      return;
    }
    body_.resize(*length);
    const size_t buffered = std::min<size_t>(buffer_.size(), *length);
    asio::buffer_copy(asio::buffer(body_.data(), buffered), buffer_.data());
    buffer_.consume(buffered);
    asio::async_read(stream_, asio::buffer(body_.data() + buffered, *length - buffered),
                     [self = this->shared_from_this()](beast::error_code ec, size_t) {
                       self->OnRequest(ec);
                     });
  }

  // While the answer is due, the only thing a client can send that matters
  // is the end of its connection: once the socket is readable, a client
  // that has ended its side is gone. Bytes before that end (a pipelined
  // request, left for Read(); over TLS, the close_notify a client sends as
  // it closes) keep the socket readable, so it is then looked at again
  // every kCloseRecheck on the phase timer, idle until the answer is
  // written.
  void WatchForClose() {
    socket().async_wait(tcp::socket::wait_read,
                        [self = this->shared_from_this()](beast::error_code ec) {
                          if (ec) return;  // cancelled: the answer is out
                          self->CheckClosed();
                        });
  }

  void CheckClosed() {
    if (PeerClosed(socket())) return client_gone_.store(true);
    timer_.expires_after(kCloseRecheck);
    timer_.async_wait([weak = this->weak_from_this()](beast::error_code ec) {
      if (ec) return;  // the answer is out
      if (auto self = weak.lock()) self->CheckClosed();
    });
  }

  void OnRequest(beast::error_code ec) {
    if (ec) return Fail(ec);
    timer_.cancel();  // the answer may take as long as the request's deadline
    client_gone_.store(false);
    WatchForClose();
    http::request<http::string_body>& message = parser_->get();
    keep_alive_ = message.keep_alive();
    auto exchange = std::make_shared<Exchange>(this->shared_from_this());
    HttpRequest& request = exchange->request();
    request.method = std::string(message.method_string());
    request.target = std::string(message.target());
    for (const auto& field : message) {
      std::string name(field.name_string().data(), field.name_string().size());
      absl::AsciiStrToLower(&name);
      std::string value(field.value());
      auto same = std::find_if(request.headers.begin(), request.headers.end(),
                               [&](const auto& h) { return h.first == name; });
      if (same != request.headers.end()) {
        absl::StrAppend(&same->second, ", ", value);
      } else {
        request.headers.emplace_back(std::move(name), std::move(value));
      }
    }
    request.body = message.body().empty() ? std::move(body_) : std::move(message.body());
    body_.clear();
    request.peer = peer_;
    request.client_certificate_names = client_certificate_names_;
    state_->handler(std::move(exchange));
  }

  // A request the transport itself refuses; the connection closes after.
  void Refuse(http::status status, std::string_view why) {
    keep_alive_ = false;
    HttpResponse response;
    response.status = static_cast<int>(status);
    response.body = ErrorJson(why);
    Write(std::move(response), nullptr);
  }

  void Fail(beast::error_code ec) {
    if (ec == http::error::header_limit) {
      return Refuse(http::status::request_header_fields_too_large,
                    "the header block is larger than the server accepts");
    }
    if (ec == http::error::body_limit) {
      return Refuse(http::status::payload_too_large, "the body is larger than the server accepts");
    }
    const bool malformed =
        ec.category() == make_error_code(http::error::end_of_stream).category() &&
        ec != http::error::end_of_stream && ec != http::error::partial_message;
    if (malformed) return Refuse(http::status::bad_request, "the request is not valid HTTP/1.1");
    Shutdown();
  }

  void Write(HttpResponse response, std::function<void()> sent) {
    beast::error_code ignored;
    socket().cancel(ignored);  // the close watch: a client that left sees nothing anyway
    auto message = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(response.status), 11, std::move(response.body));
    message->set(http::field::content_type, response.content_type);
    for (auto& [name, value] : response.headers) message->set(name, value);
    message->keep_alive(keep_alive_);
    message->prepare_payload();
    ArmTimer();
    http::async_write(stream_, *message,
                      [self = this->shared_from_this(), message,
                       sent = std::move(sent)](beast::error_code ec, size_t) {
                        if (sent) sent();
                        if (ec) return self->Shutdown();
                        if (!self->keep_alive_) return self->EndSending();
                        self->Read();
                      });
  }

  // The client reads the answer, then sees the end; over TLS a close_notify
  // first, whose exchange the phase timer still bounds.
  void EndSending() {
    if constexpr (kTls) {
      stream_.async_shutdown(
          [self = this->shared_from_this()](beast::error_code) { self->Shutdown(); });
    } else {
      timer_.cancel();
      beast::error_code ignored;
      socket().shutdown(tcp::socket::shutdown_send, ignored);
    }
  }

  class Exchange final : public HttpExchange {
   public:
    explicit Exchange(std::shared_ptr<Connection> connection)
        : connection_(std::move(connection)) {}
    void Respond(HttpResponse response, std::function<void()> sent) override {
      if (answered_.exchange(true)) return;
      connection_->Respond(std::move(response), std::move(sent));
    }
    bool client_gone() const override { return connection_->client_gone_.load(); }

   private:
    std::shared_ptr<Connection> connection_;
    std::atomic<bool> answered_{false};
  };

  const std::shared_ptr<TransportState> state_;
  const std::string peer_;
  // Outlives the stream made from it, whatever rotation does meanwhile.
  const std::shared_ptr<ssl::context> context_;
  Stream stream_;
  asio::steady_timer timer_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::string body_;  // a body of known length, read past the parser
  std::atomic<bool> client_gone_{false};
  bool keep_alive_ = true;
  // The TLS client's certificate's, for the allow-list (tls_context.h).
  std::vector<std::string> client_certificate_names_;
};

// A connection for `socket`, over TLS when the server has a context; null
// when OpenSSL cannot make one (it throws only when memory runs out: a
// connection refused, rather than the thread ended).
std::shared_ptr<OpenConnection> MakeConnection(const std::shared_ptr<TransportState>& state,
                                               tcp::socket socket) {
  if (state->options.tls == nullptr) {
    return std::make_shared<Connection<tcp::socket>>(state, std::move(socket), nullptr);
  }
  try {
    return std::make_shared<Connection<TlsStream>>(state, std::move(socket),
                                                   state->options.tls->Current());
  } catch (const boost::system::system_error&) {
    return nullptr;
  }
}

void Accept(const std::shared_ptr<TransportState>& state) {
  state->acceptor.async_accept(
      asio::make_strand(state->io), [state](beast::error_code ec, tcp::socket socket) {
        if (ec == asio::error::operation_aborted) return;  // stopped
        if (!ec) {
          if (state->connections.fetch_add(1) >= state->options.max_connections) {
            state->connections.fetch_sub(1);
            beast::error_code ignored;
            socket.close(ignored);
          } else {
            // An answer goes out in several writes (header, body); with
            // Nagle's algorithm the last one waited for the client's delayed
            // ACK, 40 ms.
            beast::error_code ignored;
            socket.set_option(tcp::no_delay(true), ignored);
            std::shared_ptr<OpenConnection> connection =
                MakeConnection(state, std::move(socket));
            if (connection == nullptr) {
              state->connections.fetch_sub(1);  // none was made to give it back
            } else {
              {
                absl::MutexLock lock(&state->mu);
                std::erase_if(state->open, [](const auto& weak) { return weak.expired(); });
                state->open.push_back(connection);
              }
              connection->Start();
            }
          }
        }
        Accept(state);
      });
}

absl::StatusOr<tcp::endpoint> ParseEndpoint(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-address: expected HOST:PORT, got '", address, "'"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "localhost") host = "127.0.0.1";
  beast::error_code ec;
  const asio::ip::address ip = asio::ip::make_address(host, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http-address: '", host, "' is not an IP address"));
  }
  return tcp::endpoint(ip, static_cast<unsigned short>(port));
}

}  // namespace

struct HttpServer::State {
  std::shared_ptr<TransportState> transport;
  // Keeps the threads running while no connection has work.
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::vector<std::thread> threads;
};

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpOptions& options,
                                                              HttpHandler handler) {
  absl::StatusOr<tcp::endpoint> endpoint = ParseEndpoint(options.address);
  if (!endpoint.ok()) return endpoint.status();
  auto transport = std::make_shared<TransportState>(options, std::move(handler));
  beast::error_code ec;
  tcp::acceptor& acceptor = transport->acceptor;
  acceptor.open(endpoint->protocol(), ec);
  if (!ec) acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(*endpoint, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on --http-address ", options.address, ": ", ec.message()));
  }
  Accept(transport);
  auto state = std::make_shared<State>();
  state->transport = transport;
  state->work.emplace(transport->io.get_executor());
  for (int i = 0; i < std::max(1, options.threads); ++i) {
    state->threads.emplace_back([transport] {
      NameCurrentThread("http");
      transport->io.run();
    });
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(state)));
}

int HttpServer::port() const {
  beast::error_code ec;
  const tcp::endpoint local = state_->transport->acceptor.local_endpoint(ec);
  return ec ? 0 : local.port();
}

HttpServer::~HttpServer() {
  TransportState& transport = *state_->transport;
  asio::post(transport.io, [&transport] {
    beast::error_code ignored;
    transport.acceptor.close(ignored);
  });
  {
    absl::MutexLock lock(&transport.mu);
    for (const auto& weak : transport.open) {
      if (auto connection = weak.lock()) connection->Close();
    }
  }
  // The threads end once the closes have aborted every connection's work.
  state_->work.reset();
  for (std::thread& thread : state_->threads) thread.join();
}

}  // namespace attention::server
