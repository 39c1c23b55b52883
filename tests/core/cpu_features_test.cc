// cpu_features_test.cc: path detection and selection (core/kernels/cpu_features.h),
// and the BLAS kernels matching the CPU (core/kernels/blas.h).
#include "core/kernels/cpu_features.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>

#include "core/kernels/blas.h"

namespace attention {
namespace {

using ::testing::HasSubstr;

// The CPU flags the kernel reports in /proc/cpuinfo: a second opinion on CPUID.
std::set<std::string> KernelCpuFlags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string flag; words >> flag;) flags.insert(flag);
    return flags;
  }
  return {};
}

// Restores ATTENTION_ISA and the active path when a test ends.
class EnvironmentGuard {
 public:
  EnvironmentGuard() {
    if (const char* value = std::getenv("ATTENTION_ISA")) saved_ = value;
  }
  ~EnvironmentGuard() {
    if (saved_.has_value()) {
      setenv("ATTENTION_ISA", saved_->c_str(), 1);
    } else {
      unsetenv("ATTENTION_ISA");
    }
    (void)SelectIsa(DetectedIsa());
  }

 private:
  std::optional<std::string> saved_;
};

TEST(CpuFeaturesTest, NamesRoundTrip) {
  for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    const absl::StatusOr<Isa> parsed = ParseIsa(IsaName(isa));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, isa);
  }
}

TEST(CpuFeaturesTest, UnknownNameIsRefusedNamingTheAcceptedOnes) {
  const absl::StatusOr<Isa> parsed = ParseIsa("avx512f");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(parsed.status().message(), HasSubstr("avx512_bf16, avx512, avx2, portable"));
  EXPECT_THAT(parsed.status().message(), HasSubstr("\"avx512f\""));
}

TEST(CpuFeaturesTest, DetectionAgreesWithTheKernelsCpuFlags) {
  const std::set<std::string> flags = KernelCpuFlags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this host";
  auto has = [&](const char* flag) { return flags.count(flag) > 0; };
  Isa expected = Isa::kPortable;
  if (has("avx2") && has("fma")) expected = Isa::kAvx2;
  if (expected == Isa::kAvx2 && has("avx512f") && has("avx512bw") && has("avx512vl") &&
      has("avx512dq")) {
    expected = Isa::kAvx512;
    if (has("avx512_bf16")) expected = Isa::kAvx512Bf16;
  }
  EXPECT_EQ(IsaName(DetectedIsa()), IsaName(expected));
}

TEST(CpuFeaturesTest, EverySupportedPathCanBeSelectedAndNoOther) {
  EnvironmentGuard guard;
  for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    const absl::Status status = SelectIsa(isa);
    if (isa <= DetectedIsa()) {
      ASSERT_TRUE(status.ok()) << status;
      EXPECT_EQ(ActiveIsa(), isa);
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(status.message(), HasSubstr(std::string(IsaName(isa))));
      EXPECT_THAT(status.message(), HasSubstr(std::string(IsaName(DetectedIsa()))));
    }
  }
}

TEST(CpuFeaturesTest, EnvironmentSelectsAPathOrSaysWhatIsWrong) {
  EnvironmentGuard guard;
  setenv("ATTENTION_ISA", "portable", 1);
  ASSERT_TRUE(SelectIsaFromEnvironment().ok());
  EXPECT_EQ(ActiveIsa(), Isa::kPortable);
  setenv("ATTENTION_ISA", "sse9", 1);
  const absl::Status bad = SelectIsaFromEnvironment();
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("ATTENTION_ISA"));
  EXPECT_THAT(bad.message(), HasSubstr("avx512_bf16, avx512, avx2, portable"));
  EXPECT_EQ(ActiveIsa(), Isa::kPortable) << "a refused value must not change the path";
}

TEST(BlasCoreTest, CoreNamesMapToPaths) {
  EXPECT_TRUE(BlasCoreMatches(Isa::kAvx512, "SkylakeX"));
  EXPECT_TRUE(BlasCoreMatches(Isa::kAvx512, "SapphireRapids"));
  EXPECT_FALSE(BlasCoreMatches(Isa::kAvx512, "Haswell"));
  EXPECT_FALSE(BlasCoreMatches(Isa::kAvx512, "Prescott"));
  EXPECT_TRUE(BlasCoreMatches(Isa::kAvx2, "Haswell"));
  EXPECT_TRUE(BlasCoreMatches(Isa::kAvx2, "Zen"));
  EXPECT_FALSE(BlasCoreMatches(Isa::kAvx2, "Prescott"));
  EXPECT_FALSE(BlasCoreMatches(Isa::kAvx2, "SkylakeX"));
}

// With nothing set, the BLAS runs the kernels of the CPU's best path, whether
// or not its table knows the CPU model (ATTENTION_ISA lowers the path).
TEST(BlasCoreTest, RunningCoreMatchesTheCpuFeatures) {
  if (BlasCoreForcedByCaller()) {
    GTEST_SKIP() << "OPENBLAS_CORETYPE=" << std::getenv("OPENBLAS_CORETYPE")
                 << " was set by the caller, and is obeyed";
  }
  Isa wanted = DetectedIsa();
  if (const char* value = std::getenv("ATTENTION_ISA")) {
    const absl::StatusOr<Isa> forced = ParseIsa(value);
    if (forced.ok() && *forced < wanted) wanted = *forced;
  }
  EXPECT_TRUE(BlasCoreMatches(wanted, BlasCoreName()))
      << "path " << IsaName(wanted) << ", BLAS core " << BlasCoreName()
      << ", OPENBLAS_CORETYPE=" << (std::getenv("OPENBLAS_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : "(unset)");
}

}  // namespace
}  // namespace attention
