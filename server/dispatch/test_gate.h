// test_gate.h: a gate that holds batches until a test releases them.
//
// FOR TESTS ONLY. Tests must not depend on timing ("a request big enough to
// be slow" is fast on one machine and slow on another), so with
// --test-gate-fifo PATH the server serves one more built-in model, `gate`,
// that answers exactly like `dot_product` but makes each of its batches wait,
// just before the engine computes it, for one byte from the FIFO at PATH
// (made by the test with mkfifo). Any byte releases one batch; 'x' makes that
// batch fail as an engine exception would (every request of it gets
// INTERNAL). Off by default; operators never need it.
//
//   $ mkfifo /tmp/gate && attention-server --test-gate-fifo /tmp/gate &
//   (a request to model "gate" now waits)
//   $ printf .  > /tmp/gate   # computes one batch
//   $ printf x  > /tmp/gate   # fails the next one with INTERNAL
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "core/model/model.h"

namespace attention::server {

// The model the gate holds.
inline constexpr std::string_view kTestGateModelName = "gate";

class TestGate {
 public:
  // Opens the FIFO at `path` read-write, so that opening never blocks and a
  // read waits for a byte instead of seeing end-of-file when no test holds
  // the FIFO open. NOT_FOUND when it cannot be opened.
  static absl::StatusOr<std::unique_ptr<TestGate>> Open(const std::string& path);
  ~TestGate();
  TestGate(const TestGate&) = delete;
  TestGate& operator=(const TestGate&) = delete;

  // The `gate` model: dot_product under another name.
  static Model GateModel();

  // Called by the batch loop before the engine computes a `gate` batch: waits
  // for one byte and throws std::runtime_error when it is 'x'. After Stop()
  // it throws at once, so the batch fails rather than computes.
  void Pass();
  // Ends every wait, the current one included (within 100 ms). Shutdown calls
  // it when its grace period ran out, so that a held batch cannot keep the
  // process alive. Thread-safe.
  void Stop();

 private:
  explicit TestGate(int fd) : fd_(fd) {}

  const int fd_;
  std::atomic<bool> stopped_{false};
};

}  // namespace attention::server
