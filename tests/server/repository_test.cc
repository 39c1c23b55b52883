// repository_test.cc: the live model repository without gRPC: the registry
// (versions, resolution, unloading versions), the directory scan (layout and
// ignored names), the stability rule of the poller, the manager's
// load-then-swap and version policies, and the poller's thread.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/model/model.h"
#include "server/repository/manager.h"
#include "server/repository/poller.h"
#include "server/repository/registry.h"
#include "server/repository/scan.h"
#include "tests/support/files.h"
#include "tests/support/safetensors_builder.h"
#include "tests/support/server_process.h"

namespace attention::server {
namespace {

namespace fs = std::filesystem;
using ::attention::testing::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A bilinear model whose W_k is `factor` x identity (2 x 2): its answers
// tell the factor, hence which file served them.
std::string BilinearBytes(float factor) {
  const std::vector<uint8_t> bytes = testing::BuildFile(
      {testing::F32Tensor("W_k.weight", {2, 2}, {factor, 0, 0, factor})}, {{"kind", "bilinear"}});
  return std::string(bytes.begin(), bytes.end());
}

float Factor(const Model& model) { return model.w_k(0, 0); }

std::shared_ptr<const Model> Named(std::string name) {
  Model model = DotProductModel();
  model.name = std::move(name);
  return std::make_shared<const Model>(std::move(model));
}

TEST(RegistryTest, ResolvesTheNewestReadyVersionOrTheOneAskedFor) {
  ModelRegistry registry;
  ASSERT_TRUE(registry.AddBuiltIn(DotProductModel()).ok());
  EXPECT_EQ(registry.AddBuiltIn(DotProductModel()).code(), absl::StatusCode::kAlreadyExists);
  registry.SetVersion("m", {.version = 1, .state = VersionState::kReady, .reason = {},
                            .model = Named("m1")});
  registry.SetVersion("m", {.version = 3, .state = VersionState::kFailed, .reason = "bad bytes",
                            .model = nullptr});
  registry.SetVersion("m", {.version = 2, .state = VersionState::kReady, .reason = {},
                            .model = Named("m2")});

  absl::StatusOr<ServedModel> newest = registry.Resolve("m", std::nullopt);
  ASSERT_TRUE(newest.ok()) << newest.status();
  EXPECT_EQ(newest->version, 2);
  EXPECT_EQ(newest->model->name, "m2");
  absl::StatusOr<ServedModel> first = registry.Resolve("m", 1);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->model->name, "m1");

  absl::StatusOr<ServedModel> failed = registry.Resolve("m", 3);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(failed.status().message(), HasSubstr("no version 3 ready; versions served: 1, 2"));
  EXPECT_EQ(registry.Resolve("nothing", std::nullopt).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.Resolve("dot_product", 1).ok());

  const auto index = registry.snapshot();
  std::vector<int64_t> versions;
  for (const ModelVersion& v : index->at("m").versions) versions.push_back(v.version);
  EXPECT_THAT(versions, ElementsAre(1, 2, 3));
}

TEST(RegistryTest, ARemovedVersionIsUnloadingWhileARequestHoldsIt) {
  ModelRegistry registry;
  registry.SetVersion("m", {.version = 1, .state = VersionState::kReady, .reason = {},
                            .model = Named("m")});
  absl::StatusOr<ServedModel> held = registry.Resolve("m", std::nullopt);
  ASSERT_TRUE(held.ok());
  const std::weak_ptr<const Model> weights = held->model;
  registry.RemoveVersion("m", 1);

  EXPECT_EQ(registry.Resolve("m", std::nullopt).status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(registry.snapshot()->contains("m"));
  // The request admitted before still computes on its weights.
  EXPECT_EQ(held->model->name, "m");
  auto unloading = registry.Unloading();
  ASSERT_EQ(unloading.size(), 1u);
  EXPECT_EQ(unloading[0].first, "m");
  EXPECT_EQ(unloading[0].second.state, VersionState::kUnloading);

  *held = ServedModel{};  // the request is answered
  EXPECT_TRUE(weights.expired()) << "the registry kept the removed weights alive";
  EXPECT_TRUE(registry.Unloading().empty());
}

TEST(RegistryTest, BuiltInsAreNeverRemoved) {
  ModelRegistry registry;
  ASSERT_TRUE(registry.AddBuiltIn(DistanceModel()).ok());
  registry.RemoveVersion("distance", 1);
  EXPECT_TRUE(registry.Resolve("distance", std::nullopt).ok());
}

TEST(ScanTest, ReadsFlatFilesAndVersionDirectoriesAndIgnoresWorkInProgress) {
  TempDir dir;
  const fs::path root = dir.path();
  testing::WriteFile(root / "flat.safetensors", "x");
  testing::WriteFile(root / ".hidden.safetensors", "x");
  testing::WriteFile(root / "copying.safetensors.tmp", "x");
  testing::WriteFile(root / "notes.txt", "x");
  fs::create_directory(root / "versioned");
  for (const char* file : {"1.safetensors", "12.safetensors", "012.safetensors", "0.safetensors",
                           "x.safetensors", ".3.safetensors", "4.safetensors.tmp"}) {
    testing::WriteFile(root / "versioned" / file, "abc");
  }
  // Both give version 1 of `both`: the directory's file wins.
  testing::WriteFile(root / "both.safetensors", "flat");
  fs::create_directory(root / "both");
  testing::WriteFile(root / "both" / "1.safetensors", "directory");

  absl::StatusOr<RepositoryListing> listing = ScanRepository(root);
  ASSERT_TRUE(listing.ok()) << listing.status();
  std::vector<std::string> keys;
  for (const auto& [key, file] : *listing) {
    keys.push_back(key.first + "/" + std::to_string(key.second));
  }
  EXPECT_THAT(keys, ElementsAre("both/1", "flat/1", "versioned/1", "versioned/12"));
  EXPECT_EQ(listing->at({"both", 1}).path, root / "both" / "1.safetensors");
  EXPECT_EQ(listing->at({"versioned", 12}).signature.size, 3u);

  EXPECT_EQ(ScanRepository(root / "missing").status().code(), absl::StatusCode::kNotFound);
}

ModelFile File(const std::string& name, int64_t version, uint64_t size) {
  return ModelFile{.name = name, .version = version, .path = name,
                   .signature = FileSignature{.size = size, .mtime_ns = 0, .inode = 1}};
}

TEST(StableListingTest, TakesAFileOnlyOnceItIsUnchangedOverOneScan) {
  RepositoryListing start{{{"a", 1}, File("a", 1, 10)}};
  StableListing stable(start);

  // A new file, still growing: not taken.
  RepositoryListing scan = start;
  scan[{"b", 1}] = File("b", 1, 5);
  EXPECT_FALSE(stable.Observe(scan).contains({"b", 1}));
  scan[{"b", 1}] = File("b", 1, 9);
  EXPECT_FALSE(stable.Observe(scan).contains({"b", 1}));
  // Unchanged over one scan: taken.
  EXPECT_EQ(stable.Observe(scan).at({"b", 1}).signature.size, 9u);

  // A file being rewritten keeps its previous accepted signature meanwhile.
  scan[{"a", 1}] = File("a", 1, 11);
  EXPECT_EQ(stable.Observe(scan).at({"a", 1}).signature.size, 10u);
  EXPECT_EQ(stable.Observe(scan).at({"a", 1}).signature.size, 11u);

  // A removed file is gone at once.
  scan.erase({"a", 1});
  EXPECT_FALSE(stable.Observe(scan).contains({"a", 1}));
}

class ManagerTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(registry_.AddBuiltIn(DotProductModel()).ok()); }

  std::unique_ptr<RepositoryManager> Manager(VersionPolicy policy, bool force_fp32 = false) {
    return std::make_unique<RepositoryManager>(
        &registry_, nullptr,
        RepositoryOptions{.directory = dir_.path(), .policy = policy, .force_fp32 = force_fp32});
  }
  RepositoryManager::Report Sync(RepositoryManager& manager) {
    absl::StatusOr<RepositoryListing> listing = ScanRepository(dir_.path());
    EXPECT_TRUE(listing.ok()) << listing.status();
    return manager.Sync(*listing);
  }
  // The factor of the version served for `name` (nullopt: newest); NaN when
  // none is.
  float Served(const std::string& name, std::optional<int64_t> version = std::nullopt) {
    absl::StatusOr<ServedModel> served = registry_.Resolve(name, version);
    return served.ok() ? Factor(*served->model) : std::nanf("");
  }
  void Write(const fs::path& relative, const std::string& bytes) {
    fs::create_directories((dir_.path() / relative).parent_path());
    testing::ReplaceFile(dir_.path() / relative, bytes);
  }

  TempDir dir_;
  ModelRegistry registry_;
};

TEST_F(ManagerTest, ReplacesAChangedFileAndKeepsServingWhenTheReplacementIsBad) {
  auto manager = Manager(VersionPolicy::kLatest);
  Write("a.safetensors", BilinearBytes(1));
  EXPECT_TRUE(Sync(*manager).failures.empty());
  EXPECT_EQ(Served("a"), 1);
  absl::StatusOr<ServedModel> before = registry_.Resolve("a", std::nullopt);

  Write("a.safetensors", BilinearBytes(2));
  EXPECT_TRUE(Sync(*manager).failures.empty());
  EXPECT_EQ(Served("a"), 2);
  EXPECT_EQ(Factor(*before->model), 1) << "a request admitted before must keep its weights";

  Write("a.safetensors", BilinearBytes(3).substr(0, 20));
  RepositoryManager::Report report = Sync(*manager);
  ASSERT_EQ(report.failures.size(), 1u);
  EXPECT_THAT(report.failures[0].message(), HasSubstr("a.safetensors"));
  EXPECT_EQ(Served("a"), 2) << "a bad replacement must leave the previous weights serving";
  const ModelVersion& version = registry_.snapshot()->at("a").versions.at(0);
  EXPECT_EQ(version.state, VersionState::kReady);
  EXPECT_THAT(version.reason, HasSubstr("reload failed"));
  // The same bad file is not read (nor reported) again until it changes.
  EXPECT_TRUE(Sync(*manager).failures.empty());

  fs::remove(dir_.path() / "a.safetensors");
  Sync(*manager);
  EXPECT_TRUE(std::isnan(Served("a")));
  EXPECT_FALSE(registry_.snapshot()->contains("a"));
}

TEST_F(ManagerTest, LatestServesTheNewestVersionOnceItIsReady) {
  auto manager = Manager(VersionPolicy::kLatest);
  Write("m/1.safetensors", BilinearBytes(1));
  Sync(*manager);
  EXPECT_EQ(Served("m"), 1);

  // A broken newest version: the older one stays.
  Write("m/2.safetensors", "not a model");
  EXPECT_EQ(Sync(*manager).failures.size(), 1u);
  EXPECT_EQ(Served("m"), 1);
  EXPECT_EQ(registry_.snapshot()->at("m").Find(2)->state, VersionState::kFailed);

  Write("m/2.safetensors", BilinearBytes(2));
  Sync(*manager);
  EXPECT_EQ(Served("m"), 2);
  EXPECT_TRUE(std::isnan(Served("m", 1))) << "latest serves one version";
}

TEST_F(ManagerTest, LatestFallsBackToAnOlderFileWhenTheNewestDoesNotLoad) {
  auto manager = Manager(VersionPolicy::kLatest);
  Write("m/1.safetensors", BilinearBytes(1));
  Write("m/2.safetensors", BilinearBytes(2));
  Write("m/3.safetensors", "not a model");
  EXPECT_EQ(Sync(*manager).failures.size(), 1u);
  EXPECT_EQ(Served("m"), 2);
  EXPECT_TRUE(std::isnan(Served("m", 1))) << "only the newest version that loads is served";

  Write("m/3.safetensors", BilinearBytes(3));
  EXPECT_TRUE(Sync(*manager).failures.empty());
  EXPECT_EQ(Served("m"), 3);
  EXPECT_TRUE(std::isnan(Served("m", 2)));
}

TEST_F(ManagerTest, AllServesEveryVersion) {
  auto manager = Manager(VersionPolicy::kAll);
  Write("m/1.safetensors", BilinearBytes(1));
  Write("m/2.safetensors", BilinearBytes(2));
  Sync(*manager);
  EXPECT_EQ(Served("m"), 2);
  EXPECT_EQ(Served("m", 1), 1);
  EXPECT_EQ(Served("m", 2), 2);
  fs::remove(dir_.path() / "m" / "2.safetensors");
  Sync(*manager);
  EXPECT_EQ(Served("m"), 1);
}

TEST_F(ManagerTest, AFileNamedAfterABuiltInIsRefusedOnce) {
  auto manager = Manager(VersionPolicy::kLatest);
  Write("dot_product.safetensors", BilinearBytes(1));
  RepositoryManager::Report report = Sync(*manager);
  ASSERT_EQ(report.failures.size(), 1u);
  EXPECT_THAT(report.failures[0].message(), HasSubstr("taken by a built-in model"));
  EXPECT_TRUE(Sync(*manager).failures.empty());
  EXPECT_EQ(registry_.snapshot()->at("dot_product").versions.size(), 1u);
}

// --force-fp32: a bf16 file loads as fp32, and its reload report says so.
TEST_F(ManagerTest, ForcedFp32LoadsBf16FilesAsFp32) {
  const std::vector<uint8_t> bytes = testing::BuildFile(
      {testing::F32Tensor("in_proj_weight", {6, 2}, std::vector<float>(12, 0.5f)),
       testing::F32Tensor("out_proj.weight", {2, 2}, {1, 0, 0, 1})},
      {{"kind", "multi_head"}, {"num_heads", "1"}, {"precision", "bf16"}});
  Write("m.safetensors", std::string(bytes.begin(), bytes.end()));
  for (bool forced : {false, true}) {
    auto manager = Manager(VersionPolicy::kLatest, forced);
    const RepositoryManager::Report report = Sync(*manager);
    ASSERT_EQ(report.changes.size(), 1u);
    EXPECT_THAT(report.changes[0], HasSubstr(forced ? "precision fp32" : "precision bf16"));
    absl::StatusOr<ServedModel> served = registry_.Resolve("m", std::nullopt);
    ASSERT_TRUE(served.ok()) << served.status();
    EXPECT_EQ(served->model->precision, forced ? Precision::kFp32 : Precision::kBf16);
    ASSERT_TRUE(manager->UnloadModel("m").ok());
  }
}

TEST_F(ManagerTest, AnExplicitUnloadHoldsUntilAnExplicitLoad) {
  auto manager = Manager(VersionPolicy::kLatest);
  Write("a.safetensors", BilinearBytes(1));
  Sync(*manager);
  ASSERT_TRUE(manager->UnloadModel("a").ok());
  EXPECT_TRUE(std::isnan(Served("a")));
  Sync(*manager);
  EXPECT_TRUE(std::isnan(Served("a"))) << "the poller must not bring back an unloaded model";

  ASSERT_TRUE(manager->LoadModel("a").ok());
  EXPECT_EQ(Served("a"), 1);

  EXPECT_EQ(manager->UnloadModel("dot_product").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(manager->LoadModel("dot_product").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(manager->UnloadModel("nothing").code(), absl::StatusCode::kNotFound);
  const absl::Status missing = manager->LoadModel("nothing");
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("nothing.safetensors"));
  Write("broken.safetensors", "not a model");
  const absl::Status broken = manager->LoadModel("broken");
  EXPECT_FALSE(broken.ok());
  EXPECT_THAT(broken.message(), HasSubstr("broken.safetensors"));
}

TEST(PollerTest, HandsEachStableViewToItsCallback) {
  TempDir dir;
  absl::Mutex mu;
  std::vector<size_t> sizes;
  {
    RepositoryPoller poller(dir.path(), absl::Milliseconds(20), {},
                            [&](const RepositoryListing& stable) {
                              absl::MutexLock lock(&mu);
                              sizes.push_back(stable.size());
                            });
    testing::WriteFile(dir.path() / "a.safetensors", "x");
    absl::MutexLock lock(&mu);
    auto seen = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return !sizes.empty() && sizes.back() == 1;
    };
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&seen), absl::Seconds(10)));
  }
  // Destroyed: the thread is joined and calls no more.
  absl::MutexLock lock(&mu);
  const size_t calls = sizes.size();
  mu.Unlock();
  absl::SleepFor(absl::Milliseconds(60));
  mu.Lock();
  EXPECT_EQ(sizes.size(), calls);
}

}  // namespace
}  // namespace attention::server
