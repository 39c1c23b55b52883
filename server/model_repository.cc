// model_repository.cc: loading the built-ins and a directory of model files.
#include "server/model_repository.h"

#include <algorithm>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/model_loader.h"

namespace attention::server {

absl::StatusOr<ModelRepository> ModelRepository::Load(
    const std::optional<std::filesystem::path>& directory, bool strict,
    std::vector<absl::Status>* skipped, uint64_t max_file_bytes) {
  ModelRepository repository;
  for (Model built_in : {DotProductModel(), DistanceModel()}) {
    if (absl::Status s = repository.Add(std::move(built_in)); !s.ok()) return s;
  }
  if (!directory) return repository;

  std::error_code error;
  if (!std::filesystem::is_directory(*directory, error)) {
    return absl::NotFoundError(absl::StrCat("--model-repository ", directory->string(),
                                            " is not a readable directory"));
  }
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(*directory, error)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path());
  }
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot list --model-repository ", directory->string(), ": ", error.message()));
  }
  std::sort(files.begin(), files.end());

  for (const auto& file : files) {
    absl::StatusOr<Model> model = LoadModel(file, max_file_bytes);
    absl::Status problem = model.status();
    if (model.ok() && repository.Find(model->name) != nullptr) {
      problem = absl::AlreadyExistsError(absl::StrCat(
          file.string(), ": model name '", model->name, "' is taken by a built-in model"));
    }
    if (problem.ok()) problem = repository.Add(*std::move(model));
    if (!problem.ok()) {
      if (strict) return problem;
      skipped->push_back(std::move(problem));
    }
  }
  return repository;
}

absl::Status ModelRepository::Add(Model model) {
  if (!index_.try_emplace(model.name, models_.size()).second) {
    return absl::AlreadyExistsError(absl::StrCat("model name '", model.name, "' is taken"));
  }
  models_.push_back(std::make_unique<Model>(std::move(model)));
  return absl::OkStatus();
}

std::optional<size_t> ModelRepository::IndexOf(std::string_view name) const {
  // absl::string_view is not std::string_view in this abseil build.
  const auto it = index_.find(absl::string_view(name.data(), name.size()));
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

const Model* ModelRepository::Find(std::string_view name) const {
  const std::optional<size_t> index = IndexOf(name);
  return index ? models_[*index].get() : nullptr;
}

}  // namespace attention::server
