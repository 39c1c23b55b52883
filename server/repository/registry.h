// registry.h: the models a server serves now, by name and version.
//
// A live, thread-safe index. Requests resolve a name (and optionally a
// version) to a std::shared_ptr<const Model> and keep it until answered, so a
// request admitted to a version finishes on it even when the version is
// replaced or removed meanwhile, and the old weights are freed with the last
// such request. The index itself is immutable and replaced as a whole
// (copy-on-write) under a mutex: a lookup is one mutex-held shared_ptr copy
// and a map search, and never waits for a model to load (loading happens
// outside, in RepositoryManager, before the finished model is swapped in).
//
//   ModelRegistry registry;
//   registry.AddBuiltIn(DotProductModel());
//   registry.SetVersion("mha", {.version = 2, .state = VersionState::kReady, .model = weights});
//   absl::StatusOr<ServedModel> served = registry.Resolve("mha", std::nullopt);  // newest ready
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/model/model.h"

namespace attention::server {

// docs/api.md, section 5.4. kReady versions serve; a version whose reload
// failed stays kReady on its previous weights, with the failure as `reason`.
enum class VersionState { kLoading, kReady, kFailed, kUnloading };

// "LOADING", "READY", "FAILED", "UNLOADING".
std::string_view VersionStateName(VersionState state);

struct ModelVersion {
  int64_t version = 1;
  VersionState state = VersionState::kLoading;
  // kFailed: why it did not load. kReady: why its last reload failed, if one did.
  std::string reason;
  std::shared_ptr<const Model> model;  // set iff kReady (kUnloading: while requests hold it)
};

struct ModelEntry {
  std::string name;
  bool built_in = false;  // always served; never replaced or removed
  std::vector<ModelVersion> versions;  // ascending by version
  // The newest kReady version; nullptr when there is none.
  const ModelVersion* NewestReady() const;
  const ModelVersion* Find(int64_t version) const;
};

// A model as one request uses it.
struct ServedModel {
  std::shared_ptr<const Model> model;
  int64_t version = 1;
};

class ModelRegistry {
 public:
  using Index = std::map<std::string, ModelEntry, std::less<>>;

  // `model` at version 1, ready, for the server's lifetime. ALREADY_EXISTS
  // when the name is taken.
  absl::Status AddBuiltIn(Model model);

  // The model `name` at `version`, or its newest ready version when nullopt.
  // NOT_FOUND naming the model, or the version and the versions served.
  absl::StatusOr<ServedModel> Resolve(std::string_view name,
                                      std::optional<int64_t> version) const;

  // Everything known now, ready or not.
  std::shared_ptr<const Index> snapshot() const;

  // Versions taken out of service whose weights some request still holds,
  // as kUnloading entries (model unset), by name.
  std::vector<std::pair<std::string, ModelVersion>> Unloading() const;

  // Control path (RepositoryManager). Inserts or replaces `version` of
  // `name`; the version it replaces, if ready, is retired as by
  // RemoveVersion().
  void SetVersion(std::string_view name, ModelVersion version);
  // Takes `version` of `name` out of the index (and `name` with its last
  // version); requests holding it finish on it.
  void RemoveVersion(std::string_view name, int64_t version);

 private:
  void Retire(std::string_view name, const ModelVersion& version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::shared_ptr<const Index> index_ ABSL_GUARDED_BY(mu_) = std::make_shared<const Index>();
  struct Retired {
    std::string name;
    int64_t version;
    std::weak_ptr<const Model> model;
  };
  mutable std::vector<Retired> retired_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::server
