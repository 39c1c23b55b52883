// request_names.cc: caps, escaping and the refusal log limiter (request_names.h).
#include "server/request_names.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace attention::server {

absl::Status CheckNameLength(std::string_view field, std::string_view value) {
  if (value.size() <= kMaxNameBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(absl::string_view(field.data(), field.size()),
                                                 ": expected at most ", kMaxNameBytes,
                                                 " bytes, got ", value.size()));
}

std::string Printable(std::string_view name) {
  // Debian's Abseil has its own string_view type.
  const absl::string_view value(name.data(), name.size());
  if (value.size() <= kMaxNameBytes) return absl::CHexEscape(value);
  return absl::StrCat(absl::CHexEscape(value.substr(0, kMaxNameBytes)), "...(", value.size(),
                      " bytes)");
}

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
