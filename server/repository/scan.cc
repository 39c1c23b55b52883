// scan.cc: listing a repository directory's model files.
#include "server/repository/scan.h"

#include <sys/stat.h>

#include <optional>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

constexpr std::string_view kExtension = ".safetensors";

FileSignature Signature(const std::filesystem::path& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) return {};
  return FileSignature{.size = static_cast<uint64_t>(info.st_size),
                       .mtime_ns = int64_t{info.st_mtim.tv_sec} * 1'000'000'000 +
                                   info.st_mtim.tv_nsec,
                       .inode = static_cast<uint64_t>(info.st_ino)};
}

// "12" -> 12; nullopt for "0", "012", "1a", "" and anything beyond int64.
std::optional<int64_t> VersionNumber(std::string_view stem) {
  if (stem.empty() || stem.front() == '0') return std::nullopt;
  for (char c : stem) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  int64_t version = 0;
  if (!absl::SimpleAtoi(absl::string_view(stem.data(), stem.size()), &version)) return std::nullopt;
  return version;
}

void AddVersions(const std::filesystem::path& directory, const std::string& name,
                 RepositoryListing& listing) {
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(directory, error)) {
    const std::string file_name = entry.path().filename().string();
    if (IsIgnoredName(file_name) || !file_name.ends_with(kExtension)) continue;
    const std::optional<int64_t> version =
        VersionNumber(std::string_view(file_name).substr(0, file_name.size() - kExtension.size()));
    if (!version) continue;
    listing[{name, *version}] =
        ModelFile{.name = name, .version = *version, .path = entry.path(),
                  .signature = Signature(entry.path())};
  }
}

}  // namespace

bool IsIgnoredName(std::string_view file_name) {
  return file_name.starts_with('.') || file_name.ends_with(".tmp");
}

absl::StatusOr<RepositoryListing> ScanRepository(const std::filesystem::path& directory) {
  std::error_code error;
  if (!std::filesystem::is_directory(directory, error)) {
    return absl::NotFoundError(absl::StrCat("--model-repository ", directory.string(),
                                            " is not a readable directory"));
  }
  RepositoryListing listing;
  std::map<ModelFileKey, ModelFile> flat;
  for (const auto& entry : std::filesystem::directory_iterator(directory, error)) {
    const std::string file_name = entry.path().filename().string();
    if (IsIgnoredName(file_name)) continue;
    if (file_name.ends_with(kExtension)) {
      // Whatever it is (a directory, a pipe, a dangling link), the loader
      // says why it is not a model.
      const std::string name = file_name.substr(0, file_name.size() - kExtension.size());
      flat[{name, 1}] = ModelFile{.name = name, .version = 1, .path = entry.path(),
                                  .signature = Signature(entry.path())};
    } else if (std::error_code kind_error; entry.is_directory(kind_error)) {
      AddVersions(entry.path(), file_name, listing);
    }
  }
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot list --model-repository ", directory.string(), ": ", error.message()));
  }
  // A version directory's own 1.safetensors wins over <name>.safetensors.
  listing.merge(flat);
  return listing;
}

}  // namespace attention::server
