// certificates.cc: TestPki runs tests/support/make_pki.sh.
#include "tests/support/certificates.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/support/files.h"

namespace attention::testing {

TestPki::TestPki(const std::vector<std::string>& authorities,
                 const std::vector<CertificateSpec>& certificates) {
  std::string command = absl::StrCat("bash '", ATTENTION_SOURCE_DIR, "/tests/support/make_pki.sh' '",
                                     dir_.path().string(), "'");
  for (const std::string& ca : authorities) absl::StrAppend(&command, " '", ca, "'");
  absl::StrAppend(&command, " --");
  for (const CertificateSpec& spec : certificates) {
    // make_pki.sh separates the fields with "/", so one inside a name is %2F.
    absl::StrAppend(&command, " '", spec.name, "/", spec.ca, "/",
                    absl::StrReplaceAll(spec.hosts, {{"/", "%2F"}}), "/",
                    spec.not_before, "/", spec.not_after, "'");
  }
  ok_ = std::system(command.c_str()) == 0;
}

std::string TestPki::log() const { return ReadFile(dir_.path() / "openssl.log"); }

std::string TestPki::Path(const std::string& file) const { return (dir_.path() / file).string(); }

std::string TestPki::Pem(const std::string& file) const { return ReadFile(Path(file)); }

}  // namespace attention::testing
