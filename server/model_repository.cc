// model_repository.cc: loading the built-ins and a directory of model files.
#include "server/model_repository.h"

#include <algorithm>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/model_loader.h"

namespace attention::server {

absl::StatusOr<ModelRepository> ModelRepository::Load(
    const std::optional<std::filesystem::path>& directory, bool strict,
    std::vector<absl::Status>* skipped) {
  ModelRepository repository;
  repository.models_.push_back(std::make_unique<Model>(DotProductModel()));
  repository.models_.push_back(std::make_unique<Model>(DistanceModel()));
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
    absl::StatusOr<Model> model = LoadModel(file);
    absl::Status problem = model.status();
    if (model.ok() && repository.Find(model->name) != nullptr) {
      problem = absl::AlreadyExistsError(absl::StrCat(
          file.string(), ": model name '", model->name, "' is taken by a built-in model"));
    }
    if (!problem.ok()) {
      if (strict) return problem;
      skipped->push_back(std::move(problem));
      continue;
    }
    repository.models_.push_back(std::make_unique<Model>(*std::move(model)));
  }
  return repository;
}

absl::Status ModelRepository::Add(Model model) {
  if (Find(model.name) != nullptr) {
    return absl::AlreadyExistsError(absl::StrCat("model name '", model.name, "' is taken"));
  }
  models_.push_back(std::make_unique<Model>(std::move(model)));
  return absl::OkStatus();
}

const Model* ModelRepository::Find(std::string_view name) const {
  for (const auto& model : models_) {
    if (model->name == name) return model.get();
  }
  return nullptr;
}

}  // namespace attention::server
