// poller.h: watching a repository directory for changed files.
//
// A file is taken only once it is complete: its signature (size, time,
// inode) must be the same in two consecutive scans, so a file still being
// copied in place is not read half-written; until then the version keeps its
// previous file (or, new, is not yet seen). A file that disappears is gone at
// once: nothing is copied by deleting. StableListing is that rule alone, with
// no thread or clock; RepositoryPoller runs it on its own thread every
// interval and hands each stable view to a callback (RepositoryManager::Sync).
//
//   RepositoryPoller poller(dir, absl::Seconds(5), initial_scan,
//                           [&](const RepositoryListing& view) { manager.Sync(view); });
#pragma once

#include <filesystem>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/repository/scan.h"

namespace attention::server {

class StableListing {
 public:
  // `accepted`: the files already taken (the start-up scan).
  explicit StableListing(RepositoryListing accepted);

  // Takes one scan; returns the files to serve from: those whose signature is
  // the same as in the previous scan at their current signature, the others
  // at the one accepted before (none, for a new file).
  const RepositoryListing& Observe(const RepositoryListing& scan);

 private:
  RepositoryListing accepted_;
  RepositoryListing previous_scan_;
};

class RepositoryPoller {
 public:
  using Apply = std::function<void(const RepositoryListing& stable)>;

  // Starts the thread: every `interval`, scans `directory` and calls `apply`
  // with the stable view. A failed scan (directory gone, unreadable) is
  // logged and changes nothing: an unmounted volume does not unload models.
  RepositoryPoller(std::filesystem::path directory, absl::Duration interval,
                   RepositoryListing initial, Apply apply);
  // Stops and joins the thread (after the poll under way, if any).
  ~RepositoryPoller();
  RepositoryPoller(const RepositoryPoller&) = delete;
  RepositoryPoller& operator=(const RepositoryPoller&) = delete;

 private:
  void Loop();

  const std::filesystem::path directory_;
  const absl::Duration interval_;
  const Apply apply_;
  StableListing stable_;  // the thread's only

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started last
};

}  // namespace attention::server
