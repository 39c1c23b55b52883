// manager.cc: load-then-swap of model files, versions and policy.
#include "server/repository/manager.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/model/model_loader.h"

namespace attention::server {
namespace {

std::string Describe(const Model& model) {
  std::string text = std::string(KindName(model.kind));
  if (model.query_size != 0) {
    absl::StrAppend(&text, ", d_q=", model.query_size, " d_k=", model.key_size);
    if (model.value_size != 0) absl::StrAppend(&text, " d_v=", model.value_size);
    if (model.num_heads != 0) {
      absl::StrAppend(&text, " heads=", model.num_heads, " E=", model.output_size);
    }
  }
  absl::StrAppend(&text, ", precision ", std::string(PrecisionName(model.precision)));
  return text;
}

}  // namespace

absl::StatusOr<VersionPolicy> ParseVersionPolicy(std::string_view text) {
  if (text == "latest") return VersionPolicy::kLatest;
  if (text == "all") return VersionPolicy::kAll;
  return absl::InvalidArgumentError(
      absl::StrCat("--version-policy: expected 'latest' or 'all', got '", std::string(text), "'"));
}

RepositoryManager::RepositoryManager(ModelRegistry* registry, ServerMetrics* metrics,
                                     RepositoryOptions options)
    : registry_(registry), metrics_(metrics), options_(std::move(options)) {}

RepositoryManager::Report RepositoryManager::Sync(const RepositoryListing& listing) {
  absl::MutexLock lock(&mu_);
  return SyncLocked(listing, std::nullopt);
}

RepositoryManager::Report RepositoryManager::SyncLocked(const RepositoryListing& listing,
                                                        const std::optional<std::string>& only) {
  Report report;
  std::map<std::string, std::vector<const ModelFile*>> files;
  for (const auto& [key, file] : listing) files[key.first].push_back(&file);
  for (const auto& [name, entry] : *registry_->snapshot()) {
    if (!entry.built_in) files.try_emplace(name);
  }
  for (const auto& [name, versions] : files) {
    if ((only && name != *only) || unloaded_.contains(name)) continue;
    SyncModel(name, versions, &report);
  }
  // Files gone before they ever loaded (or that a built-in's name kept out).
  std::erase_if(attempted_, [&](const auto& attempt) {
    return !listing.contains(attempt.first) && (!only || attempt.first.first == *only);
  });
  return report;
}

void RepositoryManager::SyncModel(const std::string& name,
                                  const std::vector<const ModelFile*>& files, Report* report) {
  {
    const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
    const auto it = index->find(name);
    if (it != index->end() && it->second.built_in) {
      for (const ModelFile* file : files) {
        auto [attempt, fresh] = attempted_.try_emplace({name, file->version}, file->signature);
        if (!fresh && attempt->second == file->signature) continue;
        attempt->second = file->signature;
        report->failures.push_back(absl::AlreadyExistsError(absl::StrCat(
            file->path.string(), ": model name '", name, "' is taken by a built-in model")));
        if (metrics_ != nullptr) metrics_->CountLoadFailure(name);
      }
      return;
    }
  }
  auto load = [&](const ModelFile& file) {
    const auto attempt = attempted_.find({name, file.version});
    if (attempt == attempted_.end() || !(attempt->second == file.signature)) {
      LoadVersion(file, report);
    }
  };
  std::vector<const ModelFile*> wanted;
  if (options_.policy == VersionPolicy::kAll) {
    wanted = files;
    for (const ModelFile* file : wanted) load(*file);
  } else {
    // The newest file; when it does not load and nothing serves yet (a
    // start-up, or a model whose files all changed), the next older one.
    for (auto file = files.rbegin(); file != files.rend(); ++file) {
      wanted.insert(wanted.begin(), *file);
      load(**file);
      const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
      const auto it = index->find(name);
      if (it != index->end() && it->second.NewestReady() != nullptr) break;
    }
  }

  const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
  const auto it = index->find(name);
  if (it == index->end()) return;
  auto contains = [](const std::vector<const ModelFile*>& list, int64_t version) {
    for (const ModelFile* file : list) {
      if (file->version == version) return true;
    }
    return false;
  };
  // Under `latest`, the older versions make way only for a ready newest one.
  const ModelVersion* newest_wanted =
      wanted.empty() ? nullptr : it->second.Find(wanted.back()->version);
  const bool newest_ready =
      newest_wanted != nullptr && newest_wanted->state == VersionState::kReady;
  for (const ModelVersion& version : it->second.versions) {
    if (!contains(files, version.version) ||
        (!contains(wanted, version.version) &&
         (version.state != VersionState::kReady || newest_ready))) {
      Unload(name, version.version, report);
    }
  }
}

void RepositoryManager::LoadVersion(const ModelFile& file, Report* report) {
  attempted_[{file.name, file.version}] = file.signature;
  std::shared_ptr<const Model> serving;
  std::string reason_kept;
  {
    const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
    const auto it = index->find(file.name);
    const ModelVersion* current = it == index->end() ? nullptr : it->second.Find(file.version);
    if (current != nullptr && current->state == VersionState::kReady) serving = current->model;
  }
  if (serving == nullptr) {
    registry_->SetVersion(file.name, ModelVersion{.version = file.version,
                                                  .state = VersionState::kLoading,
                                                  .reason = {},
                                                  .model = nullptr});
  }
  absl::StatusOr<Model> loaded =
      attention::LoadModel(file.path, options_.max_file_bytes, options_.force_fp32);
  if (!loaded.ok()) {
    report->failures.push_back(loaded.status());
    if (metrics_ != nullptr) metrics_->CountLoadFailure(file.name);
    const std::string reason(loaded.status().message());
    if (serving != nullptr) {
      registry_->SetVersion(
          file.name, ModelVersion{.version = file.version,
                                  .state = VersionState::kReady,
                                  .reason = absl::StrCat("reload failed, the previous file "
                                                         "keeps serving: ",
                                                         reason),
                                  .model = serving});
    } else {
      registry_->SetVersion(file.name, ModelVersion{.version = file.version,
                                                    .state = VersionState::kFailed,
                                                    .reason = reason,
                                                    .model = nullptr});
    }
    return;
  }
  // A version file is named by its number; the model by its directory.
  loaded->name = file.name;
  if (!loaded->kv_cache_dtype) loaded->kv_cache_dtype = options_.kv_cache_dtype;
  auto model = std::make_shared<const Model>(*std::move(loaded));
  if (warm_up_) warm_up_(*model, file.version);
  if (metrics_ != nullptr) {
    metrics_->AddModel(file.name);
    // Same labels: the series stays (no scrape sees it missing mid-swap).
    if (serving != nullptr &&
        (serving->kind != model->kind || serving->precision != model->precision)) {
      metrics_->SetModelServed(file.name, file.version, serving->kind, serving->precision, false);
    }
    metrics_->SetModelServed(file.name, file.version, model->kind, model->precision, true);
    if (serving != nullptr && serving->kv_cache_dtype != model->kv_cache_dtype) {
      metrics_->SetModelKvCacheDtype(file.name, file.version,
                                     serving->kv_cache_dtype.value_or(KvDtype::kFloat32), false);
    }
    metrics_->SetModelKvCacheDtype(file.name, file.version, *model->kv_cache_dtype, true);
  }
  report->changes.push_back(absl::StrCat(serving == nullptr ? "loaded " : "reloaded ", file.name,
                                         " version ", file.version, " (", Describe(*model),
                                         ") from ", file.path.string()));
  registry_->SetVersion(file.name, ModelVersion{.version = file.version,
                                                .state = VersionState::kReady,
                                                .reason = {},
                                                .model = std::move(model)});
}

void RepositoryManager::Unload(const std::string& name, int64_t version, Report* report) {
  attempted_.erase({name, version});
  {
    const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
    const auto it = index->find(name);
    const ModelVersion* current = it == index->end() ? nullptr : it->second.Find(version);
    if (current == nullptr) return;
    if (current->state == VersionState::kReady) {
      if (metrics_ != nullptr) {
        metrics_->SetModelServed(name, version, current->model->kind, current->model->precision,
                                 false);
        metrics_->SetModelKvCacheDtype(
            name, version, current->model->kv_cache_dtype.value_or(KvDtype::kFloat32), false);
      }
      report->changes.push_back(absl::StrCat("unloaded ", name, " version ", version));
    }
  }
  registry_->RemoveVersion(name, version);
}

absl::Status RepositoryManager::LoadModel(std::string_view name) {
  absl::MutexLock lock(&mu_);
  {
    const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
    const auto it = index->find(name);
    if (it != index->end() && it->second.built_in) {
      return absl::FailedPreconditionError(
          absl::StrCat("model '", std::string(name), "' is built in: it is always loaded"));
    }
  }
  absl::StatusOr<RepositoryListing> listing = ScanRepository(options_.directory);
  if (!listing.ok()) return listing.status();
  const std::string model(name);
  bool has_file = false;
  for (const auto& [key, file] : *listing) has_file = has_file || key.first == model;
  if (!has_file) {
    return absl::NotFoundError(absl::StrCat("model '", model, "' has no file in the repository (",
                                            model, ".safetensors or ", model,
                                            "/<version>.safetensors)"));
  }
  unloaded_.erase(model);
  std::erase_if(attempted_, [&](const auto& attempt) { return attempt.first.first == model; });
  Report report = SyncLocked(*listing, model);
  const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
  const auto it = index->find(model);
  if (it == index->end() || it->second.NewestReady() == nullptr) {
    return report.failures.empty()
               ? absl::NotFoundError(absl::StrCat("model '", model, "' has no version to serve"))
               : report.failures.front();
  }
  return absl::OkStatus();
}

void RepositoryManager::SetWarmUp(WarmUpHook warm_up) {
  absl::MutexLock lock(&mu_);
  warm_up_ = std::move(warm_up);
}

absl::Status RepositoryManager::UnloadModel(std::string_view name) {
  absl::MutexLock lock(&mu_);
  const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
  const auto it = index->find(name);
  if (it == index->end()) {
    return absl::NotFoundError(
        absl::StrCat("model '", std::string(name), "' is not loaded (RepositoryIndex lists them)"));
  }
  if (it->second.built_in) {
    return absl::FailedPreconditionError(
        absl::StrCat("model '", std::string(name), "' is built in: it cannot be unloaded"));
  }
  Report report;
  for (const ModelVersion& version : it->second.versions) {
    Unload(it->first, version.version, &report);
  }
  unloaded_.insert(std::string(name));
  return absl::OkStatus();
}

}  // namespace attention::server
