// thread_pool_test.cc: ParallelFor calls from several threads share the
// pool fairly. A call must not wait for a worker that is busy with another
// call's long tasks: without it, the batcher of one model waited until
// another model's budget-sized batch finished (p99 of small requests
// 2.4 s instead of 8 ms, RELIABILITY.md section 9). Its workers carry the
// name "engine", for profiles (core/thread_name.h).
#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "core/thread_name.h"
#include "core/thread_pool.h"

namespace attention {
namespace {

using std::chrono::seconds;

std::string CurrentThreadName() {
  char name[16] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  return name;
}

TEST(ThreadName, NamesTheCallingThreadCutToFifteenBytes) {
  std::thread([] {
    NameCurrentThread("batch:a-model-with-a-long-name");
    EXPECT_EQ(CurrentThreadName(), "batch:a-model-w");
    NameCurrentThread("answer");
    EXPECT_EQ(CurrentThreadName(), "answer");
  }).join();
}

TEST(ThreadPool, WorkersAreNamedEngine) {
  ThreadPool pool(2);
  std::thread([&] {
    NameCurrentThread("caller");
    std::atomic<int> started{0};
    std::mutex mu;
    std::set<std::string> names;
    // Each task waits for the other, so one runs on the caller, one on the worker.
    pool.ParallelFor(2, [&](int64_t) {
      ++started;
      while (started.load() < 2) std::this_thread::yield();
      std::lock_guard<std::mutex> lock(mu);
      names.insert(CurrentThreadName());
    });
    EXPECT_EQ(names, (std::set<std::string>{"caller", "engine"}));
  }).join();
}

TEST(ThreadPool, CallReturnsWhileWorkersAreBusyWithAnotherCall) {
  ThreadPool pool(2);  // the caller and one worker
  std::atomic<int> long_started{0};
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  // Two long tasks: one on its caller, one on the pool's only worker.
  std::thread long_call([&] {
    pool.ParallelFor(2, [&](int64_t) {
      ++long_started;
      released.wait();
    });
  });
  while (long_started.load() < 2) std::this_thread::yield();

  std::atomic<int> short_ran{0};
  std::future<void> short_call = std::async(std::launch::async, [&] {
    pool.ParallelFor(4, [&](int64_t) { ++short_ran; });
  });
  const bool returned = short_call.wait_for(seconds(10)) == std::future_status::ready;
  EXPECT_TRUE(returned) << "the short call waited for the worker held by the long one";
  release.set_value();
  long_call.join();
  short_call.wait();
  EXPECT_EQ(short_ran.load(), 4);
}

TEST(ThreadPool, EveryIndexRunsOnceUnderConcurrentCalls) {
  ThreadPool pool(3);
  constexpr int kCalls = 8, kCount = 1000;
  std::vector<std::vector<std::atomic<int>>> runs(kCalls);
  for (auto& r : runs) r = std::vector<std::atomic<int>>(kCount);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCalls; ++c) {
    callers.emplace_back([&, c] {
      for (int repeat = 0; repeat < 20; ++repeat) {
        pool.ParallelFor(kCount, [&](int64_t i) { ++runs[c][i]; });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (int c = 0; c < kCalls; ++c) {
    for (int i = 0; i < kCount; ++i) ASSERT_EQ(runs[c][i].load(), 20) << "call " << c << " index " << i;
  }
}

}  // namespace
}  // namespace attention
