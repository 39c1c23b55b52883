// metrics.h: the Prometheus metrics of attention-server (names as docs/api.md
// lists them).
//
//   attention_requests_total{model,code}       counter; code is the gRPC status
//                                               name ("OK", "INVALID_ARGUMENT"...)
//   attention_request_duration_seconds{model}  arrival to answer
//   attention_queue_duration_seconds{model}    time in the batcher's queue
//   attention_compute_duration_seconds{model}  the execution that computed it
//   attention_batch_size{model}                requests per engine execution
//   attention_queue_depth{model}               requests waiting now
//   attention_queue_capacity{model}            requests the queue holds at most
//                                               (so alerts need not hard-code it)
//   attention_inflight_requests                requests accepted, not answered
//   attention_streams_refused_total{api,code} stream calls (AttendStream,
//                                               ModelStreamInfer) refused as a
//                                               whole before any request was
//                                               read (opened while draining,
//                                               or a token dropped by a
//                                               reload), which the requests
//                                               counter cannot see
//   attention_unauthenticated_calls_total{api} calls refused UNAUTHENTICATED
//                                               from their metadata, before
//                                               the message was read (api:
//                                               "attention" or "inference")
//   attention_api_requests_total{api,model,code}
//                                               the same count split by the API
//                                               that served the request:
//                                               "attention" (attention.v1) or
//                                               "inference" (Open Inference
//                                               Protocol); an extension
//   attention_build_info{isa,detected_isa,blas_core,version}
//                                               1: the kernel path running, the
//                                               best this CPU runs, the BLAS
//                                               kernel core, the server version
//   attention_model_info{model,version,kind}    1 per version served now; the
//                                               series goes with the version
//   attention_model_load_failures_total{model}  model files that failed to
//                                               load (a failed reload included)
//   attention_sessions_open                     decoding sessions open now
//                                               (streams and sequences)
//   attention_session_pool_used_bytes           keys and values they hold
//   attention_session_pool_capacity_bytes       --session-memory-bytes
//   attention_session_pool_shared_bytes         of the used bytes, blocks two
//                                               or more sessions share
//   attention_session_pool_cached_bytes         blocks no session holds, kept
//                                               for a later prompt until the
//                                               pool needs the room (keys,
//                                               values, prompts' outputs)
//   attention_session_prefix_query_tokens_total prompt tokens looked up in
//                                               the shared and cached blocks
//   attention_session_prefix_hit_tokens_total   those found there
//   attention_sessions_opened_total{model}      sessions opened
//   attention_sessions_ended_total{reason}      sessions ended: closed,
//                                               expired, replaced, failed,
//                                               shutdown
//   attention_session_steps_total{model}        steps answered OK
//   attention_session_tokens_total{model}       their new rows (per example
//                                               times B)
//
// `model` is a served model's name, or empty for a request naming no served
// model, so clients cannot create label values at will: a model's series are
// created when its name first appears in the repository (AddModel). Durations use buckets
// from 50 us to 10 s.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "core/model/model.h"

namespace attention::server {

// What a model's ModelStatistics (Open Inference Protocol) reports beyond the
// series below, which do not split durations by success and failure.
struct ModelTotals {
  std::atomic<uint64_t> success_count{0};
  std::atomic<uint64_t> success_ns{0};
  std::atomic<uint64_t> fail_count{0};
  std::atomic<uint64_t> fail_ns{0};
  std::atomic<int64_t> last_answer_ms{0};  // since the epoch; 0: never

  // One answered request that took `total` from arrival to answer.
  void Count(bool ok, absl::Duration total);
};

// The series of one model, created up front so the hot path only observes.
struct ModelMetrics {
  prometheus::Histogram* request_duration;
  prometheus::Histogram* queue_duration;
  prometheus::Histogram* compute_duration;
  prometheus::Histogram* batch_size;
  prometheus::Gauge* queue_depth;
  ModelTotals* totals;  // owned by ServerMetrics
};

class ServerMetrics {
 public:
  // Series for every name in `models`; batch sizes bucketed up to max_batch_size.
  ServerMetrics(const std::vector<std::string>& models, int max_batch_size, int queue_capacity);

  // The series of `model`, created now at zero if they do not exist yet.
  // Stable for the lifetime of this object; only for names of served models.
  ModelMetrics* AddModel(std::string_view model);
  // nullptr for a name never given to the constructor or AddModel().
  ModelMetrics* ForModel(std::string_view model);
  // attention_model_info{model,version,kind}: 1 while served, removed after.
  void SetModelServed(std::string_view model, int64_t version, Kind kind, Precision precision,
                      bool served);
  // attention_model_kv_cache_dtype_info{model,version,kv_cache_dtype}: 1
  // while served, removed after: what the version's sessions hold keys and
  // values in.
  void SetModelKvCacheDtype(std::string_view model, int64_t version, KvDtype dtype, bool served);
  // attention_model_load_failures_total{model}.
  void CountLoadFailure(std::string_view model);
  // Counts one answered request; `model` as in ForModel, or "" for none.
  void CountRequest(std::string_view model, absl::StatusCode code);
  // Counts it again by the API that served it.
  void CountApiRequest(std::string_view api, std::string_view model, absl::StatusCode code);
  // attention_build_info{isa,detected_isa,blas_core,version} 1: the kernel
  // path that runs, the best this CPU runs, and the BLAS kernel core.
  void SetBuildInfo(std::string_view isa, std::string_view detected_isa,
                    std::string_view blas_core);
  // Counts one AttendStream call refused before it read a request.
  // Counts one stream call (AttendStream: `api` "attention"; ModelStreamInfer:
  // "inference") refused before it read a request.
  void CountRefusedStream(std::string_view api, absl::StatusCode code);
  // Counts one call refused UNAUTHENTICATED from its metadata, before any
  // service saw it; `api` is "attention" or "inference".
  void CountUnauthenticatedCall(std::string_view api);
  prometheus::Gauge& inflight() { return *inflight_; }

  // Decoding sessions (server/sessions/session_table.h).
  void SetSessionGauges(int open, int64_t pool_used_bytes, int64_t pool_capacity_bytes);
  // The pool's prefix sharing: its shared and cached bytes now, and its
  // prompt tokens looked up and found since it began (the counters grow by
  // the difference from the last call).
  void SetSessionPrefixStats(int64_t shared_bytes, int64_t cached_bytes, int64_t query_tokens,
                             int64_t hit_tokens);
  void CountSessionOpened(std::string_view model);
  void CountSessionEnd(std::string_view reason);
  // A model's step and token counters, looked up once per session so that
  // a step builds no label map.
  struct SessionCounters {
    prometheus::Counter* steps;
    prometheus::Counter* tokens;
  };
  SessionCounters SessionCountersFor(std::string_view model);

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  const int max_batch_size_;
  const int queue_capacity_;
  prometheus::Family<prometheus::Histogram>* request_duration_;
  prometheus::Family<prometheus::Histogram>* queue_duration_;
  prometheus::Family<prometheus::Histogram>* compute_duration_;
  prometheus::Family<prometheus::Histogram>* batch_size_;
  prometheus::Family<prometheus::Gauge>* queue_depth_;
  prometheus::Family<prometheus::Gauge>* queue_capacity_gauge_;
  prometheus::Family<prometheus::Gauge>* model_info_;
  prometheus::Family<prometheus::Gauge>* model_kv_cache_dtype_;
  prometheus::Family<prometheus::Counter>* load_failures_;
  prometheus::Family<prometheus::Counter>* requests_;
  prometheus::Family<prometheus::Counter>* refused_streams_;
  prometheus::Family<prometheus::Counter>* unauthenticated_calls_;
  prometheus::Family<prometheus::Counter>* api_requests_;
  prometheus::Gauge* inflight_;
  prometheus::Gauge* sessions_open_;
  prometheus::Gauge* session_pool_used_;
  prometheus::Gauge* session_pool_capacity_;
  prometheus::Gauge* session_pool_shared_;
  prometheus::Gauge* session_pool_cached_;
  prometheus::Counter* prefix_query_tokens_;
  prometheus::Counter* prefix_hit_tokens_;
  absl::Mutex prefix_mu_;
  int64_t prefix_query_counted_ ABSL_GUARDED_BY(prefix_mu_) = 0;
  int64_t prefix_hit_counted_ ABSL_GUARDED_BY(prefix_mu_) = 0;
  prometheus::Family<prometheus::Counter>* sessions_opened_;
  prometheus::Family<prometheus::Counter>* sessions_ended_;
  prometheus::Family<prometheus::Counter>* session_steps_;
  prometheus::Family<prometheus::Counter>* session_tokens_;

  // The request counters of a model, kept once created so that counting a
  // request builds no label map: prometheus-cpp's Family::Add (labels as a
  // std::map of strings, hashed, under the family's lock) took 2% of a
  // trivial request's server CPU (BENCHMARKS.md). A series is still created
  // by the first request it counts, as docs/api.md section 7 says.
  static constexpr size_t kStatusCodes = 17;  // absl::StatusCode 0..16
  static constexpr std::array<std::string_view, 3> kApis = {"attention", "inference", "http"};
  struct RequestCounters {
    std::array<std::atomic<prometheus::Counter*>, kStatusCodes> requests{};
    std::array<std::array<std::atomic<prometheus::Counter*>, kStatusCodes>, kApis.size()>
        api_requests{};
  };
  void AddSessionMetrics();
  // The kept slot for (model, code), or for (api, model, code) when `api`
  // is set; nullptr for a name or code with no slot (counted the slow way).
  std::atomic<prometheus::Counter*>* Slot(std::string_view model, absl::StatusCode code,
                                          const std::string_view* api);

  absl::Mutex models_mu_;
  // Node-based, so the addresses ForModel() hands out stay valid.
  std::map<std::string, ModelMetrics, std::less<>> models_ ABSL_GUARDED_BY(models_mu_);
  std::vector<std::unique_ptr<ModelTotals>> totals_ ABSL_GUARDED_BY(models_mu_);
  // Same keys as models_; a slot's address is stable once its model is added.
  std::map<std::string, std::unique_ptr<RequestCounters>, std::less<>> request_counters_
      ABSL_GUARDED_BY(models_mu_);
};

// Seconds, as Prometheus wants them.
inline double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

}  // namespace attention::server
