// server_process.cc: launching attention-server.
#include "tests/support/server_process.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "tests/support/files.h"

namespace attention::testing {
namespace {

constexpr auto kStartTimeout = std::chrono::seconds(60);

// An idle gRPC C++ client channel reads the server's shutdown GOAWAY only at
// its backup poll, every 5 s by default, and the server waits for that. Set
// before gRPC starts (static initialisation precedes main).
[[maybe_unused]] const bool kFastBackupPoll =
    setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "20", /*overwrite=*/0) == 0;

// fork + exec of the server with stdout and stderr to `log`. Only
// async-signal-safe calls happen in the child before exec.
pid_t Spawn(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
            const std::filesystem::path& log) {
  std::vector<std::string> storage;
  storage.push_back(ServerBinary().string());
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : storage) argv.push_back(arg.data());
  argv.push_back(nullptr);

  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) {
    // The server under test sees only the ATTENTION_* variables a test sets.
    if (std::strncmp(*e, "ATTENTION_", 10) != 0) environment.emplace_back(*e);
  }
  for (const auto& [name, value] : env) environment.push_back(name + "=" + value);
  // Tests run in parallel: REST listens where the system picks, not on its
  // default port 8000, unless a test says otherwise.
  if (!env.contains("ATTENTION_HTTP_ADDRESS")) {
    environment.push_back("ATTENTION_HTTP_ADDRESS=127.0.0.1:0");
  }
  std::vector<char*> envp;
  for (std::string& e : environment) envp.push_back(e.data());
  envp.push_back(nullptr);

  const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fd, STDOUT_FILENO);
    dup2(fd, STDERR_FILENO);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close(fd);
  return pid;
}

int ExitCode(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

}  // namespace

TempDir::TempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "attention-test-XXXXXX").string();
  if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;
  if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
}

std::filesystem::path ServerBinary() {
  return std::filesystem::path(ATTENTION_BINARY_DIR) / "server" / "attention-server";
}

std::filesystem::path ConformanceDir() {
  return std::filesystem::path(ATTENTION_SOURCE_DIR) / "tests" / "conformance";
}

std::filesystem::path ConformanceRepository() {
  // Its destructor removes it at exit, after every server of the process
  // has stopped.
  static TempDir repository;
  static const bool filled = [] {
    for (const std::filesystem::path& models :
         {ConformanceDir() / "models", ConformanceDir() / "layers" / "models"}) {
      for (const auto& entry : std::filesystem::directory_iterator(models)) {
        std::filesystem::copy_file(entry.path(), repository.path() / entry.path().filename());
      }
    }
    return true;
  }();
  (void)filled;
  return repository.path();
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    const std::vector<std::string>& flags, const std::map<std::string, std::string>& env) {
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  if (server->dir_.path().empty()) return absl::InternalError("cannot make a temporary directory");
  const std::filesystem::path port_file = server->dir_.path() / "ports";
  std::vector<std::string> args = {"--metrics-address", "127.0.0.1:0", "--port-file",
                                   port_file.string()};
  if (std::find(flags.begin(), flags.end(), "--address") == flags.end()) {
    args.insert(args.end(), {"--address", "127.0.0.1:0"});
  }
  const bool names_warmup = std::any_of(flags.begin(), flags.end(), [](const std::string& flag) {
    return absl::StartsWith(flag, "--warmup") || absl::StartsWith(flag, "--test-gate-warmup");
  });
  if (!names_warmup) args.insert(args.end(), {"--warmup", "false"});
  args.insert(args.end(), flags.begin(), flags.end());
  server->pid_ = Spawn(args, env, server->dir_.path() / "log");
  if (server->pid_ < 0) return absl::InternalError("cannot start attention-server");

  const auto give_up = std::chrono::steady_clock::now() + kStartTimeout;
  while (!std::filesystem::exists(port_file)) {
    int status = 0;
    if (waitpid(server->pid_, &status, WNOHANG) == server->pid_) {
      server->pid_ = -1;
      return absl::FailedPreconditionError(absl::StrCat(
          "attention-server exited with ", ExitCode(status), " before serving:\n", server->Log()));
    }
    if (std::chrono::steady_clock::now() > give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat("attention-server did not serve in time:\n", server->Log()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (absl::string_view line : absl::StrSplit(ReadFile(port_file), '\n')) {
    if (absl::ConsumePrefix(&line, "grpc ")) server->address_ = std::string(line);
    if (absl::ConsumePrefix(&line, "metrics ")) server->metrics_address_ = std::string(line);
    if (absl::ConsumePrefix(&line, "http ")) server->http_address_ = std::string(line);
  }
  return server;
}

int ServerProcess::RunToExit(const std::vector<std::string>& args,
                             const std::map<std::string, std::string>& env, std::string* output) {
  TempDir dir;
  const pid_t pid = Spawn(args, env, dir.path() / "log");
  if (pid < 0) return -1;
  int status = 0;
  waitpid(pid, &status, 0);
  *output = ReadFile(dir.path() / "log");
  return ExitCode(status);
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

std::shared_ptr<grpc::Channel> ServerProcess::Channel() const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(address_, grpc::InsecureChannelCredentials(), args);
}

std::unique_ptr<v1::AttentionService::Stub> ServerProcess::Stub() const {
  return v1::AttentionService::NewStub(Channel());
}

void ServerProcess::Signal(int signal_number) {
  if (pid_ > 0) kill(pid_, signal_number);
}

int ServerProcess::Wait() {
  if (pid_ <= 0) return -1;
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
  return ExitCode(status);
}

int ServerProcess::Stop() {
  Signal(SIGTERM);
  return Wait();
}

std::string ServerProcess::Log() const { return ReadFile(dir_.path() / "log"); }

std::string CodeName(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

}  // namespace attention::testing
