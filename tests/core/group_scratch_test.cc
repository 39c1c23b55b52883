// group_scratch_test.cc: the engine's kept buffers are lent to each run,
// not owned by the thread that calls it (core/engine/group_scratch.h), so a
// warm-up on one thread grows what a server's first call on another reads.
#include "core/engine/group_scratch.h"

#include <gtest/gtest.h>

#include <thread>

namespace attention::internal {
namespace {

// Grows the kept floats and pairs under a lease of `pool` on a thread of its
// own, and returns where they are.
std::pair<const float*, const uint32_t*> GrowOnAThread(ScratchPool& pool) {
  std::pair<const float*, const uint32_t*> where;
  std::thread([&] {
    const ScratchPool::Lease lease(pool);
    KeptScratch().resize(1 << 16);
    KeptBuffersOfThread().pairs.resize(1 << 12);
    where = {KeptScratch().data(), KeptBuffersOfThread().pairs.data()};
  }).join();
  return where;
}

TEST(ScratchPoolTest, ALeaseOnAnotherThreadGetsTheBuffersGrownBefore) {
  ScratchPool pool;
  const auto [floats, pairs] = GrowOnAThread(pool);
  // Named again for the lambda: clang 14 cannot capture structured bindings.
  std::thread([&, floats = floats, pairs = pairs] {
    const ScratchPool::Lease lease(pool);
    EXPECT_EQ(KeptScratch().size(), size_t{1} << 16);
    EXPECT_EQ(KeptScratch().data(), floats);
    EXPECT_EQ(KeptBuffersOfThread().pairs.data(), pairs);
  }).join();
}

TEST(ScratchPoolTest, WithoutALeaseAThreadHasItsOwn) {
  ScratchPool pool;
  GrowOnAThread(pool);
  std::thread([] { EXPECT_TRUE(KeptScratch().empty()); }).join();
}

TEST(ScratchPoolTest, LeasesHeldAtOnceGetDistinctBuffersAndEndInTurn) {
  ScratchPool pool;
  const auto [grown, pairs] = GrowOnAThread(pool);
  std::thread([&, grown = grown] {
    std::vector<float>& own = KeptScratch();
    {
      const ScratchPool::Lease outer(pool);
      EXPECT_EQ(KeptScratch().data(), grown);
      {
        const ScratchPool::Lease inner(pool);
        EXPECT_TRUE(KeptScratch().empty());  // the pool's only set is the outer lease's
      }
      EXPECT_EQ(KeptScratch().data(), grown);
    }
    EXPECT_EQ(&KeptScratch(), &own);
  }).join();
}

}  // namespace
}  // namespace attention::internal
