// refusal_log.cc: the refusal log limiter (refusal_log.h).
#include "server/observability/refusal_log.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attention::server {

std::string RefusalLogLimiter::SuppressedNote(int64_t suppressed, std::string_view what) {
  if (suppressed == 0) return "";
  return absl::StrCat(" (", suppressed, " more ", absl::string_view(what.data(), what.size()),
                      " not logged)");
}

bool RefusalLogLimiter::Admit(int64_t* suppressed) {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  if (now - window_start_ >= absl::Seconds(1)) {
    window_start_ = now;
    written_in_window_ = 0;
  }
  if (written_in_window_ >= per_second_) {
    ++suppressed_;
    return false;
  }
  ++written_in_window_;
  *suppressed = suppressed_;
  suppressed_ = 0;
  return true;
}

}  // namespace attention::server
