// registry.cc: the copy-on-write index of served models.
#include "server/repository/registry.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/observability/request_names.h"

namespace attention::server {

std::string_view VersionStateName(VersionState state) {
  switch (state) {
    case VersionState::kLoading:
      return "LOADING";
    case VersionState::kReady:
      return "READY";
    case VersionState::kFailed:
      return "FAILED";
    case VersionState::kUnloading:
      return "UNLOADING";
  }
  return "UNKNOWN";
}

const ModelVersion* ModelEntry::NewestReady() const {
  for (auto it = versions.rbegin(); it != versions.rend(); ++it) {
    if (it->state == VersionState::kReady) return &*it;
  }
  return nullptr;
}

const ModelVersion* ModelEntry::Find(int64_t version) const {
  for (const ModelVersion& v : versions) {
    if (v.version == version) return &v;
  }
  return nullptr;
}

absl::Status ModelRegistry::AddBuiltIn(Model model) {
  absl::MutexLock lock(&mu_);
  if (index_->contains(model.name)) {
    return absl::AlreadyExistsError(absl::StrCat("model name '", model.name, "' is taken"));
  }
  auto index = std::make_shared<Index>(*index_);
  ModelEntry entry{.name = model.name, .built_in = true, .versions = {}};
  entry.versions.push_back(ModelVersion{.version = 1,
                                        .state = VersionState::kReady,
                                        .reason = {},
                                        .model = std::make_shared<const Model>(std::move(model))});
  index->emplace(entry.name, std::move(entry));
  index_ = std::move(index);
  return absl::OkStatus();
}

std::shared_ptr<const ModelRegistry::Index> ModelRegistry::snapshot() const {
  absl::MutexLock lock(&mu_);
  return index_;
}

absl::StatusOr<ServedModel> ModelRegistry::Resolve(std::string_view name,
                                                   std::optional<int64_t> version) const {
  const std::shared_ptr<const Index> index = snapshot();
  const auto it = index->find(name);
  const ModelVersion* newest = it == index->end() ? nullptr : it->second.NewestReady();
  if (newest == nullptr) {
    return absl::NotFoundError(absl::StrCat("model: no model named '", Printable(name),
                                            "' is served (ListModels lists them)"));
  }
  if (!version) return ServedModel{newest->model, newest->version};
  const ModelVersion* wanted = it->second.Find(*version);
  if (wanted != nullptr && wanted->state == VersionState::kReady) {
    return ServedModel{wanted->model, wanted->version};
  }
  std::vector<int64_t> ready;
  for (const ModelVersion& v : it->second.versions) {
    if (v.state == VersionState::kReady) ready.push_back(v.version);
  }
  return absl::NotFoundError(absl::StrCat("version: model '", Printable(name),
                                          "' has no version ", *version,
                                          " ready; versions served: ", absl::StrJoin(ready, ", ")));
}

std::vector<std::pair<std::string, ModelVersion>> ModelRegistry::Unloading() const {
  absl::MutexLock lock(&mu_);
  std::erase_if(retired_, [](const Retired& r) { return r.model.expired(); });
  std::vector<std::pair<std::string, ModelVersion>> unloading;
  for (const Retired& r : retired_) {
    unloading.emplace_back(r.name, ModelVersion{.version = r.version,
                                                .state = VersionState::kUnloading,
                                                .reason = {},
                                                .model = nullptr});
  }
  return unloading;
}

void ModelRegistry::Retire(std::string_view name, const ModelVersion& version) {
  if (version.model == nullptr) return;
  std::erase_if(retired_, [](const Retired& r) { return r.model.expired(); });
  retired_.push_back(Retired{std::string(name), version.version, version.model});
}

void ModelRegistry::SetVersion(std::string_view name, ModelVersion version) {
  absl::MutexLock lock(&mu_);
  auto index = std::make_shared<Index>(*index_);
  auto it = index->find(name);
  if (it == index->end()) {
    it = index->emplace(std::string(name), ModelEntry{.name = std::string(name), .built_in = false, .versions = {}}).first;
  }
  std::vector<ModelVersion>& versions = it->second.versions;
  auto at = std::lower_bound(versions.begin(), versions.end(), version.version,
                             [](const ModelVersion& v, int64_t n) { return v.version < n; });
  if (at != versions.end() && at->version == version.version) {
    if (at->model != version.model) Retire(name, *at);
    *at = std::move(version);
  } else {
    versions.insert(at, std::move(version));
  }
  index_ = std::move(index);
}

void ModelRegistry::RemoveVersion(std::string_view name, int64_t version) {
  absl::MutexLock lock(&mu_);
  const auto found = index_->find(name);
  if (found == index_->end() || found->second.built_in) return;
  auto index = std::make_shared<Index>(*index_);
  auto it = index->find(name);
  std::vector<ModelVersion>& versions = it->second.versions;
  for (auto v = versions.begin(); v != versions.end(); ++v) {
    if (v->version != version) continue;
    Retire(name, *v);
    versions.erase(v);
    break;
  }
  if (versions.empty()) index->erase(it);
  index_ = std::move(index);
}

}  // namespace attention::server
