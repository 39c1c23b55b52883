// probes.cc: process, memory, health, HTTP and TCP probes of a server.
#include "tests/support/probes.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "health.grpc.pb.h"
#include "tests/support/server_process.h"

namespace attention::testing {
namespace {

bool SplitAddress(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  *host = address.substr(0, colon);
  return absl::SimpleAtoi(address.substr(colon + 1), port);
}

int Connect(const std::string& address) {
  std::string host;
  int port = 0;
  if (!SplitAddress(address, &host, &port)) return -1;
  sockaddr_in peer{};
  peer.sin_family = AF_INET;
  peer.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &peer.sin_addr) != 1) return -1;
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  timeval timeout{.tv_sec = 30, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  if (connect(fd, reinterpret_cast<const sockaddr*>(&peer), sizeof peer) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Inode of the listening socket on `port` in /proc/net/tcp or tcp6 (gRPC
// listens on IPv6 sockets that also take IPv4), "" if none.
std::string ListeningInode(int port) {
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream table(path);
    std::string line;
    std::getline(table, line);  // header
    while (std::getline(table, line)) {
      std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
      // sl local_address rem_address st ... inode (field 9); st 0A = LISTEN.
      if (fields.size() < 10 || fields[3] != "0A") continue;
      const std::string& local = fields[1];
      int local_port = 0;
      if (!absl::SimpleHexAtoi(local.substr(local.find(':') + 1), &local_port)) continue;
      if (local_port == port) return fields[9];
    }
  }
  return "";
}

// The `field` line of /proc/<pid>/status (e.g. "VmRSS:"), in bytes; 0 when
// it cannot be read.
int64_t StatusBytes(pid_t pid, const std::string& field) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (!line.starts_with(field)) continue;
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    int64_t kib = 0;
    if (fields.size() >= 2 && absl::SimpleAtoi(fields[1], &kib)) return kib * 1024;
  }
  return 0;
}

}  // namespace

std::optional<pid_t> ListeningProcess(const std::string& address) {
  std::string host;
  int port = 0;
  if (!SplitAddress(address, &host, &port)) return std::nullopt;
  const std::string inode = ListeningInode(port);
  if (inode.empty()) return std::nullopt;
  const std::string socket = "socket:[" + inode + "]";
  std::error_code error;
  for (const auto& process : std::filesystem::directory_iterator("/proc", error)) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(process.path().filename().string(), &pid)) continue;
    for (const auto& fd : std::filesystem::directory_iterator(process.path() / "fd", error)) {
      if (std::filesystem::read_symlink(fd.path(), error).string() == socket) return pid;
    }
  }
  return std::nullopt;
}

int64_t ResidentBytes(pid_t pid) { return StatusBytes(pid, "VmRSS:"); }

int64_t PeakResidentBytes(pid_t pid) { return StatusBytes(pid, "VmHWM:"); }

std::string HealthStatus(const std::shared_ptr<grpc::Channel>& channel) {
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status =
      health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
  if (!status.ok()) return CodeName(status.error_code());
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
}

HttpReply HttpRequest(const std::string& address, const std::string& method,
                      const std::string& path) {
  HttpReply reply;
  TcpConnection connection(address);
  if (!connection.connected()) return reply;
  if (!connection.Send(absl::StrCat(method, " ", path, " HTTP/1.0\r\nHost: ", address,
                                    "\r\nConnection: close\r\n\r\n"))) {
    return reply;
  }
  std::string received;
  connection.ReadUntilClosed(&received);
  // "HTTP/1.x NNN reason\r\n...headers...\r\n\r\nbody"
  const size_t space = received.find(' ');
  if (!received.starts_with("HTTP/") || space == std::string::npos ||
      !absl::SimpleAtoi(received.substr(space + 1, 3), &reply.status)) {
    return reply;
  }
  const size_t body = received.find("\r\n\r\n");
  if (body != std::string::npos) reply.body = received.substr(body + 4);
  return reply;
}

TcpConnection::TcpConnection(const std::string& address) : fd_(Connect(address)) {}

TcpConnection::~TcpConnection() {
  if (fd_ >= 0) close(fd_);
}

bool TcpConnection::Send(const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

bool TcpConnection::ReadUntilClosed(std::string* received) {
  char buffer[4096];
  while (true) {
    const ssize_t n = recv(fd_, buffer, sizeof buffer, 0);
    if (n == 0) return true;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK;  // a reset closes too
    if (received != nullptr) received->append(buffer, static_cast<size_t>(n));
  }
}

}  // namespace attention::testing
