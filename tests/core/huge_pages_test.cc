// huge_pages_test.cc: large buffers grown through core/huge_pages.h keep
// the vector's contract (size, values) and, where the kernel offers
// transparent huge pages, are backed by them once touched.
#include "core/huge_pages.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace attention {
namespace {

// The kernel's transparent huge page mode: "always", "madvise" or "never"
// (the bracketed word of the sysfs file), or "" where there is none.
std::string HugePageMode() {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const size_t open = text.find('['), close = text.find(']');
  if (open == std::string::npos || close == std::string::npos) return "";
  return text.substr(open + 1, close - open - 1);
}

// kB of huge pages in the mapping of /proc/self/smaps that holds `address`.
int64_t AnonHugePagesKbAt(const void* address) {
  const auto where = reinterpret_cast<uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> begin >> dash >> end && dash == '-') {
      inside = begin <= where && where < end;
      continue;
    }
    if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      return std::stoll(line.substr(line.find_first_of("0123456789")));
    }
  }
  return -1;
}

TEST(HugePagesTest, AssignGivesCountCopiesOfTheValueSmallOrLarge) {
  for (size_t count : {size_t{3}, size_t{3} << 20}) {
    std::vector<float> buffer = {1, 2};
    AssignOnHugePages(buffer, count, 0.5f);
    ASSERT_EQ(buffer.size(), count);
    EXPECT_EQ(buffer.front(), 0.5f);
    EXPECT_EQ(buffer.back(), 0.5f);
  }
}

TEST(HugePagesTest, GrowNeverShrinksAndReachesTheCount) {
  std::vector<uint32_t> buffer(10, 7);
  GrowOnHugePages(buffer, 5);
  EXPECT_EQ(buffer.size(), 10u);
  EXPECT_EQ(buffer[9], 7u);  // not regrown: contents stay
  GrowOnHugePages(buffer, size_t{4} << 20);
  EXPECT_EQ(buffer.size(), size_t{4} << 20);
}

TEST(HugePagesTest, ALargeBufferIsBackedByHugePagesWhereTheKernelOffersThem) {
  const std::string mode = HugePageMode();
  if (mode != "always" && mode != "madvise") {
    GTEST_SKIP() << "transparent huge pages are '" << mode << "' on this kernel";
  }
  std::vector<float> buffer;
  AssignOnHugePages(buffer, size_t{16} << 20, 1.0f);  // 64 MiB, touched
  EXPECT_GT(AnonHugePagesKbAt(buffer.data() + buffer.size() / 2), 0)
      << "no huge page backs the middle of a 64 MiB buffer (mode " << mode << ")";
}

}  // namespace
}  // namespace attention
