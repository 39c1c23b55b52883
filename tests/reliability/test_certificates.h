// test_certificates.h: a throw-away CA and certificates for the TLS tests
// of tests/reliability, made with the openssl command in a temporary
// directory: a server certificate for localhost and 127.0.0.1, and client
// certificates alice (CN only), bob (CN plus the URI SAN spiffe://test/bob)
// and mallory.
#pragma once

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/support/metrics.h"
#include "tests/support/probes.h"
#include "tests/support/requests.h"
#include "tests/support/server_process.h"

namespace attention::testing {

class Certificates {
 public:
  Certificates() {
    std::ofstream(dir_.path() / "server.ext") << "subjectAltName=DNS:localhost,IP:127.0.0.1\n";
    std::ofstream(dir_.path() / "bob.ext") << "subjectAltName=URI:spiffe://test/bob\n";
    ok_ = Run("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
              "-keyout ca.key -out ca.pem -days 2 -subj /CN=attention-test-ca") &&
          Sign("server", "-extfile server.ext") && Sign("alice", "") &&
          Sign("bob", "-extfile bob.ext") && Sign("mallory", "");
  }
  bool ok() const { return ok_; }
  std::string path(const std::string& name) const { return (dir_.path() / name).string(); }
  std::string Read(const std::string& name) const {
    std::ifstream in(path(name));
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  // Runs `command` in the certificates' directory; its output goes to openssl.log.
  bool Run(const std::string& command) {
    return std::system(("cd '" + dir_.path().string() + "' && " + command +
                        " >>openssl.log 2>&1").c_str()) == 0;
  }
  // <name>.key and <name>.pem, CN=<name>, signed by the CA; `ext` adds
  // openssl x509 options (e.g. -extfile server.ext for the server's names).
  bool Sign(const std::string& name, const std::string& ext) {
    return Run("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout " +
               name + ".key -out " + name + ".csr -subj /CN=" + name) &&
           Run("openssl x509 -req -in " + name + ".csr -CA ca.pem -CAkey ca.key -CAcreateserial "
               "-days 2 -out " + name + ".pem " + ext);
  }

 private:
  TempDir dir_;
  bool ok_ = false;
};

}  // namespace attention::testing
