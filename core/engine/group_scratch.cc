// group_scratch.cc: a group's scratch and stacked inputs (group_scratch.h).
#include "core/engine/group_scratch.h"

#include <algorithm>

namespace attention::internal {

std::vector<float>& KeptScratch() {
  thread_local std::vector<float> kept;
  return kept;
}

const TensorView& QueriesOf(const ValidatedRequest& v) { return v.request->queries; }
const TensorView& KeysOf(const ValidatedRequest& v) { return ResolvedKeys(*v.request); }
const TensorView& ValuesOf(const ValidatedRequest& v) { return ResolvedValues(*v.request); }

int64_t StackedFloats(std::span<const ValidatedRequest> requests, TensorOf tensor_of) {
  if (requests.size() == 1) return 0;
  int64_t floats = 0;
  for (const ValidatedRequest& v : requests) floats += static_cast<int64_t>(tensor_of(v).data.size());
  return floats;
}

const float* StackRows(std::span<const ValidatedRequest> requests, TensorOf tensor_of,
                       float* destination) {
  if (requests.size() == 1) return tensor_of(requests[0]).data.data();
  float* next = destination;
  for (const ValidatedRequest& v : requests) {
    next = std::copy(tensor_of(v).data.begin(), tensor_of(v).data.end(), next);
  }
  return destination;
}

std::vector<int64_t> TokenOffsets(std::span<const ValidatedRequest> requests, bool keys) {
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const ValidatedRequest& v : requests) {
    offsets.push_back(total);
    total += v.dims.batch * (keys ? v.dims.num_keys : v.dims.num_queries);
  }
  offsets.push_back(total);
  return offsets;
}

}  // namespace attention::internal
