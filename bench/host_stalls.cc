// host_stalls: how often the machine itself stops running a thread, and for
// how long (a "hiccup meter"). One thread per CPU, pinned to it, reads the
// monotonic clock in a loop; any gap between two reads is time the thread did
// not run: another thread, an interrupt, a kernel thread (on the machines of
// this project, DAMON's kdamond wakes every 0.5 s), or the hypervisor taking
// the vCPU away. Those gaps put a floor under every latency tail measured on
// the machine, whatever server runs there, so bench/service_targets.py
// reports them beside its open-loop p99.
//
//   host-stalls [SECONDS (default 5)] [--json]
//
// Prints, per CPU, the gaps above 0.5, 1 and 2 ms, the longest, and the time
// lost in gaps above 0.2 ms; --json prints the same as one JSON object.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Gaps {
  int cpu = 0;
  long above_0_5_ms = 0, above_1_ms = 0, above_2_ms = 0;
  double longest_ms = 0, lost_ms = 0;
};

void PinTo(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Spins on `cpu` for `seconds`, recording every gap between clock reads.
Gaps Measure(int cpu, double seconds) {
  PinTo(cpu);
  Gaps gaps{.cpu = cpu};
  const Clock::time_point start = Clock::now();
  const Clock::time_point end = start + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(seconds));
  for (Clock::time_point last = start; last < end;) {
    const Clock::time_point now = Clock::now();
    const double gap_ms = std::chrono::duration<double, std::milli>(now - last).count();
    last = now;
    if (gap_ms <= 0.2) continue;
    gaps.lost_ms += gap_ms;
    gaps.above_0_5_ms += gap_ms > 0.5;
    gaps.above_1_ms += gap_ms > 1;
    gaps.above_2_ms += gap_ms > 2;
    gaps.longest_ms = std::max(gaps.longest_ms, gap_ms);
  }
  return gaps;
}

void Print(const std::vector<Gaps>& all, double seconds, bool json) {
  if (json) std::printf("{\"seconds\": %g, \"cpus\": [", seconds);
  for (size_t i = 0; i < all.size(); ++i) {
    const Gaps& g = all[i];
    if (json) {
      std::printf(
          "%s{\"cpu\": %d, \"above_0_5_ms\": %ld, \"above_1_ms\": %ld, \"above_2_ms\": %ld, "
          "\"longest_ms\": %.3f, \"lost_ms\": %.3f}",
          i ? ", " : "", g.cpu, g.above_0_5_ms, g.above_1_ms, g.above_2_ms, g.longest_ms,
          g.lost_ms);
    } else {
      std::printf(
          "cpu %d: %ld gaps > 0.5 ms, %ld > 1 ms, %ld > 2 ms; longest %.2f ms; %.1f ms lost in "
          "gaps > 0.2 ms over %g s\n",
          g.cpu, g.above_0_5_ms, g.above_1_ms, g.above_2_ms, g.longest_ms, g.lost_ms, seconds);
    }
  }
  if (json) std::printf("]}\n");
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 5;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (char* rest; (seconds = std::strtod(argv[i], &rest)) <= 0 || *rest != '\0') {
      std::fprintf(stderr, "usage: %s [SECONDS > 0] [--json]; got '%s'\n", argv[0], argv[i]);
      return 2;
    }
  }
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<Gaps> all(cpus);
  std::vector<std::thread> threads;
  for (int cpu = 0; cpu < cpus; ++cpu) {
    threads.emplace_back([&all, cpu, seconds] { all[cpu] = Measure(cpu, seconds); });
  }
  for (std::thread& thread : threads) thread.join();
  Print(all, seconds, json);
  return 0;
}
