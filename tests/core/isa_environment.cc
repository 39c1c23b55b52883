// isa_environment.cc: runs a kernel test binary on the path ATTENTION_ISA
// names (core/kernels/cpu_features.h), so ctest can run the same tests once per path.
// On a host that lacks the path every test is skipped, with the reason in the
// log: the next host that has it runs them.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/kernels/cpu_features.h"

namespace attention {
namespace {

class IsaEnvironment : public testing::Environment {
 public:
  void SetUp() override {
    const char* value = std::getenv("ATTENTION_ISA");
    if (value == nullptr || *value == '\0') return;
    const absl::StatusOr<Isa> isa = ParseIsa(value);
    ASSERT_TRUE(isa.ok()) << isa.status();
    if (*isa > DetectedIsa()) {
      GTEST_SKIP() << "this host lacks the " << IsaName(*isa) << " path (it runs "
                   << IsaName(DetectedIsa()) << ")";
    }
    ASSERT_TRUE(SelectIsaFromEnvironment().ok());
    ASSERT_EQ(ActiveIsa(), *isa);
  }
};

// Registered before main, as gtest_main gives no other hook.
[[maybe_unused]] testing::Environment* const kIsaEnvironment =
    testing::AddGlobalTestEnvironment(new IsaEnvironment);

}  // namespace
}  // namespace attention
