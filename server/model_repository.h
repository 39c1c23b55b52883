// model_repository.h: the models a server runs, found by name.
//
// The built-ins (dot_product, distance) are always present. Every
// `*.safetensors` file of the repository directory becomes the model named by
// its stem; a file that is not a valid model is skipped and its reason kept
// for the caller to report (or, when strict, fails the whole load).
//
//   std::vector<absl::Status> skipped;
//   auto repository = ModelRepository::Load("models", /*strict=*/false, &skipped);
//   const Model* model = repository->Find("mha_small");
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/model.h"

namespace attention::server {

class ModelRepository {
 public:
  // Built-ins plus every model file of `directory` (none when nullopt), in
  // name order. NOT_FOUND when the directory does not exist. A bad file is
  // appended to `skipped` (its name and reason), or, with `strict`, is the
  // returned error. A file larger than `max_file_bytes` (0: no cap) is a bad
  // file, and so is one that does not fit in memory.
  static absl::StatusOr<ModelRepository> Load(const std::optional<std::filesystem::path>& directory,
                                               bool strict, std::vector<absl::Status>* skipped,
                                               uint64_t max_file_bytes = 0);

  // Adds `model` after the others; ALREADY_EXISTS when its name is taken.
  absl::Status Add(Model model);

  // The index in models() of the model named `name`; nullopt when there is
  // none. Constant time, as it runs for every request.
  std::optional<size_t> IndexOf(std::string_view name) const;
  // nullptr when there is no model of that name.
  const Model* Find(std::string_view name) const;
  // Stable addresses for the repository's lifetime.
  const std::vector<std::unique_ptr<Model>>& models() const { return models_; }

 private:
  // Built-ins first, then files by name, then models added with Add().
  std::vector<std::unique_ptr<Model>> models_;
  absl::flat_hash_map<std::string, size_t> index_;  // name -> index in models_
};

}  // namespace attention::server
