// poller.cc: the stability rule and the polling thread.
#include "server/repository/poller.h"

#include <string>
#include <utility>

#include "core/thread_name.h"
#include "spdlog/spdlog.h"

namespace attention::server {

StableListing::StableListing(RepositoryListing accepted)
    : accepted_(accepted), previous_scan_(std::move(accepted)) {}

const RepositoryListing& StableListing::Observe(const RepositoryListing& scan) {
  std::erase_if(accepted_, [&](const auto& file) { return !scan.contains(file.first); });
  for (const auto& [key, file] : scan) {
    const auto before = previous_scan_.find(key);
    if (before != previous_scan_.end() && before->second.signature == file.signature) {
      accepted_[key] = file;
    }
  }
  previous_scan_ = scan;
  return accepted_;
}

RepositoryPoller::RepositoryPoller(std::filesystem::path directory, absl::Duration interval,
                                   RepositoryListing initial, Apply apply)
    : directory_(std::move(directory)),
      interval_(interval),
      apply_(std::move(apply)),
      stable_(std::move(initial)),
      thread_([this] {
        NameCurrentThread("repo-poll");
        Loop();
      }) {}

RepositoryPoller::~RepositoryPoller() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void RepositoryPoller::Loop() {
  std::string last_error;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), interval_);
      if (stopping_) return;
    }
    absl::StatusOr<RepositoryListing> scan = ScanRepository(directory_);
    if (!scan.ok()) {
      // Once per distinct problem, not once a poll.
      if (std::string error(scan.status().message()); error != last_error) {
        spdlog::error("repository poll failed, the models served stay: {}", error);
        last_error = std::move(error);
      }
      continue;
    }
    last_error.clear();
    apply_(stable_.Observe(*scan));
  }
}

}  // namespace attention::server
