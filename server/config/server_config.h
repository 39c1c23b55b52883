// server_config.h: everything an operator can set on attention-server.
//
// Each field is one command-line flag (server_flags.h) and one ATTENTION_*
// environment variable; the defaults here are the documented defaults
// (docs/api.md). Settings that belong to a lower layer are that layer's
// struct, embedded, so that each default is defined once, where it is used:
// batching in BatcherOptions (server/batcher.h), request size caps in Limits
// (core/engine/request.h).
#pragma once

#include <cstdint>
#include <string>

#include "core/engine/request.h"
#include "server/api/rest/http_transport.h"
#include "server/dispatch/batcher.h"
#include "server/dispatch/dispatch_options.h"
#include "server/sessions/session_table.h"

namespace attention::server {

struct ServerConfig {
  // gRPC listening address; port 0 picks a free port (see port_file).
  std::string address = "0.0.0.0:50051";
  // Prometheus endpoint (path /metrics); empty disables it.
  std::string metrics_address = "0.0.0.0:9464";
  // REST (Open Inference Protocol over HTTP/1.1) listening address; empty
  // disables it.
  std::string http_address = "0.0.0.0:8000";
  // The REST listener's threads and connection cap (its header and body caps
  // follow from max_message_bytes).
  HttpOptions http;
  double http_timeout_seconds = 30.0;
  // Directory of *.safetensors models; empty: built-ins only.
  std::string model_repository;
  // A model file that fails to load stops the server instead of being skipped.
  bool strict = false;
  // Model files larger than this are skipped (or fatal with --strict); 0: no cap.
  int64_t max_model_file_bytes = int64_t{1} << 30;
  // Seconds between scans of the repository for new, changed and removed
  // files (fractions allowed); 0: the repository is read once, at start-up.
  double repository_poll_seconds = 0.0;
  // Which versions of a model are served: "latest" (the highest-numbered
  // one) or "all".
  std::string version_policy = "latest";
  // "none", or "explicit": RepositoryModelLoad/Unload may load and unload
  // models (needs model_repository).
  std::string model_control = "none";

  // Batching, per model: --max-batch-size, --max-queue-delay-us,
  // --queue-capacity (the clock stays the real one).
  BatcherOptions batching;

  // Largest request message accepted by gRPC.
  int max_message_bytes = 64 << 20;
  // --max-request-elements, --max-request-work, --max-request-scratch-elements.
  Limits limits;
  // Most request bytes held at once, all models together; 0: no cap.
  int64_t max_queued_bytes = DispatchOptions{}.max_queued_bytes;
  // Work units of one piece of a long session step (--chunk-work); 0: whole.
  int64_t chunk_work = DispatchOptions{}.chunk_work;
  // Work units of the largest request computed on its receiving thread
  // (--inline-work); 0: none.
  int64_t inline_work = DispatchOptions{}.inline_work;
  // Decoding sessions: --session-memory-bytes, --max-sessions,
  // --max-session-length, --session-idle-seconds, --session-preemption,
  // --no-prefix-sharing.
  SessionOptions sessions;
  // Engine worker threads; 0 = one per hardware thread.
  int threads = 0;
  // Kernel path (avx512_bf16, avx512, avx2, portable); empty = the best this
  // CPU runs.
  std::string isa;
  // Every model computes in fp32, whatever its "precision" says: for
  // comparisons and rollback.
  bool force_fp32 = false;
  // Before serving, each model version computes a batch and a large request
  // (warmup.h), and health stays NOT_SERVING until every start-up model has.
  bool warmup = true;
  // Most work units of one version's warm-up, half each for its batch and
  // its large request; about 60 ms of one AVX-512 core.
  int64_t warmup_work_budget = int64_t{1} << 31;

  // After SIGTERM/SIGINT, time during which health says NOT_SERVING and new
  // calls get UNAVAILABLE before the server waits for accepted calls and
  // stops; lets load balancers stop sending first.
  double drain_delay_seconds = 0.0;
  // Time given to accepted requests after the drain delay.
  double shutdown_grace_seconds = 20.0;
  // Calls one client connection may have open at once (HTTP/2
  // MAX_CONCURRENT_STREAMS); a client's further calls wait on its side.
  int max_concurrent_streams = 256;
  // Connections are closed (gracefully) after this long so that clients
  // re-resolve and spread over new replicas; 0 = never.
  int64_t max_connection_age_seconds = 0;
  // Connections with no call open for this long are closed (gracefully),
  // so idle connections do not hold server memory; 0 = never.
  int64_t max_connection_idle_seconds = 0;

  std::string log_level = "info";
  std::string log_format = "text";

  // TLS: PEM server certificate chain and key; with tls_client_ca, clients
  // must present a certificate signed by that CA (mutual TLS).
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  // With tls_client_ca: comma-separated client certificate names (SAN or CN)
  // allowed to call; empty: any certificate the CA signed.
  std::string tls_client_allow;
  // Offer gRPC server reflection (service and message descriptions), which
  // tools like grpcurl use; off hides the API from anonymous callers.
  bool reflection = true;
  // File of accepted bearer tokens, one per line ('#' starts a comment).
  std::string auth_token_file;

  // Once serving, the bound addresses are written here ("grpc HOST:PORT" and
  // "metrics HOST:PORT" lines), for tests and scripts that use port 0.
  std::string port_file;

  // For tests only (test_gate.h): a FIFO whose bytes release the batches of
  // the extra built-in model `gate`; empty: no such model.
  std::string test_gate_fifo;
  // For tests only: the start-up warm-up of the model `gate` waits for a
  // byte from test_gate_fifo too, so a test sees the server before it is
  // ready.
  bool test_gate_warmup = false;
};

}  // namespace attention::server
