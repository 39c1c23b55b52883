// thread_stack_floor.cc: gives every thread that asks for a small stack at
// least kStackFloor bytes.
//
// Why: glibc carves each thread's static TLS out of the stack the thread was
// given, and OpenBLAS (the engine's GEMM) holds 60 KiB of it. Debian's
// libcivetweb, the HTTP server inside prometheus-cpp's Exposer, is built to
// ask for 100 KiB worker stacks, which leaves its workers 40 KiB: too little
// for civetweb's error pages (404, 405...), so any request for something
// other than GET /metrics overflowed the stack and killed attention-server.
// Neither library lets us choose that size at run time, so the executable
// interposes the one call they make. Only sizes below the floor change.
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cstddef>

namespace {

constexpr std::size_t kStackFloor = 1 << 20;

using SetStackSize = int (*)(pthread_attr_t*, std::size_t);

SetStackSize LibcSetStackSize() {
  static const SetStackSize libc =
      reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  return libc;
}

}  // namespace

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, std::size_t size) {
  return LibcSetStackSize()(attr, std::max(size, kStackFloor));
}
