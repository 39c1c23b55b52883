// fuzz_regression_test.cc: the fuzz targets' bodies on fixed inputs, in the
// ordinary build (and under ASan/UBSan in scripts/sanitize.sh).
//
// Replays, per target, the seeds made from the conformance data and every
// file in tests/fuzz/regressions/<target>/: inputs that once broke a target
// (crash-*, named after the fault they found; see RELIABILITY.md) and
// hand-made hostile ones (hostile-*). A broken property aborts with the
// FUZZ_CHECK message after the "replaying" line that names the input.
#include <cstdio>
#include <filesystem>
#include <string>

#include "gtest/gtest.h"
#include "tests/fuzz/seed_corpus.h"

namespace attention::fuzz {
namespace {

const std::filesystem::path kTestsDir = std::filesystem::path(ATTENTION_SOURCE_DIR) / "tests";

class FuzzRegressionTest : public ::testing::TestWithParam<std::string> {};

void Replay(const std::string& target, const std::vector<SeedInput>& inputs) {
  for (const SeedInput& input : inputs) {
    std::fprintf(stderr, "replaying %s/%s\n", target.c_str(), input.name.c_str());
    RunTarget(target, input.bytes);
  }
}

TEST_P(FuzzRegressionTest, ConformanceSeedsKeepEveryPromise) {
  const std::vector<SeedInput> seeds = ConformanceSeeds(GetParam(), kTestsDir / "conformance");
  ASSERT_GE(seeds.size(), 10u) << "the conformance data should give seeds for " << GetParam();
  Replay(GetParam(), seeds);
}

TEST_P(FuzzRegressionTest, PastCrashesAndHostileInputsKeepEveryPromise) {
  const std::vector<SeedInput> inputs =
      ReadDirectory(kTestsDir / "fuzz" / "regressions" / GetParam());
  ASSERT_FALSE(inputs.empty()) << "tests/fuzz/regressions/" << GetParam() << " is empty";
  Replay(GetParam(), inputs);
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzRegressionTest, ::testing::ValuesIn(TargetNames()));

}  // namespace
}  // namespace attention::fuzz
