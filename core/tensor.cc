// tensor.cc: ShapeString.
#include "core/tensor.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attention {

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace attention
