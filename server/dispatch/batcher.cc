// batcher.cc: the batcher's out-of-line code: the wall clock it uses outside tests.
#include "server/dispatch/batcher.h"

namespace attention::server {
namespace {

class RealClock final : public BatcherClock {
 public:
  absl::Time Now() override { return absl::Now(); }
  void AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                         absl::Time deadline) override {
    mu.AwaitWithDeadline(condition, deadline);
  }
};

}  // namespace

BatcherClock* RealBatcherClock() {
  static BatcherClock* const clock = new RealClock();
  return clock;
}

}  // namespace attention::server
