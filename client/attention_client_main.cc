// attention_client_main.cc: the attention-client CLI. Parses flags (CLI11;
// connection flags also from ATTENTION_* variables, a flag winning over its
// variable), builds one AttentionClient and runs the chosen subcommand.
//
//   attention-client --target 127.0.0.1:50051 health
//   attention-client models
//   attention-client repository
//   attention-client load mha_small
//   attention-client attend request.json
//   attention-client attend --stream requests.jsonl
//   attention-client bench --concurrency 8 --duration 10 --model dot_product --n 256
#include <fstream>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "client/attention_client.h"
#include "client/commands.h"

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

  ClientOptions options;
  double timeout_s = 30;
  std::string token_file;
  app.add_option("--target", options.target,
                 "Server HOST:PORT; several, comma-separated, are balanced round-robin")
      ->envname("ATTENTION_TARGET")
      ->capture_default_str();
  app.add_option("--timeout", timeout_s, "Deadline of each call in seconds, retries included")
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
  app.add_option("--token-file", token_file, "File holding the bearer token")
      ->envname("ATTENTION_TOKEN_FILE")
      ->excludes(token);

  CLI::App* models = app.add_subcommand("models", "List the models the server can run");
  bool models_json = false;
  models->add_flag("--json", models_json, "Print the ListModelsResponse as proto JSON");

  CLI::App* repository = app.add_subcommand(
      "repository", "List every model version the server knows, with its state and reason");
  bool repository_json = false;
  repository->add_flag("--json", repository_json,
                       "Print the RepositoryIndexResponse as proto JSON");
  CLI::App* load = app.add_subcommand(
      "load", "Load (or reload) a model from the server's repository (--model-control explicit)");
  std::string load_model;
  load->add_option("model", load_model, "Model name")->required();
  CLI::App* unload = app.add_subcommand(
      "unload", "Take a model out of service until it is loaded again (--model-control explicit)");
  std::string unload_model;
  unload->add_option("model", unload_model, "Model name")->required();

  CLI::App* health = app.add_subcommand(
      "health", "Print the server's health; exit 0 only when SERVING (for HEALTHCHECK)");
  std::string health_service;
  health->add_option("--service", health_service, "Service to ask about; empty: the server");

  CLI::App* attend = app.add_subcommand(
      "attend", "Send one AttendRequest (proto JSON) and print the response as proto JSON");
  std::string attend_input = "-";
  bool attend_pretty = false, attend_stream = false;
  attend->add_option("request", attend_input,
                     "Request file (with --stream: one request per line); - reads stdin")
      ->capture_default_str();
  auto* stream = attend->add_flag(
      "--stream", attend_stream,
      "Send every request over one AttendStream call; print one response per line");
  attend->add_flag("--pretty", attend_pretty, "Print the response on several lines")
      ->excludes(stream);

  CLI::App* bench = app.add_subcommand(
      "bench", "Load the server (closed loop at --concurrency, or open loop at --rate) and "
               "report throughput, latency percentiles and errors");
  attention::client::BenchCommand bench_command;
  double duration_s = 10, warmup_s = 1;
  auto* concurrency = bench->add_option("--concurrency", bench_command.load.concurrency,
                                        "Closed loop: calls kept in flight")
                          ->check(CLI::PositiveNumber)
                          ->capture_default_str();
  auto* rate = bench->add_option("--rate", bench_command.load.rate_rps,
                                 "Open loop: calls started per second, answered or not")
                   ->check(CLI::PositiveNumber)
                   ->excludes(concurrency);
  bench->add_option("--max-in-flight", bench_command.load.max_in_flight,
                    "Open loop: calls in flight at most; a call due beyond it is skipped and "
                    "counted (0: no limit)")
      ->check(CLI::NonNegativeNumber)
      ->needs(rate)
      ->capture_default_str();
  bench->add_option("--duration", duration_s, "Seconds measured")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  bench->add_option("--warmup", warmup_s, "Seconds run before measuring")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  auto* request_file = bench->add_option("--request", bench_command.request_file,
                                         "Request file (proto JSON); default: a generated one");
  const auto generated = [&](CLI::Option* option) { return option->excludes(request_file); };
  generated(bench->add_option("--model", bench_command.shape.model, "Generated request: model")
                ->capture_default_str());
  generated(bench->add_option("--batch", bench_command.shape.batch, "Generated request: B")
                ->capture_default_str());
  generated(bench->add_option("--n", bench_command.shape.n,
                              "Generated request: queries and keys per example")
                ->capture_default_str());
  generated(bench->add_option("--dim", bench_command.shape.dim,
                              "Generated request: feature size, for models that take any")
                ->capture_default_str());
  generated(bench->add_flag("--causal", bench_command.shape.causal,
                            "Generated request: causal mask"));
  generated(bench->add_flag("--self-attention", bench_command.shape.self_attention,
                            "Generated request: queries only (keys and values left out), "
                            "so the server runs self-attention"));
  bench->add_option("--api", bench_command.api,
                    "attention: Attend calls; inference: the same request as Open Inference "
                    "Protocol ModelInfer calls")
      ->check(CLI::IsMember({"attention", "inference"}))
      ->capture_default_str();
  bench->add_flag("--json", bench_command.json, "Print only one JSON object on stdout");

  CLI11_PARSE(app, argc, argv);

  options.timeout = absl::Seconds(timeout_s);
  if (!token_file.empty()) {
    absl::StatusOr<std::string> file_token = ReadToken(token_file);
    if (!file_token.ok()) {
      std::cerr << "error: " << file_token.status().message() << "\n";
      return attention::client::kExitBadInput;
    }
    options.token = *std::move(file_token);
  }
  const bool tls = options.tls || !options.tls_ca_file.empty() || !options.tls_cert_file.empty();
  if (!options.token.empty() && !tls && !OnlyLoopback(options.target)) {
    std::cerr << "warning: the bearer token travels in plaintext to " << options.target
              << "; anyone on the path can read it (use --tls)\n";
  }
  absl::StatusOr<std::unique_ptr<AttentionClient>> client = AttentionClient::Create(options);
  if (!client.ok()) {
    std::cerr << "error: " << client.status().message() << "\n";
    return attention::client::kExitBadInput;
  }

  if (models->parsed()) return attention::client::RunModels(**client, models_json);
  if (health->parsed()) return attention::client::RunHealth(**client, health_service);
  if (repository->parsed()) return attention::client::RunRepository(**client, repository_json);
  if (load->parsed()) return attention::client::RunLoad(**client, load_model);
  if (unload->parsed()) return attention::client::RunUnload(**client, unload_model);
  if (attend->parsed()) {
    if (attend_stream) return attention::client::RunAttendStream(**client, attend_input);
    return attention::client::RunAttend(**client, attend_input, attend_pretty);
  }
  bench_command.target = options.target;
  bench_command.load.warmup = absl::Seconds(warmup_s);
  bench_command.load.duration = absl::Seconds(duration_s);
  return attention::client::RunBench(**client, bench_command);
}
