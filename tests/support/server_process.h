// server_process.h: a real attention-server process for tests.
//
// The server binary is started on 127.0.0.1 port 0 (and metrics and REST
// likewise); the bound ports come back through --port-file. Its log goes to
// a file that tests can read (and that is printed when a test fails to start
// it).
//
//   auto server = ServerProcess::Start({"--max-batch-size", "4"});
//   ASSERT_TRUE(server.ok()) << server.status();
//   auto stub = (*server)->Stub();
//   ...
//   EXPECT_EQ((*server)->Stop(), 0);  // SIGTERM, then the exit code
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace attention::testing {

// A fresh directory under the system's temporary directory, removed by the
// destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

class ServerProcess {
 public:
  // Starts attention-server with `flags` added to the address (unless
  // `flags` has its own --address), metrics and port-file flags, and `env`
  // added to the environment; returns once it serves. The error holds the
  // server's log when it exited instead.
  //
  // The start-up warm-up is off unless `flags` names a --warmup or
  // --test-gate-warmup flag: it is what a server start costs (0.17 against
  // 8.9 s under ASan on the conformance repository), and the tests that
  // start hundreds of servers test what the server does once it serves.
  // The warm-up's own tests (server_warmup_python_test, config_test), and the
  // server's Python tests, the edge and cluster suites and the shell tests,
  // whose servers warm up, cover it.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(
      const std::vector<std::string>& flags, const std::map<std::string, std::string>& env = {});
  // Runs attention-server with exactly `args` (no added flags) to completion;
  // returns its exit code, and its output in `output`.
  static int RunToExit(const std::vector<std::string>& args,
                       const std::map<std::string, std::string>& env, std::string* output);

  // Kills the process if it is still running.
  ~ServerProcess();

  const std::string& address() const { return address_; }  // 127.0.0.1:PORT, or as given
  const std::string& metrics_address() const { return metrics_address_; }
  // REST's; empty when the server runs without it.
  const std::string& http_address() const { return http_address_; }

  std::shared_ptr<grpc::Channel> Channel() const;  // plaintext
  std::unique_ptr<v1::AttentionService::Stub> Stub() const;

  pid_t pid() const { return pid_; }
  void Signal(int signal_number);
  // Waits for the process; its exit code, or 128 + signal when killed.
  int Wait();
  // SIGTERM, then Wait().
  int Stop();
  // The server's stdout and stderr so far.
  std::string Log() const;

 private:
  ServerProcess() = default;

  TempDir dir_;
  pid_t pid_ = -1;
  std::string address_;
  std::string metrics_address_;
  std::string http_address_;
};

// Path of the attention-server binary of this build.
std::filesystem::path ServerBinary();
// The conformance data (cases/, models/, errors.json, and layers/ with its
// own cases/ and models/).
std::filesystem::path ConformanceDir();
// A model repository holding every conformance model: models/ and
// layers/models/ side by side, as one server serves them (copied once per
// test process into a temporary directory, removed at exit).
std::filesystem::path ConformanceRepository();

// The canonical name of a gRPC status code: "OK", "INVALID_ARGUMENT"...
std::string CodeName(grpc::StatusCode code);

}  // namespace attention::testing
