// run_server.cc: attention-server's life from start-up (start_up.cc) to
// exit: signals, serving, and the drain on SIGTERM/SIGINT.
#include "server/run_server.h"

#include <semaphore.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "server/observability/logging.h"
#include "server/running_server.h"
#include "server/security/auth.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// Least time from NOT_SERVING to the end of the process (see RunServer).
constexpr absl::Duration kFlushPause = absl::Milliseconds(100);
// Least time from the last accepted call's end to the end of the process:
// its answer's frames, written just before, reach a proxy in front and are
// relayed whole before the connection closes (an edge that loses the
// connection between an answer's frames ends the client's stream without a
// status, which clients see as UNKNOWN).
constexpr absl::Duration kLastAnswerPause = absl::Milliseconds(50);
// Time the streams of sessions ended after the grace period get to answer
// their steps in flight and finish UNAVAILABLE.
constexpr absl::Duration kSessionEndPause = absl::Seconds(5);

// SIGTERM and SIGINT (stop) and SIGHUP (reload the token file) are caught by
// a handler rather than blocked and taken with sigwait(): threads that
// libraries start before main() (OpenBLAS's) do not block them, and the
// kernel may deliver a process's signal to any thread that does not, whose
// default action would kill the process. The handler may run on several
// threads at once (one signal per thread), so what it records is lock-free
// atomics, which are also async-signal-safe; a volatile sig_atomic_t is safe
// only within one thread.
sem_t signalled;
std::atomic<int> termination_signal{0};
std::atomic<bool> hangup_pending{false};
static_assert(std::atomic<int>::is_always_lock_free);
static_assert(std::atomic<bool>::is_always_lock_free);

void OnSignal(int signal_number) {
  if (signal_number == SIGHUP) {
    hangup_pending.store(true, std::memory_order_relaxed);
  } else {
    termination_signal.store(signal_number, std::memory_order_relaxed);
  }
  sem_post(&signalled);  // async-signal-safe, unlike a condition variable
}

absl::Status CatchSignals() {
  sem_init(&signalled, 0, 0);
  struct sigaction action = {};
  action.sa_handler = OnSignal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  for (int signal_number : {SIGTERM, SIGINT, SIGHUP}) {
    if (sigaction(signal_number, &action, nullptr) != 0) {
      return absl::InternalError(absl::StrCat("cannot catch signal ", signal_number));
    }
  }
  return absl::OkStatus();
}

// Runs `on_hangup` for each SIGHUP until SIGTERM or SIGINT, which it returns.
int WaitForTermination(const std::function<void()>& on_hangup) {
  for (;;) {
    while (sem_wait(&signalled) != 0) {
      // Interrupted (EINTR) by the very signals it waits for: wait again.
    }
    if (hangup_pending.exchange(false, std::memory_order_relaxed)) on_hangup();
    const int signal_number = termination_signal.load(std::memory_order_relaxed);
    if (signal_number != 0) return signal_number;
  }
}

// Rereads --auth-token-file; on any problem the tokens in use stay.
void ReloadTokens(const std::string& path, Dispatcher& dispatcher) {
  absl::StatusOr<std::vector<std::string>> tokens = ReadTokenFile(path);
  if (!tokens.ok()) {
    spdlog::error("SIGHUP: --auth-token-file not reloaded, the previous tokens stay: {}",
                  std::string(tokens.status().message()));
    return;
  }
  const size_t count = tokens->size();
  dispatcher.access().ReplaceTokens(*std::move(tokens));
  spdlog::info("SIGHUP: --auth-token-file reloaded ({} tokens)", count);
}

int Fail(const absl::Status& status) {
  spdlog::critical("cannot start: {}", status.ToString());
  return 1;
}

// Serves until SIGTERM or SIGINT, which it returns; SIGHUP rereads the
// token file.
int Serve(const ServerConfig& config, RunningServer& s) {
  return WaitForTermination([&] {
    if (config.auth_token_file.empty()) {
      spdlog::info("SIGHUP: no --auth-token-file to reload");
    } else {
      ReloadTokens(config.auth_token_file, *s.dispatcher);
    }
  });
}

// Every accepted call is answered: ends the process without gRPC's
// Shutdown(). A call that reaches it after Shutdown() began (sent before the
// client saw the GOAWAY) is dropped by gRPC and the client sees CANCELLED,
// which clients do not retry (1 to 29 calls in 6 of 8 SIGTERMs under
// closed-loop load, measured with a Shutdown() drain). Ending the process closes the connections
// instead, and a call in transit then fails UNAVAILABLE.
[[noreturn]] void ExitDrained(RunningServer& s, absl::Time not_serving_since) {
  s.dispatcher->Drain();
  // Health watchers and refused calls are not waited for; a moment lets
  // gRPC flush their NOT_SERVING and UNAVAILABLE (lost, the client still
  // sees UNAVAILABLE, from the closed connection).
  absl::SleepFor(std::max(not_serving_since + kFlushPause, absl::Now() + kLastAnswerPause) -
                 absl::Now());
  spdlog::info("stopped");
  // Not spdlog::shutdown(): gRPC threads may still be logging refused calls
  // (TSan caught the logger freed under one), and every line is already
  // flushed as it is written (logging.cc).
  std::fflush(nullptr);
  std::_Exit(0);
}

// Calls still open after the grace period: cancels them and returns once
// gRPC has finished every one.
void CancelOpenCalls(RunningServer& s) {
  spdlog::warn("calls still open after --shutdown-grace-seconds; cancelling them");
  // A held batch would keep its calls, hence Shutdown(), waiting forever.
  if (s.test_gate) s.test_gate->Stop();
  // The calls still open are cancelled, which the batchers answer without
  // computing.
  s.grpc->Shutdown(absl::ToChronoTime(absl::Now()));
  s.dispatcher->Drain();
  s.grpc->Wait();
  spdlog::info("stopped");
  // Not destroyed: ~Exposer waits up to 2 s for civetweb's poll loop, and the
  // process ends right after this anyway.
  static_cast<void>(s.exposer.release());
}

// The drain after `signal_number`: NOT_SERVING at once, calls served for the
// drain delay, then refusals and the grace period.
void Shutdown(const ServerConfig& config, RunningServer& s, int signal_number) {
  spdlog::info("{} received: NOT_SERVING; serving the calls that still arrive for "
               "--drain-delay-seconds {}, then refusing new calls and finishing accepted calls "
               "for up to --shutdown-grace-seconds {}",
               signal_number == SIGTERM ? "SIGTERM" : "SIGINT", config.drain_delay_seconds,
               config.shutdown_grace_seconds);
  SetHealth(*s.grpc, false);
  s.dispatcher->BeginDrain();
  const absl::Time not_serving_since = absl::Now();
  // A load balancer takes a health check or two to see NOT_SERVING and keeps
  // sending meanwhile. Those calls are served: refused, they would come back
  // through the same balancer, which favours the replica that answers
  // fastest, and a refusing one answers fastest (in a rolling restart of
  // three replicas, 2,376 of 33,451 calls failed that way).
  absl::SleepFor(absl::Seconds(config.drain_delay_seconds));
  // From here the server answers new calls itself (UNAVAILABLE, and
  // NOT_SERVING to health checks), which clients retry elsewhere, while
  // accepted calls finish.
  s.sessions->StopOpening();
  s.dispatcher->StopAccepting();
  const absl::Time grace_end = absl::Now() + absl::Seconds(config.shutdown_grace_seconds);
  // The sequences open here whose steps come as unary calls (ModelInfer,
  // REST infer) hold no call open between their steps: their steps are
  // still admitted until every session has ended (streams' too) or the
  // grace period has, so a sequence shorter than the grace ends here (the
  // edge keeps sending it here: docs/api.md section 6.11).
  if (s.sessions->open_sessions() > 0) {
    spdlog::info("{} sessions open: their steps are admitted until they end, for up to "
                 "--shutdown-grace-seconds", s.sessions->open_sessions());
    s.sessions->AwaitNoneOpen(grace_end);
  }
  s.dispatcher->StopSequenceSteps();
  // WaitForIdle() waits for each call's OnDone, not just for its answers:
  // with streams still writing when Shutdown() began, gRPC 1.51 now and then
  // closed their connections with answers undelivered (clients saw
  // "Connection reset by peer", 3 to 10 shutdowns in 100 under stream load).
  if (s.dispatcher->WaitForIdle(grace_end)) ExitDrained(s, not_serving_since);
  // Sessions still open keep their streams open: they end now, UNAVAILABLE
  // once the steps in flight are answered, and their streams finish.
  if (const int ended = s.sessions->EndAll(); ended > 0) {
    spdlog::info("{} sessions still open after --shutdown-grace-seconds end now", ended);
    if (s.dispatcher->WaitForIdle(absl::Now() + kSessionEndPause)) {
      ExitDrained(s, not_serving_since);
    }
  }
  CancelOpenCalls(s);
}

}  // namespace

int RunServer(const ServerConfig& config) {
  if (absl::Status s = CatchSignals(); !s.ok()) return Fail(s);
  if (absl::Status s = ConfigureLogging(config.log_level, config.log_format); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 2;
  }
  RunningServer server;
  if (absl::Status s = Start(config, server); !s.ok()) return Fail(s);
  Shutdown(config, server, Serve(config, server));
  return 0;
}

}  // namespace attention::server
