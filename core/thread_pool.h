// thread_pool.h: the engine's worker pool and its one parallel primitive.
//
// ParallelFor hands out task indices dynamically (an atomic counter), because
// attention tasks are uneven: a causal or short-valid-length block costs a
// fraction of a full one. The calling thread works too, so a pool of N
// threads plus the caller never idles a core while the caller waits.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

namespace attention {

class ThreadPool {
 public:
  // num_threads: total threads working on a ParallelFor, caller included;
  // 0 = one per hardware thread.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls task(i) for every i in [0, count), spread over the pool; returns
  // when all have run. Tasks must not throw. Calls from several threads share
  // the pool: each call's caller works through its own tasks, and returns
  // without waiting for workers busy with another call (thread_pool.cc).
  void ParallelFor(int64_t count, const std::function<void(int64_t)>& task);

 private:
  class Impl;
  int num_threads_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attention
