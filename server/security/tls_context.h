// tls_context.h: the TLS of the REST port, the counterpart of gRPC's
// credentials (tls_credentials.h) from the same --tls-* files: an OpenSSL
// server context, rebuilt when the files change, and the names of a client's
// certificate as gRPC's auth context lists them, so that one allow-list
// check (CheckClientIdentity, auth.h) serves both APIs.
//
// Rotation follows gRPC's certificate watcher (docs/api.md, section 6.3):
// at most every kCertificateRefreshSeconds, when a connection is accepted,
// the files' inode, size and times are compared with those last read; after
// a change they are read into a new context, which connections accepted from
// then on use, while open connections keep theirs. A key that does not match
// its certificate (the key replaced, its certificate not yet) is not taken:
// the previous context stays until the files change again.
//
//   auto tls = RotatingTlsContext::Create({.cert = "c.pem", .key = "k.pem"});
//   std::shared_ptr<boost::asio::ssl::context> context = (*tls)->Current();
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/security/tls_credentials.h"

struct ssl_st;
namespace boost::asio::ssl {
class context;
}  // namespace boost::asio::ssl

namespace attention::server {

class RotatingTlsContext {
 public:
  // The first context, from `files` (`cert` and `key` set): NOT_FOUND naming
  // the flag of a file that cannot be read, INVALID_ARGUMENT for one that
  // holds no PEM certificate or key, or a key that does not match its
  // certificate.
  static absl::StatusOr<std::unique_ptr<RotatingTlsContext>> Create(
      TlsFiles files, absl::Duration refresh = absl::Seconds(kCertificateRefreshSeconds));

  // The context for a connection accepted now: rebuilt first when the files
  // changed (looked at most every `refresh`); a rebuild that fails is logged
  // and the current context stays.
  std::shared_ptr<boost::asio::ssl::context> Current();

 private:
  RotatingTlsContext(TlsFiles files, absl::Duration refresh)
      : files_(std::move(files)), refresh_(refresh) {}

  const TlsFiles files_;
  const absl::Duration refresh_;
  absl::Mutex mu_;
  absl::Time checked_ ABSL_GUARDED_BY(mu_);
  std::string signature_ ABSL_GUARDED_BY(mu_);  // of the files last read
  std::shared_ptr<boost::asio::ssl::context> current_ ABSL_GUARDED_BY(mu_);
};

// The names of the certificate the peer of `connection` presented, as
// gRPC's auth context lists a client certificate's (ClientCertificateNames,
// auth.h): its DNS, e-mail and URI subject alternative names and its IP
// addresses (as text), in the certificate's order, then its common name;
// empty without a certificate.
std::vector<std::string> PeerCertificateNames(const ssl_st* connection);

}  // namespace attention::server
