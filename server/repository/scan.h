// scan.h: which model files a repository directory holds now.
//
// The layout (docs/api.md, section 5.1): `<name>.safetensors` is version 1 of
// model `<name>`; a directory `<name>/` holds versions as `<N>.safetensors`,
// N a positive decimal without leading zeros. When both give a version 1,
// the directory's file wins. Names starting with `.` or ending in `.tmp` are
// ignored at both levels, so that copies in progress under a temporary name
// (cp then mv, rsync's `.name.XXXXXX`) are never read.
//
// A scan only lists and stats; it reads no model. Entries that cannot be
// stat'ed (a dangling symlink) are listed with an empty signature so that the
// loader reports them by name, as it reports any bad file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/statusor.h"

namespace attention::server {

// What tells one content of a file from another without reading it: a copy
// renamed into place changes the inode, a rewrite the size or the time.
struct FileSignature {
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t inode = 0;
  bool operator==(const FileSignature&) const = default;
};

struct ModelFile {
  std::string name;
  int64_t version = 1;
  std::filesystem::path path;
  FileSignature signature;
};

// (model name, version) -> its file, in name then version order.
using ModelFileKey = std::pair<std::string, int64_t>;
using RepositoryListing = std::map<ModelFileKey, ModelFile>;

// Whether a directory entry named `file_name` is skipped as work in progress.
bool IsIgnoredName(std::string_view file_name);

// The model files of `directory`. NOT_FOUND when it is not a readable
// directory, UNAVAILABLE when listing it fails midway.
absl::StatusOr<RepositoryListing> ScanRepository(const std::filesystem::path& directory);

}  // namespace attention::server
