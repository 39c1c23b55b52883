// tls_credentials.cc: plaintext, TLS or mutual TLS, from the --tls-* flags;
// the certificate, key and client CA files are reread when they change.
#include "server/security/tls_credentials.h"

#include <string>
#include <utility>

#include "grpc/grpc.h"
#include "grpc/grpc_security.h"
#include "grpcpp/security/auth_metadata_processor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "server/security/flag_file.h"

namespace attention::server {
namespace {

// Plaintext credentials that, unlike grpc::InsecureServerCredentials() (whose
// SetAuthMetadataProcessor aborts), run an auth metadata processor: gRPC's
// server auth filter is in every channel with server credentials, plaintext
// ones included, so the processor sees each call's metadata before its
// message is read. Built on gRPC's C API, as the C++ TLS credentials are.
class PlaintextCredentials final : public grpc::ServerCredentials {
 public:
  void SetAuthMetadataProcessor(
      const std::shared_ptr<grpc::AuthMetadataProcessor>& processor) override {
    processor_ = processor;
  }

 private:
  using Processor = std::shared_ptr<grpc::AuthMetadataProcessor>;

  int AddPortToServer(const std::string& address, grpc_server* server) override {
    grpc_server_credentials* credentials = grpc_insecure_server_credentials_create();
    if (processor_ != nullptr) {
      // The C processor owns a reference, released when gRPC destroys it.
      grpc_server_credentials_set_auth_metadata_processor(
          credentials, {&Process, [](void* state) { delete static_cast<Processor*>(state); },
                        new Processor(processor_)});
    }
    const int port = grpc_server_add_http2_port(server, address.c_str(), credentials);
    grpc_server_credentials_release(credentials);
    return port;
  }

  // Runs the processor on the call's metadata and answers at once: it must
  // not block (IsBlocking() false) and gets no auth context (plaintext has
  // no peer identity).
  static void Process(void* state, grpc_auth_context*, const grpc_metadata* metadata,
                      size_t count, grpc_process_auth_metadata_done_cb done, void* user_data) {
    grpc::AuthMetadataProcessor::InputMetadata input;
    for (size_t i = 0; i < count; ++i) {
      const grpc_slice& key = metadata[i].key;
      const grpc_slice& value = metadata[i].value;
      input.emplace(grpc::string_ref(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(key)),
                                     GRPC_SLICE_LENGTH(key)),
                    grpc::string_ref(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(value)),
                                     GRPC_SLICE_LENGTH(value)));
    }
    grpc::AuthMetadataProcessor::OutputMetadata consumed, response;
    const grpc::Status status =
        (*static_cast<Processor*>(state))->Process(input, nullptr, &consumed, &response);
    done(user_data, nullptr, 0, nullptr, 0, static_cast<grpc_status_code>(status.error_code()),
         status.ok() ? nullptr : status.error_message().c_str());
  }

  Processor processor_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsCredentials(const TlsFiles& files) {
  if (files.cert.empty() != files.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key must be given together");
  }
  if (files.cert.empty()) {
    if (!files.client_ca.empty()) {
      return absl::InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key");
    }
    return std::make_shared<PlaintextCredentials>();
  }
  // Read once here so that a missing or unreadable file stops the start-up
  // with the flag's name; from then on gRPC's file watcher rereads them.
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--tls-key",
                                                                              files.key},
                                   {"--tls-cert", files.cert},
                                   {"--tls-client-ca", files.client_ca}}) {
    if (path.empty()) continue;
    if (absl::StatusOr<std::string> text = ReadFlagFile(flag, path); !text.ok()) {
      return text.status();
    }
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key, files.cert, files.client_ca, kCertificateRefreshSeconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (files.client_ca.empty()) {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  } else {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

}  // namespace attention::server
