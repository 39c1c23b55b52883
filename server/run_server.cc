// run_server.cc: attention-server's life from start-up to exit.
#include "server/run_server.h"

#include <semaphore.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <atomic>
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
#include "core/cpu_features.h"
#include "core/engine.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "prometheus/exposer.h"
#include "server/attention_service.h"
#include "server/auth.h"
#include "server/inference_service.h"
#include "server/logging.h"
#include "server/metrics.h"
#include "server/repository_manager.h"
#include "server/repository_poller.h"
#include "server/repository_registry.h"
#include "server/repository_scan.h"
#include "server/request_names.h"
#include "server/test_gate.h"
#include "server/tls_credentials.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// The services health answers for by name, besides the server's "".
constexpr const char* kHealthServiceNames[] = {"attention.v1.AttentionService",
                                               "inference.GRPCInferenceService"};
// Least time from NOT_SERVING to the end of the process (see RunServer).
constexpr absl::Duration kFlushPause = absl::Milliseconds(100);

// "0.0.0.0:0" with port 51234 bound -> "0.0.0.0:51234".
std::string WithPort(const std::string& address, int port) {
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
                           const std::string& metrics_address) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary);
    out << "grpc " << grpc_address << "\n";
    if (!metrics_address.empty()) out << "metrics " << metrics_address << "\n";
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
  return sizes;
}

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
void ReloadTokens(const std::string& path, AttentionService& service) {
  absl::StatusOr<std::vector<std::string>> tokens = ReadTokenFile(path);
  if (!tokens.ok()) {
    spdlog::error("SIGHUP: --auth-token-file not reloaded, the previous tokens stay: {}",
                  std::string(tokens.status().message()));
    return;
  }
  const size_t count = tokens->size();
  service.ReplaceAuthTokens(*std::move(tokens));
  spdlog::info("SIGHUP: --auth-token-file reloaded ({} tokens)", count);
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

int Fail(const absl::Status& status) {
  spdlog::critical("cannot start: {}", status.ToString());
  return 1;
}

}  // namespace

int RunServer(const ServerConfig& config) {
  if (absl::Status s = CatchSignals(); !s.ok()) return Fail(s);

  if (absl::Status s = ConfigureLogging(config.log_level, config.log_format); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 2;
  }

  if (!config.isa.empty()) {
    absl::StatusOr<Isa> isa = ParseIsa(config.isa);
    if (!isa.ok()) return Fail(isa.status());
    if (absl::Status s = SelectIsa(*isa); !s.ok()) {
      return Fail(absl::FailedPreconditionError(absl::StrCat("--isa: ", s.message())));
    }
  }

  ServiceOptions service_options;
  service_options.limits = config.limits;
  service_options.batching = config.batching;
  service_options.max_queued_bytes = config.max_queued_bytes;
  if (!config.auth_token_file.empty()) {
    absl::StatusOr<std::vector<std::string>> tokens = ReadTokenFile(config.auth_token_file);
    if (!tokens.ok()) return Fail(tokens.status());
    service_options.auth_tokens = *std::move(tokens);
  }
  for (absl::string_view name : absl::StrSplit(config.tls_client_allow, ',', absl::SkipWhitespace())) {
    service_options.allowed_client_identities.emplace_back(absl::StripAsciiWhitespace(name));
  }
  if (!service_options.allowed_client_identities.empty() && config.tls_client_ca.empty()) {
    return Fail(absl::InvalidArgumentError(
        "--tls-client-allow needs --tls-client-ca (mutual TLS): without client certificates "
        "there is no identity to check"));
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials = TlsCredentials(config);
  if (!credentials.ok()) return Fail(credentials.status());

  absl::StatusOr<VersionPolicy> policy = ParseVersionPolicy(config.version_policy);
  if (!policy.ok()) return Fail(policy.status());
  const bool explicit_control = config.model_control == "explicit";
  if (config.model_repository.empty() && (explicit_control || config.repository_poll_seconds > 0)) {
    return Fail(absl::InvalidArgumentError(
        "--model-control explicit and --repository-poll-seconds need --model-repository"));
  }
  ModelRegistry registry;
  for (Model built_in : {DotProductModel(), DistanceModel()}) {
    if (absl::Status s = registry.AddBuiltIn(std::move(built_in)); !s.ok()) return Fail(s);
  }
  std::unique_ptr<TestGate> test_gate;
  if (!config.test_gate_fifo.empty()) {
    absl::StatusOr<std::unique_ptr<TestGate>> opened = TestGate::Open(config.test_gate_fifo);
    if (!opened.ok()) return Fail(opened.status());
    test_gate = *std::move(opened);
    if (absl::Status s = registry.AddBuiltIn(TestGate::GateModel()); !s.ok()) return Fail(s);
    service_options.test_gate = test_gate.get();
    spdlog::warn("test gate on: batches of model '{}' wait for bytes on {}", kTestGateModelName,
                 config.test_gate_fifo);
  }

  // Series of the built-ins now; those of file models as each first loads.
  std::vector<std::string> model_names;
  for (const auto& [name, entry] : *registry.snapshot()) model_names.push_back(name);
  ServerMetrics metrics(model_names, config.batching.max_batch_size,
                        config.batching.queue_capacity);
  metrics.SetBuildInfo(IsaName(ActiveIsa()), IsaName(DetectedIsa()), BlasCoreName());
  for (const auto& [name, entry] : *registry.snapshot()) {
    metrics.SetModelServed(name, 1, entry.versions.front().model->kind, true);
  }
  RepositoryManager manager(&registry, &metrics,
                            RepositoryOptions{.directory = config.model_repository,
                                              .policy = *policy,
                                              .max_file_bytes = static_cast<uint64_t>(
                                                  config.max_model_file_bytes)});
  RepositoryListing initial;
  if (!config.model_repository.empty()) {
    absl::StatusOr<RepositoryListing> listing = ScanRepository(config.model_repository);
    if (!listing.ok()) return Fail(listing.status());
    initial = *std::move(listing);
    for (const absl::Status& problem : manager.Sync(initial).failures) {
      if (config.strict) return Fail(problem);
      spdlog::error("model skipped: {}", std::string(problem.message()));
    }
  }
  Engine engine(EngineOptions{.num_threads = config.threads});
  absl::StatusOr<std::unique_ptr<AttentionService>> service =
      AttentionService::Create(&registry, &engine, &metrics, service_options);
  if (!service.ok()) return Fail(service.status());

  // Refusals of the early token check, logged as the service logs its own
  // (at most AttentionService::kRefusalLinesPerSecond lines a second).
  RefusalLogLimiter unauthenticated_log(AttentionService::kRefusalLinesPerSecond);
  if (!service_options.auth_tokens.empty()) {
    AttentionService* const attention = service->get();
    (*credentials)
        ->SetAuthMetadataProcessor(std::make_shared<EarlyTokenCheck>(
            [attention] { return attention->auth_tokens(); },
            [&metrics, &unauthenticated_log](std::string_view api, std::string_view path) {
              metrics.CountUnauthenticatedCall(api);
              int64_t suppressed = 0;
              if (!unauthenticated_log.Admit(&suppressed)) return;
              spdlog::warn("call refused before its message was read: api={} method='{}' "
                           "code=UNAUTHENTICATED{}",
                           api, Printable(path),
                           RefusalLogLimiter::SuppressedNote(suppressed, "refused calls"));
            }));
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config.address, *credentials, &port);
  builder.RegisterService(service->get());
  InferenceService inference_service(service->get(), &registry,
                                     explicit_control ? &manager : nullptr, &metrics);
  builder.RegisterService(&inference_service);
  if (!config.reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  builder.SetMaxReceiveMessageSize(config.max_message_bytes);
  // gRPC reads every call a client opens, whether or not the service has
  // taken it yet. Without this cap, a client sending faster than the server
  // can even parse (open loop at 3x capacity) had gRPC hold 900 MiB of
  // requests the service had not seen, growing with the backlog.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, config.max_concurrent_streams);
  if (config.max_connection_age_seconds > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               static_cast<int>(std::min<int64_t>(
                                   config.max_connection_age_seconds * 1000, INT32_MAX)));
  }
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail(absl::UnavailableError(
        absl::StrCat("cannot listen on --address ", config.address, " (in use or invalid)")));
  }
  const std::string grpc_address = WithPort(config.address, port);

  std::unique_ptr<prometheus::Exposer> exposer;
  std::string metrics_address;
  if (!config.metrics_address.empty()) {
    try {
      exposer = std::make_unique<prometheus::Exposer>(config.metrics_address);
    } catch (const std::exception& e) {
      server->Shutdown();
      return Fail(absl::UnavailableError(absl::StrCat(
          "cannot listen on --metrics-address ", config.metrics_address, ": ", e.what())));
    }
    exposer->RegisterCollectable(metrics.registry());
    const std::vector<int> ports = exposer->GetListeningPorts();
    metrics_address = WithPort(config.metrics_address, ports.empty() ? 0 : ports.front());
  }

  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(true);
  for (const char* name : kHealthServiceNames) health->SetServingStatus(name, true);

  spdlog::info("listening on {} ({}{})", grpc_address,
               config.tls_cert.empty() ? "plaintext"
                                       : (config.tls_client_ca.empty() ? "TLS" : "mutual TLS"),
               service_options.auth_tokens.empty() ? "" : ", bearer tokens required");
  if (config.tls_cert.empty() && !service_options.auth_tokens.empty() &&
      !IsLoopback(config.address)) {
    spdlog::warn("bearer tokens travel in plaintext: set --tls-cert and --tls-key");
  }
  if (exposer) spdlog::info("metrics on {}/metrics", metrics_address);
  spdlog::info("kernel path {} (this CPU's best: {}), BLAS core {}", IsaName(ActiveIsa()),
               IsaName(DetectedIsa()), BlasCoreName());
  spdlog::info("batching: --max-batch-size {} --max-queue-delay-us {} --queue-capacity {}; "
               "engine threads {}; --max-message-bytes {} --max-request-elements {} "
               "--max-request-work {} --max-request-scratch-elements {} --max-queued-bytes {}",
               config.batching.max_batch_size, config.batching.max_queue_delay_us,
               config.batching.queue_capacity, engine.num_threads(), config.max_message_bytes,
               config.limits.max_request_elements, config.limits.max_request_work,
               config.limits.max_request_scratch_elements, config.max_queued_bytes);
  {
    // Scoped: a snapshot held on would keep these weights alive after a reload.
    const std::shared_ptr<const ModelRegistry::Index> served = registry.snapshot();
    spdlog::info("serving {} models (--version-policy {}, --model-control {}):", served->size(),
                 config.version_policy, config.model_control);
    for (const auto& [name, entry] : *served) {
      for (const ModelVersion& version : entry.versions) {
        if (version.state != VersionState::kReady) continue;
        spdlog::info("  model {} ({}), version {}", name, Describe(*version.model),
                     version.version);
      }
    }
  }
  std::unique_ptr<RepositoryPoller> poller;
  if (config.repository_poll_seconds > 0) {
    poller = std::make_unique<RepositoryPoller>(
        config.model_repository, absl::Seconds(config.repository_poll_seconds), initial,
        [&manager](const RepositoryListing& stable) {
          const RepositoryManager::Report report = manager.Sync(stable);
          for (const std::string& change : report.changes) spdlog::info("repository: {}", change);
          for (const absl::Status& failure : report.failures) {
            spdlog::error("repository: model not loaded, what served before stays: {}",
                          std::string(failure.message()));
          }
        });
    spdlog::info("polling {} every {} s for model changes", config.model_repository,
                 config.repository_poll_seconds);
  }
  if (!config.port_file.empty()) {
    if (absl::Status s = WritePortFile(config.port_file, grpc_address, metrics_address); !s.ok()) {
      server->Shutdown();
      return Fail(s);
    }
  }

  const int signal_number = WaitForTermination([&] {
    if (config.auth_token_file.empty()) {
      spdlog::info("SIGHUP: no --auth-token-file to reload");
    } else {
      ReloadTokens(config.auth_token_file, **service);
    }
  });
  spdlog::info("{} received: refusing new calls for --drain-delay-seconds {}, then finishing "
               "accepted calls for up to --shutdown-grace-seconds {}",
               signal_number == SIGTERM ? "SIGTERM" : "SIGINT", config.drain_delay_seconds,
               config.shutdown_grace_seconds);
  health->SetServingStatus(false);
  for (const char* name : kHealthServiceNames) health->SetServingStatus(name, false);
  const absl::Time not_serving_since = absl::Now();
  // While accepted calls finish, the server keeps answering new calls itself
  // (UNAVAILABLE, and NOT_SERVING to health checks), which clients retry
  // elsewhere. The delay gives load balancers time to see NOT_SERVING before
  // the listener goes; accepted calls go on computing meanwhile.
  (*service)->StopAccepting();
  absl::SleepFor(absl::Seconds(config.drain_delay_seconds));
  const absl::Time grace_end = absl::Now() + absl::Seconds(config.shutdown_grace_seconds);
  // WaitForIdle() waits for each call's OnDone, not just for its answers:
  // with streams still writing when Shutdown() began, gRPC 1.51 now and then
  // closed their connections with answers undelivered (clients saw
  // "Connection reset by peer", 3 to 10 shutdowns in 100 under stream load).
  if ((*service)->WaitForIdle(grace_end)) {
    // Every accepted call is answered. gRPC's Shutdown() is not used from
    // here: a call that reaches it after Shutdown() began (sent before the
    // client saw the GOAWAY) is dropped by gRPC and the client sees
    // CANCELLED, which clients do not retry (issue 14: 1 to 29 calls in 6 of
    // 8 SIGTERMs under closed-loop load). Ending the process closes the
    // connections instead, and a call in transit then fails UNAVAILABLE.
    (*service)->Drain();
    // Health watchers and refused calls are not waited for; a moment lets
    // gRPC flush their NOT_SERVING and UNAVAILABLE (lost, the client still
    // sees UNAVAILABLE, from the closed connection).
    absl::SleepFor(not_serving_since + kFlushPause - absl::Now());
    spdlog::info("stopped");
    spdlog::shutdown();
    std::fflush(nullptr);
    std::_Exit(0);
  }
  spdlog::warn("calls still open after --shutdown-grace-seconds; cancelling them");
  // A held batch would keep its calls, hence Shutdown(), waiting forever.
  if (test_gate) test_gate->Stop();
  // Returns once every call is finished: the calls still open are cancelled,
  // which the batchers answer without computing.
  server->Shutdown(absl::ToChronoTime(absl::Now()));
  (*service)->Drain();
  server->Wait();
  spdlog::info("stopped");
  // Not destroyed: ~Exposer waits up to 2 s for civetweb's poll loop, and the
  // process ends right after this anyway.
  static_cast<void>(exposer.release());
  return 0;
}

}  // namespace attention::server
