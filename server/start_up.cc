// start_up.cc: attention-server's start-up, from the kernel path to the
// port file (Start, running_server.h); run_server.cc serves and shuts down.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/kernels/blas.h"
#include "core/kernels/cpu_features.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "server/observability/logging.h"
#include "server/observability/request_names.h"
#include "server/repository/warmup.h"
#include "server/running_server.h"
#include "server/security/auth.h"
#include "server/security/tls_context.h"
#include "server/security/tls_credentials.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// The services health answers for by name, besides the server's "".
constexpr const char* kHealthServiceNames[] = {"attention.v1.AttentionService",
                                               "inference.GRPCInferenceService"};

// "0.0.0.0:0" with port 51234 bound -> "0.0.0.0:51234". A Unix socket
// ("unix:PATH", "unix-abstract:NAME") has no port and stays as it is.
std::string WithPort(const std::string& address, int port) {
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    return address;
  }
  const size_t colon = address.rfind(':');
  return absl::StrCat(address.substr(0, colon == std::string::npos ? address.size() : colon), ":",
                      port);
}

bool IsLoopback(const std::string& address) {
  return absl::StartsWith(address, "127.") || absl::StartsWith(address, "localhost:") ||
         absl::StartsWith(address, "[::1]");
}

// Written to a temporary name first, so a reader never sees half a file.
absl::Status WritePortFile(const std::string& path, const std::string& grpc_address,
                           const std::string& metrics_address, const std::string& http_address) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary);
    out << "grpc " << grpc_address << "\n";
    if (!metrics_address.empty()) out << "metrics " << metrics_address << "\n";
    if (!http_address.empty()) out << "http " << http_address << "\n";
    if (!out) return absl::UnavailableError(absl::StrCat("--port-file ", path, ": cannot write"));
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("--port-file ", path, ": cannot rename into place"));
  }
  return absl::OkStatus();
}

std::string Describe(const Model& model) {
  if (model.query_size == 0) return absl::StrCat(std::string(KindName(model.kind)), ", any sizes");
  std::string sizes = absl::StrCat(std::string(KindName(model.kind)), ", d_q=", model.query_size,
                                   " d_k=", model.key_size);
  if (model.value_size != 0) absl::StrAppend(&sizes, " d_v=", model.value_size);
  if (model.num_heads != 0) {
    absl::StrAppend(&sizes, " heads=", model.num_heads, " E=", model.output_size);
  }
  absl::StrAppend(&sizes, ", precision ", std::string(PrecisionName(model.precision)));
  return sizes;
}

// Linking gRPC's reflection library registers its plugin with every
// ServerBuilder; --reflection false takes it out again.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const std::unique_ptr<grpc::ServerBuilderPlugin>& plugin) {
      return plugin->name() == "proto_server_reflection";
    });
  }
};

absl::Status SelectKernelPath(const ServerConfig& config) {
  if (config.isa.empty()) return absl::OkStatus();
  absl::StatusOr<Isa> isa = ParseIsa(config.isa);
  if (!isa.ok()) return isa.status();
  if (absl::Status s = SelectIsa(*isa); !s.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("--isa: ", s.message()));
  }
  return absl::OkStatus();
}

// The dispatcher's options, with the tokens and client identities read.
absl::StatusOr<DispatchOptions> ReadDispatchOptions(const ServerConfig& config) {
  DispatchOptions options;
  options.limits = config.limits;
  options.batching = config.batching;
  options.max_queued_bytes = config.max_queued_bytes;
  options.chunk_work = config.chunk_work;
  options.inline_work = config.inline_work;
  options.steps_wait_for_blocks = config.sessions.preemption;
  if (!config.auth_token_file.empty()) {
    absl::StatusOr<std::vector<std::string>> tokens = ReadTokenFile(config.auth_token_file);
    if (!tokens.ok()) return tokens.status();
    options.auth_tokens = *std::move(tokens);
  }
  for (absl::string_view name : absl::StrSplit(config.tls_client_allow, ',', absl::SkipWhitespace())) {
    options.allowed_client_identities.emplace_back(absl::StripAsciiWhitespace(name));
  }
  if (!options.allowed_client_identities.empty() && config.tls_client_ca.empty()) {
    return absl::InvalidArgumentError(
        "--tls-client-allow needs --tls-client-ca (mutual TLS): without client certificates "
        "there is no identity to check");
  }
  return options;
}

// The built-in models, and the test gate's when asked for.
absl::Status AddBuiltIns(const ServerConfig& config, RunningServer& s) {
  for (Model built_in : {DotProductModel(), DistanceModel()}) {
    built_in.kv_cache_dtype = config.sessions.kv_dtype;
    if (absl::Status added = s.registry.AddBuiltIn(std::move(built_in)); !added.ok()) return added;
  }
  if (config.test_gate_fifo.empty()) return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<TestGate>> opened = TestGate::Open(config.test_gate_fifo);
  if (!opened.ok()) return opened.status();
  s.test_gate = *std::move(opened);
  Model gate = TestGate::GateModel();
  gate.kv_cache_dtype = config.sessions.kv_dtype;
  if (absl::Status added = s.registry.AddBuiltIn(std::move(gate)); !added.ok()) return added;
  s.dispatch_options.test_gate = s.test_gate.get();
  spdlog::warn("test gate on: batches of model '{}' wait for bytes on {}", kTestGateModelName,
               config.test_gate_fifo);
  return absl::OkStatus();
}

// The built-ins, the metrics with their series, and the repository's files,
// scanned and loaded once.
absl::Status LoadModels(const ServerConfig& config, RunningServer& s) {
  absl::StatusOr<VersionPolicy> policy = ParseVersionPolicy(config.version_policy);
  if (!policy.ok()) return policy.status();
  if (config.model_repository.empty() &&
      (config.model_control == "explicit" || config.repository_poll_seconds > 0)) {
    return absl::InvalidArgumentError(
        "--model-control explicit and --repository-poll-seconds need --model-repository");
  }
  if (absl::Status added = AddBuiltIns(config, s); !added.ok()) return added;
  // Series of the built-ins now; those of file models as each first loads.
  std::vector<std::string> model_names;
  for (const auto& [name, entry] : *s.registry.snapshot()) model_names.push_back(name);
  s.metrics = std::make_unique<ServerMetrics>(model_names, config.batching.max_batch_size,
                                              config.batching.queue_capacity);
  s.metrics->SetBuildInfo(IsaName(ActiveIsa()), IsaName(DetectedIsa()), BlasCoreName());
  for (const auto& [name, entry] : *s.registry.snapshot()) {
    const Model& model = *entry.versions.front().model;
    s.metrics->SetModelServed(name, 1, model.kind, model.precision, true);
    s.metrics->SetModelKvCacheDtype(name, 1, model.kv_cache_dtype.value_or(KvDtype::kFloat32),
                                    true);
  }
  s.manager = std::make_unique<RepositoryManager>(
      &s.registry, s.metrics.get(),
      RepositoryOptions{.directory = config.model_repository,
                        .policy = *policy,
                        .max_file_bytes = static_cast<uint64_t>(config.max_model_file_bytes),
                        .force_fp32 = config.force_fp32,
                        .kv_cache_dtype = config.sessions.kv_dtype});
  if (config.model_repository.empty()) return absl::OkStatus();
  absl::StatusOr<RepositoryListing> listing = ScanRepository(config.model_repository);
  if (!listing.ok()) return listing.status();
  s.initial = *std::move(listing);
  for (const absl::Status& problem : s.manager->Sync(s.initial).failures) {
    if (config.strict) return problem;
    spdlog::error("model skipped: {}", std::string(problem.message()));
  }
  return absl::OkStatus();
}

// With tokens, calls without one are refused from their metadata, before
// their message is read (auth.h), and counted and logged here.
void CheckTokensEarly(RunningServer& s) {
  if (s.dispatch_options.auth_tokens.empty()) return;
  Dispatcher* const dispatcher = s.dispatcher.get();
  ServerMetrics* const metrics = s.metrics.get();
  RefusalLogLimiter* const log = &s.unauthenticated_log;
  s.credentials->SetAuthMetadataProcessor(std::make_shared<EarlyTokenCheck>(
      [dispatcher] { return dispatcher->access().tokens(); },
      [metrics, log](std::string_view api, std::string_view path) {
        metrics->CountUnauthenticatedCall(api);
        int64_t suppressed = 0;
        if (!log->Admit(&suppressed)) return;
        spdlog::warn("call refused before its message was read: api={} method='{}' "
                     "code=UNAUTHENTICATED{}",
                     api, Printable(path),
                     RefusalLogLimiter::SuppressedNote(suppressed, "refused calls"));
      }));
}

// Both APIs on --address, with health checking and reflection.
absl::Status StartGrpc(const ServerConfig& config, RunningServer& s) {
  CheckTokensEarly(s);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config.address, s.credentials, &port);
  s.attention_api =
      std::make_unique<AttentionApi>(s.dispatcher.get(), &s.registry, s.sessions.get());
  s.inference_api =
      std::make_unique<InferenceApi>(s.dispatcher.get(), s.inference_operations.get());
  builder.RegisterService(s.attention_api.get());
  builder.RegisterService(s.inference_api.get());
  if (!config.reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  builder.SetMaxReceiveMessageSize(config.max_message_bytes);
  // gRPC reads every call a client opens, whether or not the service has
  // taken it yet. Without this cap, a client sending faster than the server
  // can even parse (open loop at 3x capacity) had gRPC hold 900 MiB of
  // requests the service had not seen, growing with the backlog.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, config.max_concurrent_streams);
  for (const auto& [argument, seconds] :
       {std::pair<const char*, int64_t>{GRPC_ARG_MAX_CONNECTION_AGE_MS,
                                        config.max_connection_age_seconds},
        {GRPC_ARG_MAX_CONNECTION_IDLE_MS, config.max_connection_idle_seconds}}) {
    if (seconds > 0) {
      builder.AddChannelArgument(argument,
                                 static_cast<int>(std::min<int64_t>(seconds * 1000, INT32_MAX)));
    }
  }
  s.grpc = builder.BuildAndStart();
  if (s.grpc == nullptr || port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on --address ", config.address, " (in use or invalid)"));
  }
  // gRPC starts its health service SERVING; not before the warm-up is done.
  SetHealth(*s.grpc, false);
  s.grpc_address = WithPort(config.address, port);
  return absl::OkStatus();
}

// The REST API on --http-address; with --tls-cert over TLS from the same
// files as gRPC, rotated and with client certificates as gRPC's
// (tls_context.h).
absl::Status StartRest(const ServerConfig& config, RunningServer& s) {
  if (config.http_address.empty()) return absl::OkStatus();
  HttpOptions options = config.http;
  options.address = config.http_address;
  options.max_body_bytes = config.max_message_bytes;
  options.timeout = absl::Seconds(config.http_timeout_seconds);
  if (!config.tls_cert.empty()) {
    absl::StatusOr<std::unique_ptr<RotatingTlsContext>> tls = RotatingTlsContext::Create(
        TlsFiles{.cert = config.tls_cert, .key = config.tls_key, .client_ca = config.tls_client_ca});
    if (!tls.ok()) return tls.status();
    options.tls = *std::move(tls);
  }
  s.rest_api = std::make_unique<RestApi>(s.dispatcher.get(), s.inference_operations.get());
  RestApi* const api = s.rest_api.get();
  absl::StatusOr<std::unique_ptr<HttpServer>> http = HttpServer::Start(
      options, [api](std::shared_ptr<HttpExchange> exchange) { api->Handle(std::move(exchange)); });
  if (!http.ok()) return http.status();
  s.http = *std::move(http);
  s.http_address = WithPort(config.http_address, s.http->port());
  return absl::OkStatus();
}

absl::Status StartMetrics(const ServerConfig& config, RunningServer& s) {
  if (config.metrics_address.empty()) return absl::OkStatus();
  try {
    s.exposer = std::make_unique<prometheus::Exposer>(config.metrics_address);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot listen on --metrics-address ",
                                               config.metrics_address, ": ", e.what()));
  }
  s.exposer->RegisterCollectable(s.metrics->registry());
  const std::vector<int> ports = s.exposer->GetListeningPorts();
  s.metrics_address = WithPort(config.metrics_address, ports.empty() ? 0 : ports.front());
  return absl::OkStatus();
}

// The start-up summary: addresses, security, kernel path, limits, models.
void LogServing(const ServerConfig& config, const RunningServer& s) {
  const bool tokens = !s.dispatch_options.auth_tokens.empty();
  // The same for gRPC and REST.
  const std::string security =
      absl::StrCat(config.tls_cert.empty()
                       ? "plaintext"
                       : (config.tls_client_ca.empty() ? "TLS" : "mutual TLS"),
                   tokens ? ", bearer tokens required" : "");
  spdlog::info("listening on {} ({})", s.grpc_address, security);
  if (config.tls_cert.empty() && tokens && !IsLoopback(config.address)) {
    spdlog::warn("bearer tokens travel in plaintext: set --tls-cert and --tls-key");
  }
  if (s.http) {
    spdlog::info("REST (Open Inference Protocol v2) on {}://{}/v2 ({})",
                 config.tls_cert.empty() ? "http" : "https", s.http_address, security);
  }
  if (s.exposer) spdlog::info("metrics on {}/metrics", s.metrics_address);
  spdlog::info("kernel path {} (this CPU's best: {}), BLAS core {}", IsaName(ActiveIsa()),
               IsaName(DetectedIsa()), BlasCoreName());
  spdlog::info("batching: --max-batch-size {} --batching-delay {} --max-queue-delay-us {} "
               "--queue-capacity {}; engine threads {}; --max-message-bytes {} "
               "--max-request-elements {} --max-request-work {} --max-request-scratch-elements {} "
               "--max-queued-bytes {} --chunk-work {} --inline-work {}",
               config.batching.max_batch_size, BatchingDelayName(config.batching.delay),
               config.batching.max_queue_delay_us,
               config.batching.queue_capacity, s.engine->num_threads(), config.max_message_bytes,
               config.limits.max_request_elements, config.limits.max_request_work,
               config.limits.max_request_scratch_elements, config.max_queued_bytes,
               config.chunk_work, config.inline_work);
  // Scoped: a snapshot held on would keep these weights alive after a reload.
  const std::shared_ptr<const ModelRegistry::Index> served = s.registry.snapshot();
  spdlog::info("serving {} models (--version-policy {}, --model-control {}):", served->size(),
               config.version_policy, config.model_control);
  for (const auto& [name, entry] : *served) {
    for (const ModelVersion& version : entry.versions) {
      if (version.state != VersionState::kReady) continue;
      spdlog::info("  model {} ({}), version {}", name, Describe(*version.model), version.version);
    }
  }
}

// Where a version's warm-up runs. At start-up, on its model's batcher
// thread: a model's first batches allocate their answers there, from memory
// (that thread's malloc arena) nothing run on another thread warms (the
// first multi_head call's compute was 2.3x the steady state's with the
// warm-up run elsewhere). A version loaded later warms on the polling
// thread, while its model's batcher goes on serving the version before.
enum class WarmUpThread { kBatcher, kCaller };

// One model version's warm-up batch (warmup.h), logged; a failure is
// logged and the version serves anyway.
void WarmUpVersion(const ServerConfig& config, RunningServer& s, const Model& model,
                   int64_t version, WarmUpThread thread) {
  try {
    if (config.test_gate_warmup && s.test_gate && model.name == kTestGateModelName) {
      s.test_gate->Pass();
    }
  } catch (const std::exception& e) {
    spdlog::warn("warm-up: model {} version {} skipped: {}", model.name, version, e.what());
    return;
  }
  absl::StatusOr<WarmUpReport> report = absl::UnknownError("the warm-up did not run");
  const auto warm_up = [&] {
    report = WarmUp(*s.engine, model,
                    WarmUpOptions{.limits = config.limits,
                                  .batch_size = config.batching.max_batch_size,
                                  .work_budget = config.warmup_work_budget});
  };
  if (thread == WarmUpThread::kCaller) {
    warm_up();
  } else if (absl::Status ran = s.dispatcher->RunOnBatcherThread(model.name, warm_up);
             !ran.ok()) {
    report = ran;
  }
  if (!report.ok()) {
    spdlog::warn("warm-up: model {} version {} not warmed up: {}", model.name, version,
                 report.status().ToString());
    return;
  }
  std::string runs;
  for (const WarmUpRun& run : report->runs) {
    absl::StrAppend(&runs, runs.empty() ? "" : ", then ", run.requests,
                    run.requests == 1 ? " request of " : " requests of ", run.dims.num_queries,
                    " queries and keys");
  }
  spdlog::info("warm-up: model {} version {}: {} in {:.1f} ms on {} engine threads; engine "
               "scratch kept {:.1f} MiB",
               model.name, version, runs, absl::ToDoubleMilliseconds(report->took),
               s.engine->num_threads(), s.engine->kept_scratch_bytes() / 1048576.0);
}

// Every version served at start-up, then each one loaded later before it is
// swapped in; readiness stays false until the first part is done.
void WarmUpModels(const ServerConfig& config, RunningServer& s) {
  if (!config.warmup) return;
  spdlog::info("warm-up before serving on {}{}: health NOT_SERVING until it is done",
               s.grpc_address, s.http ? absl::StrCat(" and http://", s.http_address) : "");
  const absl::Time start = absl::Now();
  int versions = 0;
  {
    const std::shared_ptr<const ModelRegistry::Index> served = s.registry.snapshot();
    for (const auto& [name, entry] : *served) {
      for (const ModelVersion& version : entry.versions) {
        if (version.state != VersionState::kReady) continue;
        WarmUpVersion(config, s, *version.model, version.version, WarmUpThread::kBatcher);
        ++versions;
      }
    }
  }
  spdlog::info("warm-up: {} model versions in {:.1f} ms (--warmup-work-budget {})", versions,
               absl::ToDoubleMilliseconds(absl::Now() - start), config.warmup_work_budget);
}

void StartPolling(const ServerConfig& config, RunningServer& s) {
  if (config.repository_poll_seconds <= 0) return;
  RepositoryManager* const manager = s.manager.get();
  s.poller = std::make_unique<RepositoryPoller>(
      config.model_repository, absl::Seconds(config.repository_poll_seconds), s.initial,
      [manager](const RepositoryListing& stable) {
        const RepositoryManager::Report report = manager->Sync(stable);
        for (const std::string& change : report.changes) spdlog::info("repository: {}", change);
        for (const absl::Status& failure : report.failures) {
          spdlog::error("repository: model not loaded, what served before stays: {}",
                        std::string(failure.message()));
        }
      });
  spdlog::info("polling {} every {} s for model changes", config.model_repository,
               config.repository_poll_seconds);
}

}  // namespace

void SetHealth(grpc::Server& server, bool serving) {
  grpc::HealthCheckServiceInterface* health = server.GetHealthCheckService();
  health->SetServingStatus(serving);
  for (const char* name : kHealthServiceNames) health->SetServingStatus(name, serving);
}

// Everything up to serving: the kernel path, credentials, models, the
// dispatcher, gRPC, metrics, polling and the port file.
absl::Status Start(const ServerConfig& config, RunningServer& s) {
  if (absl::Status selected = SelectKernelPath(config); !selected.ok()) return selected;
  absl::StatusOr<DispatchOptions> options = ReadDispatchOptions(config);
  if (!options.ok()) return options.status();
  s.dispatch_options = *std::move(options);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = TlsCredentials(
      TlsFiles{.cert = config.tls_cert, .key = config.tls_key, .client_ca = config.tls_client_ca});
  if (!credentials.ok()) return credentials.status();
  s.credentials = *std::move(credentials);
  if (absl::Status loaded = LoadModels(config, s); !loaded.ok()) return loaded;
  s.engine = std::make_unique<Engine>(EngineOptions{.num_threads = config.threads});
  absl::StatusOr<std::unique_ptr<Dispatcher>> dispatcher =
      Dispatcher::Create(&s.registry, s.engine.get(), s.metrics.get(), s.dispatch_options);
  if (!dispatcher.ok()) return dispatcher.status();
  s.dispatcher = *std::move(dispatcher);
  s.sessions = std::make_unique<SessionTable>(config.sessions, config.limits, s.metrics.get());
  s.inference_operations = std::make_unique<InferenceOperations>(
      s.dispatcher.get(), &s.registry,
      config.model_control == "explicit" ? s.manager.get() : nullptr, s.metrics.get(),
      s.sessions.get());
  if (config.warmup) {
    s.dispatcher->SetWarmedUp(false);
    s.manager->SetWarmUp([&config, &s](const Model& model, int64_t version) {
      WarmUpVersion(config, s, model, version, WarmUpThread::kCaller);
    });
  }
  if (absl::Status started = StartGrpc(config, s); !started.ok()) return started;
  absl::Status serving = StartRest(config, s);
  if (serving.ok()) serving = StartMetrics(config, s);
  if (serving.ok()) {
    WarmUpModels(config, s);
    s.dispatcher->SetWarmedUp(true);
    SetHealth(*s.grpc, true);
    LogServing(config, s);
    StartPolling(config, s);
    if (!config.port_file.empty()) {
      serving =
          WritePortFile(config.port_file, s.grpc_address, s.metrics_address, s.http_address);
    }
  }
  if (!serving.ok()) s.grpc->Shutdown();
  return serving;
}

}  // namespace attention::server
