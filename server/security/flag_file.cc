// flag_file.cc: reading a whole file that a command-line flag names.
#include "server/security/flag_file.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace attention::server {

absl::StatusOr<std::string> ReadFlagFile(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(flag, " ", path, ": cannot open the file"));
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

}  // namespace attention::server
