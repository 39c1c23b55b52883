// refusal_log.h: a bound on the lines that refused requests and calls write,
// so that a flood of bad requests costs a bounded number of log lines, with a
// count of what was left out.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attention::server {

// Lets through at most `lines_per_second` refusal lines each second (a burst
// of that many at once); counts the others.
class RefusalLogLimiter {
 public:
  explicit RefusalLogLimiter(int lines_per_second) : per_second_(lines_per_second) {}

  // Whether to write a line now; if so, `*suppressed` is the number of lines
  // left out since the previous one written (0 if none).
  bool Admit(int64_t* suppressed);

  // What ends a line written after `suppressed` others were left out:
  // " (N more <what> not logged)", or nothing when none were.
  static std::string SuppressedNote(int64_t suppressed, std::string_view what);

 private:
  const int per_second_;
  absl::Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int written_in_window_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace attention::server
