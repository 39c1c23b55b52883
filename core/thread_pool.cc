// thread_pool.cc: ThreadPool over Eigen's non-blocking pool.
#include "core/thread_pool.h"

#define EIGEN_USE_THREADS
#include <unsupported/Eigen/CXX11/ThreadPool>

#include <algorithm>
#include <atomic>
#include <thread>

namespace attention {

class ThreadPool::Impl {
 public:
  explicit Impl(int workers) : pool(workers) {}
  Eigen::ThreadPool pool;
};

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(num_threads > 0 ? num_threads
                                   : std::max(1, static_cast<int>(std::thread::hardware_concurrency()))),
      impl_(num_threads_ > 1 ? std::make_unique<Impl>(num_threads_ - 1) : nullptr) {}

ThreadPool::~ThreadPool() = default;

void ThreadPool::ParallelFor(int64_t count, const std::function<void(int64_t)>& task) {
  if (count <= 0) return;
  if (!impl_ || count == 1) {
    for (int64_t i = 0; i < count; ++i) task(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto drain = [&] {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < count;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      task(i);
    }
  };
  const int helpers = static_cast<int>(std::min<int64_t>(num_threads_ - 1, count - 1));
  Eigen::Barrier done(helpers);
  for (int h = 0; h < helpers; ++h) {
    impl_->pool.Schedule([&] {
      drain();
      done.Notify();
    });
  }
  drain();
  done.Wait();
}

}  // namespace attention
