// request_names.h: what a client controls in log lines and error messages.
//
// `model` and `request_id` come from the wire: they are capped
// (kMaxNameBytes, refused beyond; docs/api.md, section 6.2) and always written
// through Printable(), so that newlines and terminal escapes cannot forge log
// lines and a huge name cannot make a huge line.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace attention::server {

inline constexpr size_t kMaxNameBytes = 256;

// INVALID_ARGUMENT naming the field when `value` is longer than kMaxNameBytes.
absl::Status CheckNameLength(std::string_view field, std::string_view value);

// `value` with every byte outside printable ASCII (and `\`, `'`, `"`) as a C
// escape, cut after kMaxNameBytes input bytes with a note of the full length.
std::string Printable(std::string_view name);

}  // namespace attention::server
