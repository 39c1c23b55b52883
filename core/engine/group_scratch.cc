// group_scratch.cc: a group's scratch and stacked inputs (group_scratch.h).
#include "core/engine/group_scratch.h"

#include <algorithm>

namespace attention::internal {

namespace {

// The calling thread's lease's buffers (ScratchPool::Lease), or null.
thread_local KeptBuffers* leased = nullptr;

}  // namespace

ScratchPool::Lease::Lease(ScratchPool& pool) : pool_(pool), previous_(leased) {
  {
    std::lock_guard<std::mutex> lock(pool_.mu_);
    if (!pool_.free_.empty()) {
      buffers_ = std::move(pool_.free_.back());
      pool_.free_.pop_back();
    }
  }
  if (buffers_ == nullptr) buffers_ = std::make_unique<KeptBuffers>();
  leased = buffers_.get();
}

ScratchPool::Lease::~Lease() {
  leased = previous_;
  std::lock_guard<std::mutex> lock(pool_.mu_);
  pool_.free_.push_back(std::move(buffers_));
}

int64_t ScratchPool::Bytes() {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t bytes = 0;
  for (const std::unique_ptr<KeptBuffers>& set : free_) {
    bytes += static_cast<int64_t>(set->floats.capacity() * sizeof(float) +
                                  set->pairs.capacity() * sizeof(uint32_t) +
                                  set->widened.capacity() * sizeof(float));
  }
  return bytes;
}

KeptBuffers& KeptBuffersOfThread() {
  thread_local KeptBuffers own;
  return leased != nullptr ? *leased : own;
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
