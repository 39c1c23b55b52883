// flag_file.h: reading a whole file that a command-line flag names.
//
// The token file and the TLS files are read once at start-up; an error names
// the flag and the path, which is what an operator needs to fix it.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace attention::server {

// The contents of `path`, given as `flag` (e.g. "--tls-key"); NOT_FOUND
// naming both when it cannot be opened.
absl::StatusOr<std::string> ReadFlagFile(const std::string& flag, const std::string& path);

}  // namespace attention::server
