// test_gate.cc: the test-only gate of `gate` batches (see test_gate.h).
#include "server/dispatch/test_gate.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "absl/strings/str_cat.h"

namespace attention::server {
namespace {

// How often a waiting Pass() looks at the stop flag: the most it adds to a
// shutdown whose grace period ran out.
constexpr int kStopCheckIntervalMs = 100;

}  // namespace

absl::StatusOr<std::unique_ptr<TestGate>> TestGate::Open(const std::string& path) {
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("--test-gate-fifo ", path, ": cannot open: ", std::strerror(errno)));
  }
  return std::unique_ptr<TestGate>(new TestGate(fd));
}

TestGate::~TestGate() { close(fd_); }

Model TestGate::GateModel() {
  Model model = DotProductModel();
  model.name = std::string(kTestGateModelName);
  return model;
}

void TestGate::Pass() {
  while (!stopped_.load()) {
    pollfd ready = {.fd = fd_, .events = POLLIN, .revents = 0};
    const int polled = poll(&ready, 1, kStopCheckIntervalMs);
    if (polled < 0 && errno != EINTR) {
      throw std::runtime_error(absl::StrCat("test gate: poll failed: ", std::strerror(errno)));
    }
    if (polled <= 0) continue;
    char byte = 0;
    const ssize_t got = read(fd_, &byte, 1);
    if (got < 0 && errno == EINTR) continue;
    if (got != 1) {
      throw std::runtime_error(absl::StrCat("test gate: read failed: ", std::strerror(errno)));
    }
    if (byte == 'x') throw std::runtime_error("test gate: batch failed on request ('x')");
    return;
  }
  throw std::runtime_error("test gate: stopped by the shutdown");
}

void TestGate::Stop() { stopped_.store(true); }

}  // namespace attention::server
