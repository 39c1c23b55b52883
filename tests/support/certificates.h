// certificates.h: a private PKI for the TLS tests in a temporary directory,
// made by tests/support/make_pki.sh (the certificate maker the Python and
// Node tests use too).
//
//   TestPki pki({"ca", "rogue"}, {{.name = "server"}, {.name = "intruder",
//                                  .ca = "rogue", .hosts = ""}});
//   ASSERT_TRUE(pki.ok()) << pki.log();
//   pki.Path("server.crt"); pki.Pem("ca.crt");
#pragma once

#include <string>
#include <vector>

#include "tests/support/server_process.h"

namespace attention::testing {

// One leaf certificate: <name>.crt and <name>.key, signed by the authority
// `ca` (<ca>.crt, <ca>.key).
struct CertificateSpec {
  std::string name;
  std::string ca = "ca";
  // subjectAltName entries; "" for a client certificate (no names), or a
  // client identity such as "URI:spiffe://test/bob".
  std::string hosts = "DNS:localhost,IP:127.0.0.1";
  // Validity, YYYYMMDDHHMMSSZ; "" for make_pki.sh's 2020..2099. Initialized
  // here so that a designated initializer may leave them out without a
  // -Wmissing-field-initializers warning.
  std::string not_before = "";
  std::string not_after = "";
};

class TestPki {
 public:
  // Makes a self-signed CA per name in `authorities`, then `certificates`.
  TestPki(const std::vector<std::string>& authorities,
          const std::vector<CertificateSpec>& certificates);

  bool ok() const { return ok_; }
  // openssl's output, to show when ok() is false.
  std::string log() const;
  // Path of a file of the PKI, e.g. "ca.crt", "client.key".
  std::string Path(const std::string& file) const;
  // Contents of such a file.
  std::string Pem(const std::string& file) const;

 private:
  TempDir dir_;
  bool ok_ = false;
};

}  // namespace attention::testing
