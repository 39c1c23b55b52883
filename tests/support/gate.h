// gate.h: the server's test gate, for tests that must hold a request in the
// engine for as long as they need instead of sending one "big enough to be
// slow" (server/test_gate.h).
//
// With --test-gate-fifo the server has a model "gate" that answers exactly
// like dot_product, but each of its batches first waits for one byte on the
// FIFO: 'x' fails that batch (its requests get INTERNAL, as an engine
// exception would), any other byte lets it compute.
//
//   TestGate gate;
//   ASSERT_TRUE(gate.ok());
//   auto server = ServerProcess::Start(gate.Flags({"--max-batch-size", "1"}));
//   ... send GateRequest(...)s; they wait ...
//   gate.Release(3);  // the next three batches compute
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "attention.grpc.pb.h"
#include "tests/support/server_process.h"

namespace attention::testing {

class TestGate {
 public:
  // Makes the FIFO in a fresh temporary directory.
  TestGate();

  bool ok() const { return ok_; }
  const std::string& fifo() const { return fifo_; }
  // `flags` with --test-gate-fifo added.
  std::vector<std::string> Flags(std::vector<std::string> flags = {}) const;
  // A server with this gate, every conformance model (ConformanceRepository,
  // --strict) and `flags`.
  absl::StatusOr<std::unique_ptr<ServerProcess>> StartWithConformanceModels(
      const std::vector<std::string>& flags) const;

  // Lets the next `batches` batches of the model gate compute: true when the
  // bytes were written. The server holds the FIFO open, so this never blocks.
  bool Release(int batches = 1) const;
  // Fails the next batch of the model gate: its requests get INTERNAL.
  bool Fail() const;

 private:
  bool Write(const std::string& bytes) const;

  TempDir dir_;
  std::string fifo_;
  bool ok_ = false;
};

// SelfAttentionRequest (requests.h) for the model gate.
v1::AttendRequest GateRequest(int batch, int n, int dim, int seed);

}  // namespace attention::testing
