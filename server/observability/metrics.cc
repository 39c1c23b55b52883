// metrics.cc: metric families and their per-model series.
#include "server/observability/metrics.h"

#include <string>

#include "absl/status/status.h"
#include "absl/time/clock.h"

namespace attention::server {
namespace {

// 50 us to 10 s in 1-2.5-5 steps: fine where small requests live, wide enough
// for the largest ones.
const prometheus::Histogram::BucketBoundaries& DurationBuckets() {
  static const auto* const buckets = new prometheus::Histogram::BucketBoundaries{
      50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
      50e-3, 100e-3, 250e-3, 500e-3, 1.0,  2.5,    5.0,  10.0};
  return *buckets;
}

// The series `slot` keeps, created by `add` the first time. Racing callers
// store the same pointer: Family::Add returns the one series of its labels.
template <typename AddSeries>
prometheus::Counter& KeptSeries(std::atomic<prometheus::Counter*>* slot, AddSeries add) {
  if (slot == nullptr) return add();
  prometheus::Counter* counter = slot->load(std::memory_order_acquire);
  if (counter == nullptr) {
    counter = &add();
    slot->store(counter, std::memory_order_release);
  }
  return *counter;
}

// 1, 2, 4, ... up to and including max_batch_size.
prometheus::Histogram::BucketBoundaries BatchSizeBuckets(int max_batch_size) {
  prometheus::Histogram::BucketBoundaries buckets;
  for (int size = 1; size < max_batch_size; size *= 2) buckets.push_back(size);
  buckets.push_back(max_batch_size);
  return buckets;
}

}  // namespace

void ModelTotals::Count(bool ok, absl::Duration total) {
  const auto ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(total));
  (ok ? success_count : fail_count).fetch_add(1, std::memory_order_relaxed);
  (ok ? success_ns : fail_ns).fetch_add(ns, std::memory_order_relaxed);
  last_answer_ms.store(absl::ToUnixMillis(absl::Now()), std::memory_order_relaxed);
}

ServerMetrics::ServerMetrics(const std::vector<std::string>& models, int max_batch_size,
                             int queue_capacity)
    : registry_(std::make_shared<prometheus::Registry>()),
      max_batch_size_(max_batch_size),
      queue_capacity_(queue_capacity) {
  requests_ = &prometheus::BuildCounter()
                   .Name("attention_requests_total")
                   .Help("Answered attention requests by model and gRPC status code")
                   .Register(*registry_);
  unauthenticated_calls_ =
      &prometheus::BuildCounter()
           .Name("attention_unauthenticated_calls_total")
           .Help("Calls refused UNAUTHENTICATED from their metadata before their message was "
                 "read, by API (attention, inference)")
           .Register(*registry_);
  refused_streams_ = &prometheus::BuildCounter()
                          .Name("attention_streams_refused_total")
                          .Help("Stream calls refused before reading a request, by API "
                                "(attention: AttendStream, inference: ModelStreamInfer) and gRPC "
                                "status code")
                          .Register(*registry_);
  api_requests_ = &prometheus::BuildCounter()
                       .Name("attention_api_requests_total")
                       .Help("Answered attention requests by serving API (attention, inference), "
                             "model and gRPC status code")
                       .Register(*registry_);
  request_duration_ = &prometheus::BuildHistogram()
                               .Name("attention_request_duration_seconds")
                               .Help("Time from a request's arrival to its answer")
                               .Register(*registry_);
  queue_duration_ = &prometheus::BuildHistogram()
                             .Name("attention_queue_duration_seconds")
                             .Help("Time a request waited in its model's batching queue")
                             .Register(*registry_);
  compute_duration_ = &prometheus::BuildHistogram()
                               .Name("attention_compute_duration_seconds")
                               .Help("Duration of the engine execution that computed a request")
                               .Register(*registry_);
  batch_size_ = &prometheus::BuildHistogram()
                         .Name("attention_batch_size")
                         .Help("Requests merged into one engine execution")
                         .Register(*registry_);
  queue_depth_ = &prometheus::BuildGauge()
                          .Name("attention_queue_depth")
                          .Help("Requests waiting in a model's batching queue")
                          .Register(*registry_);
  queue_capacity_gauge_ = &prometheus::BuildGauge()
                                   .Name("attention_queue_capacity")
                                   .Help("Requests a model's batching queue holds at most")
                                   .Register(*registry_);
  inflight_ = &prometheus::BuildGauge()
                   .Name("attention_inflight_requests")
                   .Help("Requests accepted and not yet answered")
                   .Register(*registry_)
                   .Add({});
  model_info_ = &prometheus::BuildGauge()
                     .Name("attention_model_info")
                     .Help("1 for each model version served now, labelled with its kind and "
                           "precision")
                     .Register(*registry_);
  model_kv_cache_dtype_ =
      &prometheus::BuildGauge()
           .Name("attention_model_kv_cache_dtype_info")
           .Help("1 for each model version served now, labelled with what its decoding sessions "
                 "hold keys and values in (float32, bfloat16, float16)")
           .Register(*registry_);
  load_failures_ = &prometheus::BuildCounter()
                        .Name("attention_model_load_failures_total")
                        .Help("Model files that failed to load or reload, by model")
                        .Register(*registry_);
  AddSessionMetrics();
  for (const std::string& model : models) AddModel(model);
}

void ServerMetrics::AddSessionMetrics() {
  auto gauge = [this](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_).Add({});
  };
  auto counter = [this](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
  };
  sessions_open_ = gauge("attention_sessions_open",
                         "Decoding sessions open now (AttendSession streams and sequences)");
  session_pool_used_ = gauge("attention_session_pool_used_bytes",
                             "Bytes of the session pool that sessions' keys and values hold");
  session_pool_capacity_ = gauge("attention_session_pool_capacity_bytes",
                                 "Bytes the session pool holds at most (--session-memory-bytes)");
  session_pool_shared_ = gauge("attention_session_pool_shared_bytes",
                               "Bytes of the session pool's used bytes in blocks two or more "
                               "sessions share (a prompt's blocks)");
  session_pool_cached_ = gauge("attention_session_pool_cached_bytes",
                               "Bytes of the session pool in blocks no session holds (keys, "
                               "values and prompts' outputs), kept for a later prompt until "
                               "the pool needs the room");
  prefix_query_tokens_ =
      &counter("attention_session_prefix_query_tokens_total",
               "Prompt tokens of session steps looked up in shared and cached blocks")
           ->Add({});
  prefix_hit_tokens_ = &counter("attention_session_prefix_hit_tokens_total",
                                "Prompt tokens of session steps found in shared or cached blocks")
                            ->Add({});
  sessions_opened_ = counter("attention_sessions_opened_total", "Sessions opened, by model");
  sessions_ended_ = counter("attention_sessions_ended_total",
                            "Sessions ended, by reason (closed, expired, replaced, failed, "
                            "shutdown, preempted)");
  session_steps_ = counter("attention_session_steps_total", "Session steps answered OK, by model");
  session_tokens_ = counter("attention_session_tokens_total",
                            "New token rows of the session steps answered OK, by model");
}

ModelMetrics* ServerMetrics::AddModel(std::string_view model) {
  absl::MutexLock lock(&models_mu_);
  if (auto it = models_.find(model); it != models_.end()) return &it->second;
  const prometheus::Labels labels{{"model", std::string(model)}};
  totals_.push_back(std::make_unique<ModelTotals>());
  queue_capacity_gauge_->Add(labels).Set(queue_capacity_);
  request_counters_.emplace(std::string(model), std::make_unique<RequestCounters>());
  return &models_
              .emplace(std::string(model),
                       ModelMetrics{&request_duration_->Add(labels, DurationBuckets()),
                                    &queue_duration_->Add(labels, DurationBuckets()),
                                    &compute_duration_->Add(labels, DurationBuckets()),
                                    &batch_size_->Add(labels, BatchSizeBuckets(max_batch_size_)),
                                    &queue_depth_->Add(labels), totals_.back().get()})
              .first->second;
}

ModelMetrics* ServerMetrics::ForModel(std::string_view model) {
  absl::MutexLock lock(&models_mu_);
  auto it = models_.find(model);
  return it == models_.end() ? nullptr : &it->second;
}

void ServerMetrics::SetModelKvCacheDtype(std::string_view model, int64_t version, KvDtype dtype,
                                         bool served) {
  prometheus::Gauge& gauge =
      model_kv_cache_dtype_->Add({{"model", std::string(model)},
                                  {"version", std::to_string(version)},
                                  {"kv_cache_dtype", std::string(KvDtypeName(dtype))}});
  if (served) {
    gauge.Set(1);
  } else {
    model_kv_cache_dtype_->Remove(&gauge);
  }
}

void ServerMetrics::SetModelServed(std::string_view model, int64_t version, Kind kind,
                                   Precision precision, bool served) {
  const prometheus::Labels labels{{"model", std::string(model)},
                                  {"version", std::to_string(version)},
                                  {"kind", std::string(KindName(kind))},
                                  {"precision", std::string(PrecisionName(precision))}};
  prometheus::Gauge& gauge = model_info_->Add(labels);
  if (served) {
    gauge.Set(1);
  } else {
    model_info_->Remove(&gauge);
  }
}

void ServerMetrics::CountLoadFailure(std::string_view model) {
  load_failures_->Add({{"model", std::string(model)}}).Increment();
}

std::atomic<prometheus::Counter*>* ServerMetrics::Slot(std::string_view model,
                                                       absl::StatusCode code,
                                                       const std::string_view* api) {
  const auto index = static_cast<size_t>(code);
  if (index >= kStatusCodes) return nullptr;
  RequestCounters* counters = nullptr;
  {
    absl::MutexLock lock(&models_mu_);
    const auto it = request_counters_.find(model);
    if (it == request_counters_.end()) return nullptr;
    counters = it->second.get();
  }
  if (api == nullptr) return &counters->requests[index];
  for (size_t a = 0; a < kApis.size(); ++a) {
    if (kApis[a] == *api) return &counters->api_requests[a][index];
  }
  return nullptr;
}

void ServerMetrics::CountRequest(std::string_view model, absl::StatusCode code) {
  KeptSeries(Slot(model, code, nullptr), [&]() -> prometheus::Counter& {
    return requests_->Add({{"model", std::string(model)}, {"code", absl::StatusCodeToString(code)}});
  }).Increment();
}

void ServerMetrics::CountApiRequest(std::string_view api, std::string_view model,
                                    absl::StatusCode code) {
  KeptSeries(Slot(model, code, &api), [&]() -> prometheus::Counter& {
    return api_requests_->Add({{"api", std::string(api)},
                               {"model", std::string(model)},
                               {"code", absl::StatusCodeToString(code)}});
  }).Increment();
}

void ServerMetrics::SetBuildInfo(std::string_view isa, std::string_view detected_isa,
                                std::string_view blas_core) {
  prometheus::BuildGauge()
      .Name("attention_build_info")
      .Help("1, labelled with the kernel path running, the best path this CPU runs, the BLAS "
            "kernel core and the server version")
      .Register(*registry_)
      .Add({{"isa", std::string(isa)},
            {"detected_isa", std::string(detected_isa)},
            {"blas_core", std::string(blas_core)},
            {"version", ATTENTION_VERSION}})
      .Set(1);
}

void ServerMetrics::CountRefusedStream(std::string_view api, absl::StatusCode code) {
  refused_streams_->Add({{"api", std::string(api)}, {"code", absl::StatusCodeToString(code)}})
      .Increment();
}

void ServerMetrics::SetSessionGauges(int open, int64_t pool_used_bytes,
                                     int64_t pool_capacity_bytes) {
  sessions_open_->Set(open);
  session_pool_used_->Set(static_cast<double>(pool_used_bytes));
  session_pool_capacity_->Set(static_cast<double>(pool_capacity_bytes));
}

void ServerMetrics::SetSessionPrefixStats(int64_t shared_bytes, int64_t cached_bytes,
                                          int64_t query_tokens, int64_t hit_tokens) {
  session_pool_shared_->Set(static_cast<double>(shared_bytes));
  session_pool_cached_->Set(static_cast<double>(cached_bytes));
  absl::MutexLock lock(&prefix_mu_);
  // The pool's totals only grow; a caller reading them earlier may come later.
  if (query_tokens > prefix_query_counted_) {
    prefix_query_tokens_->Increment(static_cast<double>(query_tokens - prefix_query_counted_));
    prefix_query_counted_ = query_tokens;
  }
  if (hit_tokens > prefix_hit_counted_) {
    prefix_hit_tokens_->Increment(static_cast<double>(hit_tokens - prefix_hit_counted_));
    prefix_hit_counted_ = hit_tokens;
  }
}

void ServerMetrics::CountSessionOpened(std::string_view model) {
  sessions_opened_->Add({{"model", std::string(model)}}).Increment();
}

void ServerMetrics::CountSessionEnd(std::string_view reason) {
  sessions_ended_->Add({{"reason", std::string(reason)}}).Increment();
}

ServerMetrics::SessionCounters ServerMetrics::SessionCountersFor(std::string_view model) {
  const prometheus::Labels labels{{"model", std::string(model)}};
  return {&session_steps_->Add(labels), &session_tokens_->Add(labels)};
}

void ServerMetrics::CountUnauthenticatedCall(std::string_view api) {
  unauthenticated_calls_->Add({{"api", std::string(api)}}).Increment();
}

}  // namespace attention::server
