// probes.h: looking at a running attention-server from outside, as an
// operator would: its process (found by its listening port) and resident
// memory, its health, and raw HTTP and TCP to its ports.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace attention::testing {

// The process listening on TCP `address` (127.0.0.1:PORT), or nullopt.
std::optional<pid_t> ListeningProcess(const std::string& address);

// VmRSS of `pid` in bytes (0 when it cannot be read).
int64_t ResidentBytes(pid_t pid);

// VmHWM of `pid`, the most it has been resident since it started, in bytes
// (0 when it cannot be read).
int64_t PeakResidentBytes(pid_t pid);

// Whether this build (and so the server it starts) runs under ASan or TSan,
// whose shadow memory makes resident sizes and address-space limits say
// nothing about the server's own use: memory bounds are checked in the
// plain build (scripts/test.sh) only.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitizedBuild = true;
#else
inline constexpr bool kSanitizedBuild = false;
#endif

// The server's own answer to grpc.health.v1.Health/Check for "" ("SERVING",
// "NOT_SERVING"...), or the failed call's code name.
std::string HealthStatus(const std::shared_ptr<grpc::Channel>& channel);

// One HTTP/1.0 exchange with `address`: the status code of the reply (0 when
// there is none) and its body.
struct HttpReply {
  int status = 0;
  std::string body;
};
HttpReply HttpRequest(const std::string& address, const std::string& method,
                      const std::string& path);

// A plain TCP connection to `address`, closed by the destructor.
class TcpConnection {
 public:
  explicit TcpConnection(const std::string& address);
  ~TcpConnection();
  TcpConnection(const TcpConnection&) = delete;
  TcpConnection& operator=(const TcpConnection&) = delete;

  bool connected() const { return fd_ >= 0; }
  bool Send(const std::string& bytes);
  // Reads (appending to `received` unless null) until the peer closes the
  // connection: true then, false when 30 s pass without a byte or a close.
  bool ReadUntilClosed(std::string* received = nullptr);

 private:
  int fd_ = -1;
};

}  // namespace attention::testing
