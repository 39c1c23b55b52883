// manager.h: loading the repository's files into the live registry.
//
// The one writer of a ModelRegistry's file models. Every change is
// load-then-swap: a file is read and validated completely (LoadModel) before
// its model enters the registry, so a version being replaced serves until its
// replacement is ready, and a replacement that fails to load leaves it
// serving (the failure is logged, counted in
// attention_model_load_failures_total{model} and shown as the version's
// reason). Which versions are served is the version policy's choice
// (docs/api.md, section 5.4): under `latest` an older version is unloaded
// only once the newest one is ready, and when the newest file does not load
// and no version serves, the next older file is loaded instead.
//
// Sync() takes a listing (the start-up scan, or the poller's stable view),
// LoadModel()/UnloadModel() are the explicit control of RepositoryModelLoad
// and RepositoryModelUnload. A model unloaded explicitly stays out of service,
// whatever the poller sees, until it is loaded explicitly again. Calls are
// serialised; requests never wait for them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/observability/metrics.h"
#include "server/repository/registry.h"
#include "server/repository/scan.h"

namespace attention::server {

// Which of a model's versions are served (--version-policy).
enum class VersionPolicy { kLatest, kAll };

// INVALID_ARGUMENT unless "latest" or "all".
absl::StatusOr<VersionPolicy> ParseVersionPolicy(std::string_view text);

struct RepositoryOptions {
  std::filesystem::path directory;
  VersionPolicy policy = VersionPolicy::kLatest;
  // Files larger than this fail to load, unread; 0: no cap.
  uint64_t max_file_bytes = 0;
  // Loads bf16 models as fp32 (--force-fp32).
  bool force_fp32 = false;
  // What sessions of a model whose file names no "kv_cache_dtype" hold
  // (--kv-cache-dtype): filled into its Model::kv_cache_dtype at load.
  KvDtype kv_cache_dtype = KvDtype::kFloat32;
};

class RepositoryManager {
 public:
  // `registry` (with its built-ins already added) and `metrics` (nullptr:
  // none) are not owned and must outlive the manager.
  RepositoryManager(ModelRegistry* registry, ServerMetrics* metrics, RepositoryOptions options);

  // What one Sync() did, for the caller to log.
  struct Report {
    std::vector<absl::Status> failures;  // each names its file and the reason
    std::vector<std::string> changes;    // "loaded mha version 2 (...)", "unloaded ..."
  };

  // Brings the registry to `listing`: loads new and changed files, unloads
  // versions whose file is gone or that the policy no longer serves. A file
  // that failed to load is tried again only once it changes.
  Report Sync(const RepositoryListing& listing);

  // RepositoryModelLoad: reads `name`'s files now (changed or not) and serves
  // them per the policy, ending an explicit unload. NOT_FOUND when the
  // repository has no file of that name; FAILED_PRECONDITION for a built-in;
  // the load error when no version of it is ready afterwards.
  absl::Status LoadModel(std::string_view name);
  // RepositoryModelUnload: takes every version of `name` out of service until
  // LoadModel(name). NOT_FOUND when it is not served; FAILED_PRECONDITION for
  // a built-in.
  absl::Status UnloadModel(std::string_view name);

  // Runs on every version loaded from now on, before it enters the registry
  // (the warm-up, warmup.h), so no call ever reaches a version before it.
  // Empty (the default): none.
  using WarmUpHook = std::function<void(const Model& model, int64_t version)>;
  void SetWarmUp(WarmUpHook warm_up);

  // Implementation details follow.

 private:
  // Sync() of the model `only` (every model when nullopt).
  Report SyncLocked(const RepositoryListing& listing, const std::optional<std::string>& only)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `files`: the model's files, ascending by version.
  void SyncModel(const std::string& name, const std::vector<const ModelFile*>& files,
                 Report* report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Loads one file into the registry (or records why not).
  void LoadVersion(const ModelFile& file, Report* report) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unload(const std::string& name, int64_t version, Report* report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ModelRegistry* const registry_;  // not owned
  ServerMetrics* const metrics_;   // not owned; may be null
  const RepositoryOptions options_;

  absl::Mutex mu_;
  // The file each loaded (or failed) version was last read from: a version
  // is read again only when its file's signature differs.
  std::map<ModelFileKey, FileSignature> attempted_ ABSL_GUARDED_BY(mu_);
  // Names unloaded explicitly, out of service until loaded explicitly.
  std::set<std::string, std::less<>> unloaded_ ABSL_GUARDED_BY(mu_);
  WarmUpHook warm_up_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::server
