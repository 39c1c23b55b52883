// request_names.cc: caps and escaping (request_names.h).
#include "server/observability/request_names.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

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

}  // namespace attention::server
