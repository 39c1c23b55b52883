// client_options.h: how an AttentionClient connects: servers, deadline, TLS,
// token and retries. Documented here, checked by CreateChannel() (channel.h).
#pragma once

#include <string>

#include "absl/time/time.h"

namespace attention::client {

// gRPC's retry policy for UNAVAILABLE (see the gRPC retry design, A6).
struct RetryOptions {
  // Tries per call, the first included; 1 disables retries. gRPC caps it at 5.
  int max_attempts = 4;
  // The n-th retry waits a random time in [0, min(initial_backoff *
  // backoff_multiplier^(n-1), max_backoff)].
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(1);
  double backoff_multiplier = 2.0;
  // A request is kept for retrying only up to this size; a larger one is
  // sent once. gRPC's own default is 256 KiB; this one matches the server's
  // default message limit.
  int max_retried_request_bytes = 64 << 20;
};

struct ClientOptions {
  // Comma-separated HOST:PORT list balanced round-robin, or one gRPC target
  // URI (dns:///host:port, ipv4:..., unix:path).
  std::string target = "127.0.0.1:50051";
  // Default deadline of a call, from its start to its last retry's answer.
  // absl::InfiniteDuration(): none.
  absl::Duration timeout = absl::Seconds(30);
  // TLS is used when `tls` is set or any of the files below is given; with
  // no CA file the system's roots are trusted. Files are PEM.
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;  // client certificate chain (mutual TLS)
  std::string tls_key_file;   // its private key; needs tls_cert_file
  // The name the server's certificate must carry, when it is not the host of
  // the (first) target.
  std::string tls_server_name;
  // Sent with every call as `authorization: Bearer <token>` when not empty.
  std::string token;
  RetryOptions retry;
};

}  // namespace attention::client
