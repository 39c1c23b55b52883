// server_flags.cc: the flags of attention-server and their environment names.
#include "server/config/server_flags.h"

#include <climits>
#include <initializer_list>
#include <optional>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace attention::server {
namespace {

// "--max-batch-size" -> "ATTENTION_MAX_BATCH_SIZE".
std::string EnvName(const std::string& flag) {
  return "ATTENTION_" + absl::AsciiStrToUpper(absl::StrReplaceAll(flag.substr(2), {{"-", "_"}}));
}

template <typename T>
CLI::Option* Flag(CLI::App& app, const std::string& name, T* value, const std::string& help) {
  return app.add_option(name, *value, help)->envname(EnvName(name))->capture_default_str();
}

// One row of a table of flags of one type: its name, where its value goes, its help.
template <typename T>
struct FlagRow {
  const char* name;
  T* value;
  const char* help;
};

// A table of flags of one type, each with the same check (none: any value of the type).
template <typename T>
void Flags(CLI::App& app, std::initializer_list<FlagRow<T>> rows,
           const std::optional<CLI::Validator>& check = std::nullopt) {
  for (const FlagRow<T>& row : rows) {
    CLI::Option* option = Flag(app, row.name, row.value, row.help);
    if (check) option->check(*check);
  }
}

// Where the server listens.
void AddListeningFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--address", &c->address, "gRPC listening address HOST:PORT (port 0: any free port)");
  Flag(app, "--metrics-address", &c->metrics_address,
       "Prometheus listening address HOST:PORT, path /metrics (empty: no metrics endpoint)");
  Flag(app, "--http-address", &c->http_address,
       "REST (Open Inference Protocol v2 over HTTP/1.1) listening address HOST:PORT (port 0: "
       "any free port; empty: no REST)");
  Flag(app, "--http-threads", &c->http.threads,
       "Threads of the REST listener (reading, parsing and writing HTTP; the engine's are apart)")
      ->check(CLI::Range(1, 64));
  Flag(app, "--http-max-connections", &c->http.max_connections,
       "Most REST connections open at once; further ones are closed as they are accepted")
      ->check(CLI::Range(1, 1 << 20));
  Flag(app, "--http-timeout-seconds", &c->http_timeout_seconds,
       "A REST connection that takes longer to send a whole request (or to start the next), or "
       "to take a whole response, is closed")
      ->check(CLI::Range(0.001, 3600.0));
}

// Which models are served, and how the repository is watched.
void AddModelFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--model-repository", &c->model_repository,
       "Directory whose *.safetensors files are served as models (built-ins are always served)");
  app.add_flag("--strict", c->strict, "Exit when a model file fails to load instead of skipping it")
      ->envname(EnvName("--strict"))
      ->capture_default_str();
  Flag(app, "--max-model-file-bytes", &c->max_model_file_bytes,
       "Model files larger than this are skipped as bad files (fatal with --strict); 0: no cap")
      ->check(CLI::Range(int64_t{0}, INT64_MAX));
  Flag(app, "--repository-poll-seconds", &c->repository_poll_seconds,
       "Seconds between scans of --model-repository: new files are loaded, changed files "
       "reloaded (load-then-swap), removed files unloaded (0: read once, at start-up)")
      ->check(CLI::Range(0.0, 86400.0));
  Flag(app, "--version-policy", &c->version_policy,
       "Versions of a model served: 'latest' (the highest-numbered <name>/<N>.safetensors) or "
       "'all'")
      ->check(CLI::IsMember({"latest", "all"}));
  Flag(app, "--model-control", &c->model_control,
       "'explicit': the Open Inference Protocol's RepositoryModelLoad/RepositoryModelUnload "
       "load and unload models (authenticated like every call); 'none': they are refused")
      ->check(CLI::IsMember({"none", "explicit"}));
}

// Batching, per model.
void AddBatchingFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--max-batch-size", &c->batching.max_batch_size,
       "Most requests of one model merged into one execution (1: no batching)")
      ->check(CLI::Range(1, 1 << 16));
  const char* const fixed = BatchingDelayName(BatchingDelay::kFixed);
  app.add_option_function<std::string>(
         "--batching-delay",
         [c, fixed](const std::string& name) {
           c->batching.delay = name == fixed ? BatchingDelay::kFixed : BatchingDelay::kWhileBusy;
         },
         "When a batch that is not full runs: 'while-busy' (as soon as no batch of its model "
         "computes; requests wait only behind the one in flight) or 'fixed' (once its oldest "
         "request has waited --max-queue-delay-us)")
      ->envname(EnvName("--batching-delay"))
      ->check(CLI::IsMember({BatchingDelayName(BatchingDelay::kWhileBusy), fixed}))
      ->default_str(BatchingDelayName(c->batching.delay));
  Flag(app, "--max-queue-delay-us", &c->batching.max_queue_delay_us,
       "With --batching-delay fixed: longest wait, in microseconds, for a batch to fill "
       "before it runs anyway")
      ->check(CLI::Range(int64_t{0}, int64_t{60'000'000}));
  Flag(app, "--piece-wait-us", &c->batching.piece_wait_us,
       "Longest wait, in microseconds, of a piece of a long session step for the tasks just "
       "answered beside the piece before it to come back (0: none)")
      ->check(CLI::Range(int64_t{0}, int64_t{1'000'000}));
  Flag(app, "--queue-capacity", &c->batching.queue_capacity,
       "Most requests waiting per model; beyond it requests get RESOURCE_EXHAUSTED")
      ->check(CLI::Range(1, 1 << 24));
}

// What one request, and all held requests together, may be.
void AddLimitFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--max-message-bytes", &c->max_message_bytes, "Largest request message, in bytes")
      ->check(CLI::Range(1, INT_MAX));
  Flag(app, "--max-request-elements", &c->limits.max_request_elements,
       "Most float elements per request in queries, keys, values, output and weights together")
      ->check(CLI::Range(int64_t{1}, INT64_MAX));
  // Caps and amounts where 0 turns the cap (or the behaviour) off.
  Flags<int64_t>(
      app,
      {{"--max-request-work", &c->limits.max_request_work,
        "Most work units per request (multiply-adds, plus 16 per score entry); more is "
        "refused with INVALID_ARGUMENT (0: no cap)"},
       {"--max-request-scratch-elements", &c->limits.max_request_scratch_elements,
        "Most floats of engine scratch per thread one request may need (64 x the sum of its "
        "feature sizes); more is refused with INVALID_ARGUMENT (0: no cap)"},
       {"--chunk-work", &c->chunk_work,
        "Most work units of one piece of a session step: a longer step (a prompt's prefill) "
        "is computed in pieces, other batches running between them (0: steps whole)"},
       {"--inline-work", &c->inline_work,
        "Most work units of a request computed on the thread that received it when its "
        "model's batcher is idle, skipping the hand-over to the batcher's thread (0: never)"},
       {"--max-queued-bytes", &c->max_queued_bytes,
        "Most bytes of request messages held at once (admitted, not yet answered), all "
        "models together; beyond it RESOURCE_EXHAUSTED (0: no cap)"}},
      CLI::Range(int64_t{0}, INT64_MAX));
}

// Decoding sessions (AttendSession, and sequences of the Open Inference Protocol).
void AddSessionFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--session-memory-bytes", &c->sessions.memory_bytes,
       "Bytes of keys and values all decoding sessions hold together; a session that would "
       "pass it gets RESOURCE_EXHAUSTED")
      ->check(CLI::Range(int64_t{0}, INT64_MAX));
  Flag(app, "--max-sessions", &c->sessions.max_sessions,
       "Decoding sessions open at once (AttendSession streams and sequences together)")
      ->check(CLI::Range(1, 1 << 24));
  Flag(app, "--max-session-length", &c->sessions.max_length,
       "Most tokens a self-attention session holds per example (0: no cap besides the memory)")
      ->check(CLI::Range(int64_t{0}, INT64_MAX));
  Flag(app, "--session-idle-seconds", &c->sessions.idle_seconds,
       "A session with no step for this long is freed and its next step told so (0: never)")
      ->check(CLI::Range(0.0, 1e7));
  app.add_option_function<std::string>(
         "--session-preemption",
         [c](const std::string& value) { c->sessions.preemption = value == "on"; },
         "'on': when the session memory is full, a new session or a step that needs blocks "
         "takes them from the session stepped least recently with no step in flight, which ends "
         "UNAVAILABLE (its client replays it); 'off': it is refused RESOURCE_EXHAUSTED")
      ->envname(EnvName("--session-preemption"))
      ->check(CLI::IsMember({"on", "off"}))
      ->default_str(c->sessions.preemption ? "on" : "off");
  app.add_flag_function(
         "--no-prefix-sharing", [c](int64_t) { c->sessions.prefix_sharing = false; },
         "Sessions whose prompts begin with the same full blocks of tokens hold them apart "
         "instead of sharing them, and no block is cached once its sessions end (answers are "
         "the same either way)")
      ->envname(EnvName("--no-prefix-sharing"));
  app.add_option_function<std::string>(
         "--kv-cache-dtype",
         [c](const std::string& value) { c->sessions.kv_dtype = *ParseKvDtype(value); },
         "What sessions hold keys and values in: float32, or bfloat16 or float16 (rounded once "
         "when appended: half the memory a token, half the bytes a step reads); a model's "
         "__metadata__ \"kv_cache_dtype\" overrides it for that model")
      ->envname(EnvName("--kv-cache-dtype"))
      ->check(CLI::Validator(
          [](std::string& value) -> std::string {
            if (ParseKvDtype(value)) return {};
            return absl::StrCat("--kv-cache-dtype is \"", value, "\", expected ",
                                std::string(kKvDtypeNames));
          },
          "float32|bfloat16|float16"))
      ->default_str(std::string(KvDtypeName(c->sessions.kv_dtype)));
}

// The engine's threads and kernel path.
void AddEngineFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--threads", &c->threads, "Engine worker threads (0: one per hardware thread)")
      ->check(CLI::Range(0, 4096));
  Flag(app, "--isa", &c->isa,
       "Kernel path: avx512_bf16, avx512, avx2 or portable, to force a lower one than the "
       "CPU's best (empty: the best the CPU runs); a path the CPU lacks stops the server");
  app.add_flag("--force-fp32", c->force_fp32,
               "Load every model as fp32, whatever its \"precision\" metadata says (for "
               "comparisons and rollback)")
      ->envname(EnvName("--force-fp32"))
      ->capture_default_str();
}

// What each model version computes before it serves.
void AddWarmupFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--warmup", &c->warmup,
       "Before serving, compute a batch and a large request per model version (true/false); "
       "health is NOT_SERVING until the start-up models have");
  Flag(app, "--warmup-work-budget", &c->warmup_work_budget,
       "Most work units of one model's warm-up: half for a batch of --max-batch-size requests, "
       "half for one large request, each as large as the limits allow")
      ->check(CLI::Range(int64_t{1}, INT64_MAX));
}

// SIGTERM and SIGINT.
void AddShutdownFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--drain-delay-seconds", &c->drain_delay_seconds,
       "After SIGTERM/SIGINT, time health says NOT_SERVING and new calls get UNAVAILABLE "
       "before the server finishes accepted calls and stops")
      ->check(CLI::Range(0.0, 3600.0));
  Flag(app, "--shutdown-grace-seconds", &c->shutdown_grace_seconds,
       "After the drain delay, time given to accepted requests before remaining calls are cancelled")
      ->check(CLI::Range(0.0, 86400.0));
}

// What one client connection may do.
void AddConnectionFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--max-concurrent-streams", &c->max_concurrent_streams,
       "Calls one client connection may have open at once; more wait in the client")
      ->check(CLI::Range(1, INT_MAX));
  Flag(app, "--max-connection-age-seconds", &c->max_connection_age_seconds,
       "Close client connections gracefully after this age so clients rebalance (0: never)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 31));
  Flag(app, "--max-connection-idle-seconds", &c->max_connection_idle_seconds,
       "Close client connections with no call open for this long, gracefully (0: never)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 31));
}

// Log lines.
void AddLoggingFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--log-level", &c->log_level, "Log level")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));
  Flag(app, "--log-format", &c->log_format, "Log line format")
      ->check(CLI::IsMember({"text", "json"}));
}

// TLS, client identities, tokens and what anonymous callers see.
void AddSecurityFlags(CLI::App& app, ServerConfig* c) {
  Flags<std::string>(
      app,
      {{"--tls-cert", &c->tls_cert,
        "PEM server certificate chain; with --tls-key enables TLS (empty: plaintext)"},
       {"--tls-key", &c->tls_key, "PEM private key of --tls-cert"},
       {"--tls-client-ca", &c->tls_client_ca,
        "PEM CA bundle; clients must present a certificate it signed (mutual TLS)"},
       {"--tls-client-allow", &c->tls_client_allow,
        "With --tls-client-ca: comma-separated client certificate names (subject alternative "
        "name or common name) allowed to call; others get PERMISSION_DENIED"},
       {"--auth-token-file", &c->auth_token_file,
        "File of accepted bearer tokens, one per line; requests must send "
        "'authorization: Bearer <token>' (health checks stay open)"}});
  Flag(app, "--reflection", &c->reflection,
       "Offer gRPC server reflection (true/false); it stays open without a token");
}

// For scripts and tests.
void AddTestingFlags(CLI::App& app, ServerConfig* c) {
  Flag(app, "--port-file", &c->port_file,
       "Once serving, write the bound addresses here ('grpc HOST:PORT', 'metrics HOST:PORT')");
  // The empty group keeps this tests-only flag out of --help.
  Flag(app, "--test-gate-fifo", &c->test_gate_fifo,
       "For tests: FIFO whose bytes release the batches of the model 'gate'")
      ->group("");
  Flag(app, "--test-gate-warmup", &c->test_gate_warmup,
       "For tests: the start-up warm-up of the model 'gate' waits for a byte of --test-gate-fifo")
      ->group("");
}

}  // namespace

// In the order --help lists them.
void AddServerFlags(CLI::App& app, ServerConfig* c) {
  AddListeningFlags(app, c);
  AddModelFlags(app, c);
  AddBatchingFlags(app, c);
  AddLimitFlags(app, c);
  AddSessionFlags(app, c);
  AddEngineFlags(app, c);
  AddWarmupFlags(app, c);
  AddShutdownFlags(app, c);
  AddConnectionFlags(app, c);
  AddLoggingFlags(app, c);
  AddSecurityFlags(app, c);
  AddTestingFlags(app, c);
}

}  // namespace attention::server
