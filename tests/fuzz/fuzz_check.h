// fuzz_check.h: FUZZ_CHECK, the assertion of the fuzz targets.
//
// Not assert(): it must also fire in the Release builds that run the
// regression test, and its message has to say which property broke.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(condition, ...)                                                    \
  do {                                                                                \
    if (!(condition)) {                                                               \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: ", __FILE__, __LINE__,      \
                   #condition);                                                       \
      std::fprintf(stderr, __VA_ARGS__);                                              \
      std::fprintf(stderr, "\n");                                                     \
      std::abort();                                                                   \
    }                                                                                 \
  } while (false)
