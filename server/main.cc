// main.cc: attention-server, the gRPC attention inference service.
#include <malloc.h>

#include "CLI/CLI.hpp"
#include "absl/synchronization/mutex.h"
#include "server/run_server.h"
#include "server/config/server_config.h"
#include "server/config/server_flags.h"

int main(int argc, char** argv) {
  // Every engine execution allocates and frees its scratch (megabytes for a
  // batch). glibc's defaults hand such blocks back to the kernel on free
  // (mmap, or heap trimming past 2x the mmap threshold), so the next batch
  // page-faults them in again: a third of a batched server's CPU time. Keep
  // them in the heap; blocks above 32 MiB (glibc's own ceiling for the
  // threshold) are still mapped and unmapped.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
  // Debian builds Abseil without NDEBUG, which turns on absl::Mutex's
  // lock-order graph: every Lock of every mutex (gRPC's included) then
  // updates a process-wide graph under one spinlock: 5% of the samples of a
  // server answering trivial requests, and a sixth of its CPU per answer
  // (BENCHMARKS.md, "Where the per-call time goes"). Lock-order bugs are
  // TSan's job (scripts/sanitize.sh tsan), not the production server's.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  attention::server::ServerConfig config;
  CLI::App app{
      "attention-server: serves attention models over gRPC (attention.v1.AttentionService).\n"
      "Every flag can also be set as ATTENTION_<FLAG> (e.g. ATTENTION_MAX_BATCH_SIZE); a flag on "
      "the command line wins."};
  attention::server::AddServerFlags(app, &config);
  CLI11_PARSE(app, argc, argv);
  return attention::server::RunServer(config);
}
