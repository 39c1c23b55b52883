// attention_client_main.cc: the attention-client CLI. Parses flags (CLI11;
// connection flags also from ATTENTION_* variables, a flag winning over its
// variable), builds one AttentionClient and runs the chosen subcommand. Each
// subcommand's flags are declared by its own Add* function; what it does is
// in commands.h.
//
//   attention-client --target 127.0.0.1:50051 health
//   attention-client models
//   attention-client repository
//   attention-client load mha_small
//   attention-client attend request.json
//   attention-client attend --stream requests.jsonl
//   attention-client bench --concurrency 8 --duration 10 --model dot_product --n 256
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "client/cpp/attention_client.h"
#include "client/cli/commands.h"

namespace {

using attention::client::AttentionClient;
using attention::client::ClientOptions;

// The token in `path`, without surrounding whitespace (files often end in \n).
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError("--token-file: cannot read '" + path + "'");
  std::ostringstream text;
  text << file.rdbuf();
  return std::string(absl::StripAsciiWhitespace(text.str()));
}

// Whether every host of `target` (a HOST:PORT list or a gRPC URI) is this
// machine, so that a token sent in plaintext never leaves it.
bool OnlyLoopback(const std::string& target) {
  for (absl::string_view host : absl::StrSplit(target, ',')) {
    absl::ConsumePrefix(&host, "ipv4:");
    absl::ConsumePrefix(&host, "ipv6:");
    absl::ConsumePrefix(&host, "dns:///");
    if (!absl::StartsWith(host, "127.") && !absl::StartsWith(host, "localhost") &&
        !absl::StartsWith(host, "[::1]") && !absl::StartsWith(host, "unix:")) {
      return false;
    }
  }
  return true;
}

// A subcommand: its CLI11 app, and what running it does once the flags are
// parsed and the client is made. Each Add* function declares one subcommand's
// flags into state the returned `run` owns.
struct Subcommand {
  CLI::App* app;
  std::function<int(AttentionClient&, const ClientOptions&)> run;
};

// The connection flags, before the token file is read.
struct ConnectionFlags {
  ClientOptions options;
  double timeout_s = 30;
  std::string token_file;
};

void AddConnectionFlags(CLI::App& app, ConnectionFlags& flags) {
  ClientOptions& options = flags.options;
  app.add_option("--target", options.target,
                 "Server HOST:PORT; several, comma-separated, are balanced round-robin")
      ->envname("ATTENTION_TARGET")
      ->capture_default_str();
  app.add_option("--timeout", flags.timeout_s,
                 "Deadline of each call in seconds, retries included")
      ->envname("ATTENTION_TIMEOUT")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-attempts", options.retry.max_attempts,
                 "Tries per call on UNAVAILABLE, with exponential backoff (1..5; 1 = no retry)")
      ->envname("ATTENTION_MAX_ATTEMPTS")
      ->check(CLI::Range(1, 5))
      ->capture_default_str();
  app.add_flag("--tls", options.tls, "Use TLS, trusting the system's roots unless --tls-ca")
      ->envname("ATTENTION_TLS");
  app.add_option("--tls-ca", options.tls_ca_file, "PEM file of the CA that signed the server")
      ->envname("ATTENTION_TLS_CA");
  // The client's own certificate: ATTENTION_CLIENT_* so that it is never
  // taken from a server's ATTENTION_TLS_CERT in the same environment.
  auto* tls_cert = app.add_option("--tls-cert", options.tls_cert_file,
                                  "PEM client certificate chain, for mutual TLS")
                       ->envname("ATTENTION_CLIENT_TLS_CERT");
  auto* tls_key = app.add_option("--tls-key", options.tls_key_file,
                                 "PEM private key of --tls-cert")
                      ->envname("ATTENTION_CLIENT_TLS_KEY");
  tls_cert->needs(tls_key);
  tls_key->needs(tls_cert);
  app.add_option("--tls-server-name", options.tls_server_name,
                 "Name the server certificate must carry, if not the target's host")
      ->envname("ATTENTION_TLS_SERVER_NAME");
  auto* token = app.add_option("--token", options.token,
                               "Bearer token, sent as 'authorization: Bearer <token>'")
                    ->envname("ATTENTION_TOKEN");
  app.add_option("--token-file", flags.token_file, "File holding the bearer token")
      ->envname("ATTENTION_TOKEN_FILE")
      ->excludes(token);
}

// The client options the flags give: the timeout set and the token file
// read. Warns on stderr when the token would travel in plaintext off this
// machine.
absl::StatusOr<ClientOptions> ResolveOptions(const ConnectionFlags& flags) {
  ClientOptions options = flags.options;
  options.timeout = absl::Seconds(flags.timeout_s);
  if (!flags.token_file.empty()) {
    absl::StatusOr<std::string> file_token = ReadToken(flags.token_file);
    if (!file_token.ok()) return file_token.status();
    options.token = *std::move(file_token);
  }
  const bool tls = options.tls || !options.tls_ca_file.empty() || !options.tls_cert_file.empty();
  if (!options.token.empty() && !tls && !OnlyLoopback(options.target)) {
    std::cerr << "warning: the bearer token travels in plaintext to " << options.target
              << "; anyone on the path can read it (use --tls)\n";
  }
  return options;
}

// `models` and `repository`: a listing, as a table or with --json.
Subcommand AddListing(CLI::App& app, const std::string& name, const std::string& description,
                      const std::string& json_description,
                      int (*run)(AttentionClient&, bool json)) {
  auto json = std::make_shared<bool>(false);
  CLI::App* command = app.add_subcommand(name, description);
  command->add_flag("--json", *json, json_description);
  return {command, [json, run](AttentionClient& client, const ClientOptions&) {
            return run(client, *json);
          }};
}

// `load` and `unload`: one model name.
Subcommand AddModelControl(CLI::App& app, const std::string& name, const std::string& description,
                           int (*run)(AttentionClient&, const std::string& model)) {
  auto model = std::make_shared<std::string>();
  CLI::App* command = app.add_subcommand(name, description);
  command->add_option("model", *model, "Model name")->required();
  return {command, [model, run](AttentionClient& client, const ClientOptions&) {
            return run(client, *model);
          }};
}

Subcommand AddHealth(CLI::App& app) {
  auto service = std::make_shared<std::string>();
  CLI::App* command = app.add_subcommand(
      "health", "Print the server's health; exit 0 only when SERVING (for HEALTHCHECK)");
  command->add_option("--service", *service, "Service to ask about; empty: the server");
  return {command, [service](AttentionClient& client, const ClientOptions&) {
            return attention::client::RunHealth(client, *service);
          }};
}

Subcommand AddAttend(CLI::App& app) {
  struct Flags {
    std::string input = "-";
    bool pretty = false;
    bool stream = false;
  };
  auto flags = std::make_shared<Flags>();
  CLI::App* command = app.add_subcommand(
      "attend", "Send one AttendRequest (proto JSON) and print the response as proto JSON");
  command->add_option("request", flags->input,
                      "Request file (with --stream: one request per line); - reads stdin")
      ->capture_default_str();
  auto* stream = command->add_flag(
      "--stream", flags->stream,
      "Send every request over one AttendStream call; print one response per line");
  command->add_flag("--pretty", flags->pretty, "Print the response on several lines")
      ->excludes(stream);
  return {command, [flags](AttentionClient& client, const ClientOptions&) {
            if (flags->stream) return attention::client::RunAttendStream(client, flags->input);
            return attention::client::RunAttend(client, flags->input, flags->pretty);
          }};
}

// bench's flags for the load: closed or open loop, duration and warm-up.
void AddLoadFlags(CLI::App& bench, attention::client::LoadOptions& load, double& duration_s,
                  double& warmup_s) {
  auto* concurrency = bench.add_option("--concurrency", load.concurrency,
                                       "Closed loop: calls kept in flight")
                          ->check(CLI::PositiveNumber)
                          ->capture_default_str();
  auto* rate = bench.add_option("--rate", load.rate_rps,
                                "Open loop: calls started per second, answered or not")
                   ->check(CLI::PositiveNumber)
                   ->excludes(concurrency);
  bench.add_option("--max-in-flight", load.max_in_flight,
                   "Open loop: calls in flight at most; a call due beyond it is skipped and "
                   "counted (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->needs(rate)
      ->capture_default_str();
  bench.add_option("--duration", duration_s, "Seconds measured")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bench.add_option("--warmup", warmup_s, "Seconds run before measuring")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

// bench's flags for the request: a file, or a generated one.
void AddRequestFlags(CLI::App& bench, attention::client::BenchCommand& command) {
  auto* request_file = bench.add_option("--request", command.request_file,
                                        "Request file (proto JSON); default: a generated one");
  const auto generated = [&](CLI::Option* option) { return option->excludes(request_file); };
  attention::client::GeneratedRequestShape& shape = command.shape;
  generated(bench.add_option("--model", shape.model, "Generated request: model")
                ->capture_default_str());
  generated(bench.add_option("--batch", shape.batch, "Generated request: B")
                ->capture_default_str());
  generated(bench.add_option("--n", shape.n, "Generated request: queries and keys per example")
                ->capture_default_str());
  generated(bench.add_option("--dim", shape.dim,
                             "Generated request: feature size, for models that take any")
                ->capture_default_str());
  generated(bench.add_flag("--causal", shape.causal, "Generated request: causal mask"));
  generated(bench.add_flag("--self-attention", shape.self_attention,
                           "Generated request: queries only (keys and values left out), "
                           "so the server runs self-attention"));
}

Subcommand AddBench(CLI::App& app) {
  struct Flags {
    attention::client::BenchCommand command;
    double duration_s = 10;
    double warmup_s = 1;
  };
  auto flags = std::make_shared<Flags>();
  CLI::App* bench = app.add_subcommand(
      "bench", "Load the server (closed loop at --concurrency, or open loop at --rate) and "
               "report throughput, latency percentiles and errors");
  AddLoadFlags(*bench, flags->command.load, flags->duration_s, flags->warmup_s);
  AddRequestFlags(*bench, flags->command);
  bench->add_option("--api", flags->command.api,
                    "attention: Attend calls; inference: the same request as Open Inference "
                    "Protocol ModelInfer calls")
      ->check(CLI::IsMember({"attention", "inference"}))
      ->capture_default_str();
  bench->add_flag("--json", flags->command.json, "Print only one JSON object on stdout");
  bench->add_option("--sessions", flags->command.sessions,
                    "Session mode: this many concurrent decoding sessions (AttendSession) of "
                    "--model, each stepping --steps-per-session times; reports steps/s, "
                    "tokens/s and step latency (0: off)")
      ->capture_default_str();
  bench->add_option("--steps-per-session", flags->command.steps_per_session,
                    "Session mode: steps of each session")
      ->capture_default_str();
  bench->add_option("--tokens-per-step", flags->command.tokens_per_step,
                    "Session mode: new token rows per step")
      ->capture_default_str();
  return {bench, [flags](AttentionClient& client, const ClientOptions& options) {
            attention::client::BenchCommand command = flags->command;
            command.target = options.target;
            command.load.warmup = absl::Seconds(flags->warmup_s);
            command.load.duration = absl::Seconds(flags->duration_s);
            return attention::client::RunBench(client, command);
          }};
}

}  // namespace

int main(int argc, char** argv) {
  // Debian's Abseil is built without NDEBUG, so absl::Mutex would keep a
  // process-wide lock-order graph on every Lock, gRPC's own locks included:
  // CPU that `bench` would take from the server it measures
  // (BENCHMARKS.md, "Where the per-call time goes"). Lock-order bugs are
  // TSan's job.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  CLI::App app{"attention-client: calls an attention-server (gRPC attention.v1)."};
  app.require_subcommand(1);
  // Connection flags may also follow the subcommand.
  app.fallthrough();
  ConnectionFlags connection;
  AddConnectionFlags(app, connection);
  // In the order `--help` lists them.
  const std::vector<Subcommand> subcommands = {
      AddListing(app, "models", "List the models the server can run",
                 "Print the ListModelsResponse as proto JSON", attention::client::RunModels),
      AddListing(app, "repository",
                 "List every model version the server knows, with its state and reason",
                 "Print the RepositoryIndexResponse as proto JSON",
                 attention::client::RunRepository),
      AddModelControl(
          app, "load",
          "Load (or reload) a model from the server's repository (--model-control explicit)",
          attention::client::RunLoad),
      AddModelControl(
          app, "unload",
          "Take a model out of service until it is loaded again (--model-control explicit)",
          attention::client::RunUnload),
      AddHealth(app),
      AddAttend(app),
      AddBench(app),
  };

  CLI11_PARSE(app, argc, argv);

  absl::StatusOr<ClientOptions> options = ResolveOptions(connection);
  if (!options.ok()) {
    std::cerr << "error: " << options.status().message() << "\n";
    return attention::client::kExitBadInput;
  }
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(*options);
  if (!client.ok()) {
    std::cerr << "error: " << client.status().message() << "\n";
    return attention::client::kExitBadInput;
  }
  for (const Subcommand& subcommand : subcommands) {
    if (subcommand.app->parsed()) return subcommand.run(**client, *options);
  }
  return attention::client::kExitBadInput;  // unreachable: one subcommand is required
}
