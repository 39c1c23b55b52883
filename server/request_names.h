// request_names.h: what a client controls in log lines and error messages.
//
// `model` and `request_id` come from the wire: they are capped
// (kMaxNameBytes, refused beyond; docs/api.md, section 6.2) and always written
// through Printable(), so that newlines and terminal escapes cannot forge log
// lines and a huge name cannot make a huge line. Refusal log lines go through
// a RefusalLogLimiter, so that a flood of bad requests costs a bounded number
// of lines, with a count of what was left out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attention::server {

inline constexpr size_t kMaxNameBytes = 256;

// INVALID_ARGUMENT naming the field when `value` is longer than kMaxNameBytes.
absl::Status CheckNameLength(std::string_view field, std::string_view value);

// `value` with every byte outside printable ASCII (and `\`, `'`, `"`) as a C
// escape, cut after kMaxNameBytes input bytes with a note of the full length.
std::string Printable(std::string_view name);

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
