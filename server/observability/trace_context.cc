// trace_context.cc: parsing traceparent and making new ids.
#include "server/observability/trace_context.h"

#include <cstdint>
#include <random>

#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

constexpr size_t kTraceparentSize = 55;  // "00-" + 32 + "-" + 16 + "-" + 2

bool IsLowerHex(std::string_view text) {
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool AllZero(std::string_view text) { return text.find_first_not_of('0') == std::string_view::npos; }

// `digits` random lowercase hex digits, never all zero.
std::string RandomHex(int digits) {
  thread_local std::mt19937_64 generator{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string text;
  do {
    text.clear();
    for (int i = 0; i < digits; i += 16) {
      uint64_t bits = generator();
      for (int j = 0; j < 16 && i + j < digits; ++j, bits >>= 4) text.push_back(kHex[bits & 15]);
    }
  } while (AllZero(text));
  return text;
}

bool IsValid(std::string_view header) {
  if (header.size() < kTraceparentSize) return false;
  const std::string_view version = header.substr(0, 2);
  const std::string_view trace_id = header.substr(3, 32);
  const std::string_view parent_id = header.substr(36, 16);
  const std::string_view flags = header.substr(53, 2);
  if (header[2] != '-' || header[35] != '-' || header[52] != '-') return false;
  if (!IsLowerHex(version) || version == "ff" || !IsLowerHex(trace_id) ||
      !IsLowerHex(parent_id) || !IsLowerHex(flags)) {
    return false;
  }
  if (AllZero(trace_id) || AllZero(parent_id)) return false;
  // Version 00 has exactly these fields; a later one may add more after '-'.
  if (version == "00") return header.size() == kTraceparentSize;
  return header.size() == kTraceparentSize || header[kTraceparentSize] == '-';
}

}  // namespace

std::string TraceContext::Traceparent() const {
  return absl::StrCat("00-", trace_id, "-", span_id, "-", flags);
}

TraceContext TraceFromTraceparent(std::string_view traceparent) {
  TraceContext trace;
  trace.span_id = RandomHex(16);
  if (IsValid(traceparent)) {
    trace.trace_id = std::string(traceparent.substr(3, 32));
    trace.parent_id = std::string(traceparent.substr(36, 16));
    trace.flags = std::string(traceparent.substr(53, 2));
  } else {
    trace.trace_id = RandomHex(32);
    trace.flags = "00";
  }
  return trace;
}

}  // namespace attention::server
