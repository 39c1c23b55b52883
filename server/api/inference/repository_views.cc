// repository_views.cc: ListModels and RepositoryIndex from a registry snapshot.
#include "server/api/inference/repository_views.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "server/api/attention/attention_adapter.h"

namespace attention::server {
namespace {

v1::ModelVersionState ToProto(VersionState state) {
  switch (state) {
    case VersionState::kLoading:
      return v1::MODEL_VERSION_STATE_LOADING;
    case VersionState::kReady:
      return v1::MODEL_VERSION_STATE_READY;
    case VersionState::kFailed:
      return v1::MODEL_VERSION_STATE_FAILED;
    case VersionState::kUnloading:
      return v1::MODEL_VERSION_STATE_UNLOADING;
  }
  return v1::MODEL_VERSION_STATE_UNSPECIFIED;
}

// The Open Inference Protocol's state names (Triton's).
std::string IndexState(VersionState state) {
  return state == VersionState::kFailed ? "UNAVAILABLE" : std::string(VersionStateName(state));
}

// Per name: the registry's versions and the unloading ones, ascending.
std::map<std::string, std::vector<ModelVersion>> AllVersions(const ModelRegistry& registry,
                                                             const ModelRegistry::Index& index) {
  std::map<std::string, std::vector<ModelVersion>> all;
  for (const auto& [name, entry] : index) all[name] = entry.versions;
  for (auto& [name, version] : registry.Unloading()) all[name].push_back(std::move(version));
  for (auto& [name, versions] : all) {
    std::stable_sort(versions.begin(), versions.end(),
                     [](const ModelVersion& a, const ModelVersion& b) {
                       return a.version < b.version;
                     });
  }
  return all;
}

}  // namespace

void ListRegistry(const ModelRegistry& registry, bool include_unavailable,
                  v1::ListModelsResponse* response) {
  const std::shared_ptr<const ModelRegistry::Index> index = registry.snapshot();
  // Built-ins first, then file models, each by name.
  std::vector<std::pair<std::string, std::vector<ModelVersion>>> models;
  for (auto& named : AllVersions(registry, *index)) models.push_back(std::move(named));
  std::stable_partition(models.begin(), models.end(), [&](const auto& named) {
    const auto entry = index->find(named.first);
    return entry != index->end() && entry->second.built_in;
  });
  for (const auto& [name, versions] : models) {
    const auto entry = index->find(name);
    const ModelVersion* newest = entry == index->end() ? nullptr : entry->second.NewestReady();
    if (newest == nullptr && !include_unavailable) continue;
    v1::ModelInfo* info = response->add_models();
    if (newest != nullptr) {
      *info = ToModelInfo(*newest->model);
      info->set_version(newest->version);
    }
    info->set_name(name);
    for (const ModelVersion& version : versions) {
      v1::ModelVersionStatus* status = info->add_versions();
      status->set_version(version.version);
      status->set_state(ToProto(version.state));
      status->set_reason(version.reason);
      if (version.model != nullptr) status->set_kind(std::string(KindName(version.model->kind)));
    }
  }
}

void IndexRegistry(const ModelRegistry& registry, bool ready_only,
                   inference::RepositoryIndexResponse* response) {
  const std::shared_ptr<const ModelRegistry::Index> index = registry.snapshot();
  for (const auto& [name, versions] : AllVersions(registry, *index)) {
    for (const ModelVersion& version : versions) {
      if (ready_only && version.state != VersionState::kReady) continue;
      auto* entry = response->add_models();
      entry->set_name(name);
      entry->set_version(std::to_string(version.version));
      entry->set_state(IndexState(version.state));
      entry->set_reason(version.reason);
    }
  }
}

}  // namespace attention::server
