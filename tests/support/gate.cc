// gate.cc: writing to the server's test gate FIFO.
#include "tests/support/gate.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/support/requests.h"

namespace attention::testing {

TestGate::TestGate() : fifo_((dir_.path() / "gate").string()) {
  ok_ = !dir_.path().empty() && mkfifo(fifo_.c_str(), 0600) == 0;
}

std::vector<std::string> TestGate::Flags(std::vector<std::string> flags) const {
  flags.insert(flags.end(), {"--test-gate-fifo", fifo_});
  return flags;
}

bool TestGate::Release(int batches) const { return Write(std::string(batches, '.')); }

bool TestGate::Fail() const { return Write("x"); }

bool TestGate::Write(const std::string& bytes) const {
  const int fd = open(fifo_.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + written, bytes.size() - written);
    if (n <= 0) break;
    written += static_cast<size_t>(n);
  }
  close(fd);
  return written == bytes.size();
}

v1::AttendRequest GateRequest(int batch, int n, int dim, int seed) {
  v1::AttendRequest request = SelfAttentionRequest(batch, n, dim, seed);
  request.set_model("gate");
  return request;
}

absl::StatusOr<std::unique_ptr<ServerProcess>> TestGate::StartWithConformanceModels(
    const std::vector<std::string>& flags) const {
  std::vector<std::string> all = {"--model-repository", ConformanceRepository().string(),
                                  "--strict"};
  all.insert(all.end(), flags.begin(), flags.end());
  return ServerProcess::Start(Flags(all));
}

}  // namespace attention::testing
