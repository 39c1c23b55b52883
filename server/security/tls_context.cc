// tls_context.cc: the REST port's OpenSSL context from the --tls-* files,
// rebuilt when they change, and a client certificate's names.
#include "server/security/tls_context.h"

#include <arpa/inet.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "boost/asio/ssl/context.hpp"
#include "server/security/flag_file.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

namespace ssl = boost::asio::ssl;

// Resumed sessions must name the context they belong to; OpenSSL refuses to
// resume one without it when client certificates are verified.
constexpr unsigned char kSessionContext[] = "attention-rest";

// What tells a replaced or rewritten file: its device, inode, size and
// modification and change times, for each file given.
std::string Signature(const TlsFiles& files) {
  std::string signature;
  for (const std::string* path : {&files.cert, &files.key, &files.client_ca}) {
    struct stat info {};
    if (path->empty() || ::stat(path->c_str(), &info) != 0) {
      absl::StrAppend(&signature, "-;");
      continue;
    }
    absl::StrAppend(&signature, info.st_dev, ":", info.st_ino, ":", info.st_size, ":",
                    info.st_mtim.tv_sec, ".", info.st_mtim.tv_nsec, ":", info.st_ctim.tv_sec, ".",
                    info.st_ctim.tv_nsec, ";");
  }
  return signature;
}

// OpenSSL's reasons for the last failure, oldest first, and clears them.
std::string OpenSslErrors() {
  std::string text;
  while (const unsigned long code = ERR_get_error()) {
    char reason[256];
    ERR_error_string_n(code, reason, sizeof(reason));
    absl::StrAppend(&text, text.empty() ? "" : "; ", reason);
  }
  return text.empty() ? "unknown OpenSSL error" : text;
}

// Every certificate of the PEM bundle `pem` trusted for client
// certificates, and named to clients as an authority to choose theirs by.
absl::Status TrustClientAuthorities(SSL_CTX* context, const std::string& pem,
                                    const std::string& path) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  if (bio == nullptr) return absl::ResourceExhaustedError(OpenSslErrors());
  int count = 0;
  X509_STORE* store = SSL_CTX_get_cert_store(context);
  while (X509* authority = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr)) {
    X509_STORE_add_cert(store, authority);
    SSL_CTX_add_client_CA(context, authority);
    X509_free(authority);
    ++count;
  }
  BIO_free(bio);
  ERR_clear_error();  // the end of the bundle reads as an error
  if (count == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls-client-ca ", path, ": holds no PEM certificate"));
  }
  return absl::OkStatus();
}

// A server context from the files as they are now: TLS 1.2 and up (as
// gRPC's), with client certificates required and verified when
// --tls-client-ca is given.
absl::StatusOr<std::shared_ptr<ssl::context>> BuildContext(const TlsFiles& files) {
  absl::StatusOr<std::string> key = ReadFlagFile("--tls-key", files.key);
  if (!key.ok()) return key.status();
  absl::StatusOr<std::string> cert = ReadFlagFile("--tls-cert", files.cert);
  if (!cert.ok()) return cert.status();
  SSL_CTX* native = SSL_CTX_new(TLS_server_method());
  if (native == nullptr) return absl::ResourceExhaustedError(OpenSslErrors());
  // Takes `native` over; this constructor throws only for a null handle.
  auto context = std::make_shared<ssl::context>(native);
  SSL_CTX_set_min_proto_version(native, TLS1_2_VERSION);
  SSL_CTX_set_session_id_context(native, kSessionContext, sizeof(kSessionContext) - 1);
  boost::system::error_code ec;
  context->use_certificate_chain(boost::asio::buffer(*cert), ec);
  if (ec) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls-cert ", files.cert, ": not a PEM certificate chain (", ec.message(), ")"));
  }
  context->use_private_key(boost::asio::buffer(*key), ssl::context::pem, ec);
  // use_private_key compares a key only with a certificate of its own type;
  // this compares it with the certificate in use whatever its type.
  if (ec || SSL_CTX_check_private_key(native) != 1) {
    const std::string reason = ec ? ec.message() : OpenSslErrors();
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("--tls-key ", files.key,
                                                   ": not a PEM key that matches --tls-cert ",
                                                   files.cert, " (", reason, ")"));
  }
  if (!files.client_ca.empty()) {
    absl::StatusOr<std::string> authorities = ReadFlagFile("--tls-client-ca", files.client_ca);
    if (!authorities.ok()) return authorities.status();
    if (absl::Status trusted = TrustClientAuthorities(native, *authorities, files.client_ca);
        !trusted.ok()) {
      return trusted;
    }
    SSL_CTX_set_verify(native, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return context;
}

// An IA5 or UTF-8 string of a certificate, as UTF-8; nothing when it does
// not convert.
void AppendUtf8(const ASN1_STRING* text, std::vector<std::string>& names) {
  unsigned char* utf8 = nullptr;
  const int length = ASN1_STRING_to_UTF8(&utf8, text);
  if (length < 0) return;
  names.emplace_back(reinterpret_cast<const char*>(utf8), static_cast<size_t>(length));
  OPENSSL_free(utf8);
}

}  // namespace

absl::StatusOr<std::unique_ptr<RotatingTlsContext>> RotatingTlsContext::Create(
    TlsFiles files, absl::Duration refresh) {
  std::unique_ptr<RotatingTlsContext> rotating(new RotatingTlsContext(std::move(files), refresh));
  const std::string signature = Signature(rotating->files_);
  absl::StatusOr<std::shared_ptr<ssl::context>> context = BuildContext(rotating->files_);
  if (!context.ok()) return context.status();
  absl::MutexLock lock(&rotating->mu_);
  rotating->checked_ = absl::Now();
  rotating->signature_ = signature;
  rotating->current_ = *std::move(context);
  return rotating;
}

std::shared_ptr<ssl::context> RotatingTlsContext::Current() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  if (now - checked_ < refresh_) return current_;
  checked_ = now;
  // Taken before the files are read, so a change while they are read is
  // seen at the next look.
  std::string signature = Signature(files_);
  if (signature == signature_) return current_;
  signature_ = std::move(signature);
  absl::StatusOr<std::shared_ptr<ssl::context>> rebuilt = BuildContext(files_);
  if (!rebuilt.ok()) {
    spdlog::warn("REST TLS: the changed certificate files are not taken, the previous ones stay "
                 "in use: {}",
                 std::string(rebuilt.status().message()));
    return current_;
  }
  current_ = *std::move(rebuilt);
  spdlog::info("REST TLS: the certificate files changed; new connections use them");
  return current_;
}

std::vector<std::string> PeerCertificateNames(const ssl_st* connection) {
  std::vector<std::string> names;
  X509* certificate = SSL_get0_peer_certificate(connection);
  if (certificate == nullptr) return names;
  auto* alternatives = static_cast<GENERAL_NAMES*>(
      X509_get_ext_d2i(certificate, NID_subject_alt_name, nullptr, nullptr));
  for (int i = 0; alternatives != nullptr && i < sk_GENERAL_NAME_num(alternatives); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(alternatives, i);
    if (name->type == GEN_DNS || name->type == GEN_EMAIL || name->type == GEN_URI) {
      AppendUtf8(name->d.ia5, names);
    } else if (name->type == GEN_IPADD) {
      const ASN1_OCTET_STRING* address = name->d.iPAddress;
      const int family = address->length == 4 ? AF_INET : address->length == 16 ? AF_INET6 : 0;
      char text[INET6_ADDRSTRLEN];
      if (family != 0 && inet_ntop(family, address->data, text, sizeof(text)) != nullptr) {
        names.emplace_back(text);
      }
    }
  }
  GENERAL_NAMES_free(alternatives);
  const X509_NAME* subject = X509_get_subject_name(certificate);
  const int common_name = X509_NAME_get_index_by_NID(subject, NID_commonName, -1);
  if (common_name >= 0) {
    AppendUtf8(X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, common_name)), names);
  }
  return names;
}

}  // namespace attention::server
