// finite_test.cc: FirstNonFinite (core/kernels/finite.h) on every kernel path.
//
// Each path's scan is its own build of the loop; lengths on both sides of
// every vector width, with one inf, -inf or NaN at the front, inside and at
// the tail, must give that index, and all-finite data (the largest floats,
// denormals, negative zero) must give -1.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/kernels/finite.h"

namespace attention {
namespace {

TEST(FirstNonFinite, FindsTheFirstInfOrNaNAtEveryLengthAndPlace) {
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  const float good[] = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                        std::numeric_limits<float>::denorm_min(), -0.0f, 1.0f};
  for (size_t size = 0; size <= 70; ++size) {
    std::vector<float> data(size);
    for (size_t i = 0; i < size; ++i) data[i] = good[i % std::size(good)];
    ASSERT_EQ(FirstNonFinite(data), -1) << "size " << size;
    for (size_t at : {size_t{0}, size / 2, size - 1}) {
      if (at >= size) continue;
      for (float x : bad) {
        std::vector<float> with_bad = data;
        with_bad[at] = x;
        if (at + 1 < size) with_bad[size - 1] = x;  // a later one must not be reported
        EXPECT_EQ(FirstNonFinite(with_bad), static_cast<int64_t>(at))
            << "size " << size << " value " << x;
      }
    }
  }
}

}  // namespace
}  // namespace attention
