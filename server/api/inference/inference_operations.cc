// inference_operations.cc: the Open Inference Protocol's operations over the
// dispatcher, the registry and the repository manager.
#include "server/api/inference/inference_operations.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/api/inference/repository_views.h"
#include "server/observability/request_names.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// Extensions of the protocol this server implements, by Triton's names.
constexpr const char* kExtensions[] = {"model_configuration", "statistics", "parameters",
                                       "model_repository"};

inference::StatisticDuration Duration(uint64_t count, double seconds) {
  inference::StatisticDuration duration;
  duration.set_count(count);
  duration.set_ns(static_cast<uint64_t>(seconds * 1e9));
  return duration;
}

inference::StatisticDuration FromHistogram(prometheus::Histogram& histogram) {
  const prometheus::ClientMetric sample = histogram.Collect();
  return Duration(sample.histogram.sample_count, sample.histogram.sample_sum);
}

// The session a sequence_start request opens: cross memory when it carries
// `keys` (with `values` and `valid_lens`), self memory otherwise, whose
// batch is the queries'; `scale`, `sliding_window` and `softcap` for every
// step.
absl::StatusOr<SessionOpen> ToSequenceOpen(const AttentionRequest& request,
                                           std::optional<SessionMemory> memory) {
  SessionOpen open;
  open.scale = request.scale;
  open.sliding_window = request.sliding_window.value_or(0);
  open.softcap = request.softcap.value_or(0);
  if (memory.value_or(request.keys.has_value() ? SessionMemory::kCross : SessionMemory::kSelf) ==
      SessionMemory::kCross) {
    if (!request.keys.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "inputs: expected '", kKeysInput, "' on a sequence_start with '",
          kSessionMemoryParameter, "' \"cross\" (the memory every request attends to), got none"));
    }
    open.memory = SessionMemory::kCross;
    open.keys = request.keys;
    open.values = request.values;
    open.valid_lens = request.valid_lens;
    return open;
  }
  if (!request.valid_lens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("inputs: '", kValidLensInput, "' on a self-attention sequence, which takes '",
                     kQueriesInput, "' (and, over grouped heads, its own '", kKeysInput, "' and '",
                     kValuesInput, "')"));
  }
  if (request.values.has_value() && !request.keys.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("inputs: '", kValuesInput, "' on a sequence_start without '", kKeysInput,
                     "': a self-attention sequence's rows serve as values unless it brings both"));
  }
  open.memory = SessionMemory::kSelf;
  // (B, n, d) or, grouped heads, (B, n, H, d); any other rank is refused by
  // the session's validation.
  open.batch = request.queries.shape.size() >= 3 ? request.queries.shape[0] : 1;
  return open;
}

// A later request of a sequence brings its queries, and a self-attention
// sequence's may bring its rows' own keys and values (grouped heads).
absl::Status CheckSequenceStep(const AttentionRequest& request, SessionMemory memory) {
  const bool self = memory == SessionMemory::kSelf;
  const char* extra = request.keys.has_value() && !self     ? kKeysInput
                      : request.values.has_value() && !self ? kValuesInput
                      : !request.valid_lens.empty()         ? kValidLensInput
                                                            : nullptr;
  const char* parameter = request.scale.has_value()            ? kScaleParameter
                          : request.sliding_window.has_value() ? kSlidingWindowParameter
                          : request.softcap.has_value()        ? kSoftcapParameter
                                                               : nullptr;
  if (extra == nullptr && parameter == nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      extra != nullptr ? absl::StrCat("inputs: '", extra, "'")
                       : absl::StrCat("parameters '", parameter, "'"),
      " only on the sequence_start request (the sequence keeps what it opened with); got it "
      "without sequence_start"));
}

// What no request of a sequence may carry: a session's positions come from
// its length (docs/api.md section 11), so these would be ignored.
absl::Status CheckSequencePositions(const AttentionRequest& request) {
  if (request.position_ids.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "inputs '", kPositionIdsInput,
      "': expected none on a sequence request (a sequence's positions come from its length), "
      "got ", request.position_ids.size()));
}

// "sequence_id 7" or "sequence_id 'abc'", for messages.
std::string SequenceName(const SequenceParameters& sequence) {
  if (const int64_t* id = std::get_if<int64_t>(&sequence.id)) {
    return absl::StrCat(kSequenceIdParameter, " ", *id);
  }
  return absl::StrCat(kSequenceIdParameter, " '", Printable(std::get<std::string>(sequence.id)),
                      "'");
}

}  // namespace

absl::StatusOr<ServedModel> InferenceOperations::FindModelFor(const CallOrigin& origin,
                                                              std::string_view name,
                                                              std::string_view version) const {
  if (absl::Status auth = origin.Authenticate(dispatcher_->access()); !auth.ok()) return auth;
  return FindModel(name, version);
}

absl::StatusOr<ServedModel> InferenceOperations::FindModel(std::string_view name,
                                                           std::string_view version) const {
  absl::StatusOr<ServedModel> newest = registry_->Resolve(name, std::nullopt);
  if (!newest.ok()) {
    return absl::NotFoundError(absl::StrCat("model: no model named '", Printable(name),
                                            "' is served (RepositoryIndex lists them)"));
  }
  absl::StatusOr<std::optional<int64_t>> wanted = ParseModelVersion(version);
  if (!wanted.ok()) return wanted.status();
  if (!wanted->has_value()) return newest;
  return registry_->Resolve(name, *wanted);
}

std::vector<int64_t> InferenceOperations::ReadyVersions(std::string_view name) const {
  std::vector<int64_t> versions;
  const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
  if (const auto it = index->find(name); it != index->end()) {
    for (const ModelVersion& version : it->second.versions) {
      if (version.state == VersionState::kReady) versions.push_back(version.version);
    }
  }
  return versions;
}

void InferenceOperations::Infer(const CallOrigin& origin, std::string_view api,
                                const inference::ModelInferRequest& proto, absl::Status readable,
                                DecodedInferRequest* decoded, int64_t* served_version,
                                bool credentials_checked, Dispatcher::Done done,
                                absl::Status encoding, SessionTable::OnEnd stream_end) {
  Dispatcher::Request request{.api = api,
                              .model = proto.model_name(),
                              .version = ParseModelVersion(proto.model_version()),
                              .request_id = proto.id(),
                              .message_bytes = static_cast<int64_t>(proto.ByteSizeLong()),
                              .served_version = served_version,
                              .credentials_checked = credentials_checked,
                              .readable = std::move(readable)};
  absl::StatusOr<std::optional<SequenceParameters>> sequence =
      request.readable.ok() && encoding.ok() ? ReadSequenceParameters(proto)
                                             : std::optional<SequenceParameters>();
  if (sequence.ok() && sequence->has_value()) {
    request.continues_session = stream_end != nullptr;
    // A unary step of a sequence this server may hold: admitted while it
    // drains, until its sequences end (docs/api.md section 6.5).
    request.continues_sequence = stream_end == nullptr && !(*sequence)->start;
    return InferStep(origin, request, proto, **sequence, decoded, std::move(done), encoding,
                     stream_end);
  }
  if (!sequence.ok()) encoding = sequence.status();
  dispatcher_->Submit(
      origin, std::move(request),
      [&proto, decoded, &encoding]() -> absl::StatusOr<AttentionRequest> {
        if (!encoding.ok()) return encoding;
        if (absl::Status s = DecodeInferRequest(proto, decoded); !s.ok()) return s;
        return decoded->request;
      },
      std::move(done));
}

// What a sequence request's answer needs: the session it stepped.
struct InferenceOperations::SequenceCall {
  SessionTable::Handle handle;
  bool stepping = false;
};

void InferenceOperations::InferStep(const CallOrigin& origin, const Dispatcher::Request& request,
                                    const inference::ModelInferRequest& proto,
                                    const SequenceParameters& sequence,
                                    DecodedInferRequest* decoded, Dispatcher::Done done,
                                    const absl::Status& encoding,
                                    const SessionTable::OnEnd& stream_end) {
  auto call = std::make_shared<SequenceCall>();
  const bool start = sequence.start;
  const bool end = sequence.end;
  dispatcher_->SubmitStep(
      origin, request,
      [&](const absl::StatusOr<ServedModel>& resolved) -> absl::StatusOr<Dispatcher::Step> {
        if (!encoding.ok()) return encoding;
        if (absl::Status s = DecodeInferRequest(proto, decoded); !s.ok()) return s;
        return BeginSequenceStep(proto, sequence, resolved, *decoded, stream_end, *call);
      },
      [this, call, start, end, done = std::move(done)](const absl::Status& status,
                                                        const AttentionResult* result) {
        if (call->stepping) {
          const int64_t tokens =
              result != nullptr ? result->output.shape[0] * result->output.shape[1] : 0;
          sessions_->EndStep(call->handle, tokens);
          // A sequence whose opening step failed is not left half open.
          if (end || (start && !status.ok())) {
            sessions_->Close(call->handle, status.ok() ? SessionEnd::kClosed : SessionEnd::kFailed);
          }
        }
        done(sessions_->NameLimits(status), result);
      });
}

absl::StatusOr<Dispatcher::Step> InferenceOperations::BeginSequenceStep(
    const inference::ModelInferRequest& proto, const SequenceParameters& sequence,
    const absl::StatusOr<ServedModel>& resolved, const DecodedInferRequest& decoded,
    const SessionTable::OnEnd& stream_end, SequenceCall& call) {
  const AttentionRequest& request = decoded.request;
  const std::string key =
      std::visit([&](const auto& id) { return SequenceKey(proto.model_name(), id); }, sequence.id);
  if (absl::Status s = CheckSequencePositions(request); !s.ok()) return s;
  absl::StatusOr<SessionTable::Handle> handle;
  if (sequence.start) {
    if (!resolved.ok()) return resolved.status();
    absl::StatusOr<SessionOpen> open = ToSequenceOpen(request, sequence.memory);
    if (!open.ok()) return open.status();
    handle = sessions_->Open(proto.model_name(), *resolved, *open, key, stream_end);
  } else {
    handle = sessions_->Find(key, SequenceName(sequence));
  }
  if (!handle.ok()) return handle.status();
  absl::StatusOr<Session*> session = sessions_->BeginStep(*handle);
  if (!session.ok()) return session.status();
  call.handle = *std::move(handle);
  call.stepping = true;
  const bool self = (*session)->memory() == SessionMemory::kSelf;
  if (!sequence.start) {
    if (absl::Status s = CheckSequenceStep(request, (*session)->memory()); !s.ok()) return s;
  }
  return Dispatcher::Step{
      .session = *session,
      .served = SessionTable::Served(call.handle),
      .step = SessionStep{.queries = request.queries,
                          .return_attention_weights = request.return_attention_weights,
                          .keys = self ? request.keys : std::nullopt,
                          .values = self ? request.values : std::nullopt}};
}

absl::Status InferenceOperations::ServerLive(const CallOrigin&, const inference::ServerLiveRequest&,
                                             inference::ServerLiveResponse* response) const {
  response->set_live(true);
  return absl::OkStatus();
}

absl::Status InferenceOperations::ServerReady(const CallOrigin&,
                                              const inference::ServerReadyRequest&,
                                              inference::ServerReadyResponse* response) const {
  response->set_ready(dispatcher_->ready());
  return absl::OkStatus();
}

absl::Status InferenceOperations::ModelReady(const CallOrigin& origin,
                                             const inference::ModelReadyRequest& request,
                                             inference::ModelReadyResponse* response) const {
  if (absl::Status auth = origin.Authenticate(dispatcher_->access()); !auth.ok()) {
    return auth;
  }
  response->set_ready(dispatcher_->ready() &&
                      FindModel(request.name(), request.version()).ok());
  return absl::OkStatus();
}

absl::Status InferenceOperations::ServerMetadata(
    const CallOrigin& origin, const inference::ServerMetadataRequest&,
    inference::ServerMetadataResponse* response) const {
  if (absl::Status auth = origin.Authenticate(dispatcher_->access()); !auth.ok()) {
    return auth;
  }
  response->set_name("attention-server");
  response->set_version(ATTENTION_VERSION);
  for (const char* extension : kExtensions) response->add_extensions(extension);
  return absl::OkStatus();
}

absl::Status InferenceOperations::ModelMetadata(const CallOrigin& origin,
                                                const inference::ModelMetadataRequest& request,
                                                inference::ModelMetadataResponse* response) const {
  absl::StatusOr<ServedModel> model = FindModelFor(origin, request.name(), request.version());
  if (model.ok()) *response = ToModelMetadata(*model->model, ReadyVersions(request.name()));
  return model.status();
}

absl::Status InferenceOperations::ModelConfig(const CallOrigin& origin,
                                              const inference::ModelConfigRequest& request,
                                              inference::ModelConfigResponse* response) const {
  absl::StatusOr<ServedModel> model = FindModelFor(origin, request.name(), request.version());
  if (model.ok()) *response->mutable_config() = ToModelConfig(*model->model);
  return model.status();
}

absl::Status InferenceOperations::ModelStatistics(
    const CallOrigin& origin, const inference::ModelStatisticsRequest& request,
    inference::ModelStatisticsResponse* response) const {
  if (absl::Status auth = origin.Authenticate(dispatcher_->access()); !auth.ok()) {
    return auth;
  }
  if (!request.name().empty()) {
    if (absl::StatusOr<ServedModel> model = FindModel(request.name(), request.version());
        !model.ok()) {
      return model.status();
    }
  }
  // Counted per model name, whichever versions served the requests.
  for (const auto& [name, entry] : *registry_->snapshot()) {
    if (!request.name().empty() && name != request.name()) continue;
    const ModelVersion* newest = entry.NewestReady();
    if (newest == nullptr) continue;
    ModelMetrics* metrics = metrics_->ForModel(name);
    if (metrics == nullptr) continue;
    const ModelTotals& totals = *metrics->totals;
    inference::ModelStatistics* stats = response->add_model_stats();
    stats->set_name(name);
    stats->set_version(request.version().empty() ? std::to_string(newest->version)
                                                 : request.version());
    stats->set_last_inference(static_cast<uint64_t>(totals.last_answer_ms.load()));
    stats->set_inference_count(totals.success_count.load());
    stats->set_execution_count(metrics->batch_size->Collect().histogram.sample_count);
    inference::InferStatistics* infer = stats->mutable_inference_stats();
    infer->mutable_success()->set_count(totals.success_count.load());
    infer->mutable_success()->set_ns(totals.success_ns.load());
    infer->mutable_fail()->set_count(totals.fail_count.load());
    infer->mutable_fail()->set_ns(totals.fail_ns.load());
    *infer->mutable_queue() = FromHistogram(*metrics->queue_duration);
    *infer->mutable_compute_infer() = FromHistogram(*metrics->compute_duration);
  }
  return absl::OkStatus();
}

absl::Status InferenceOperations::RepositoryIndex(
    const CallOrigin& origin, const inference::RepositoryIndexRequest& request,
    inference::RepositoryIndexResponse* response) const {
  if (absl::Status auth = origin.Authenticate(dispatcher_->access()); !auth.ok()) {
    return auth;
  }
  IndexRegistry(*registry_, request.ready(), response);
  return absl::OkStatus();
}

absl::Status InferenceOperations::CheckControl(const CallOrigin& origin) const {
  if (absl::Status auth = origin.Authenticate(dispatcher_->access()); !auth.ok()) return auth;
  if (manager_ == nullptr) {
    return absl::FailedPreconditionError(
        "explicit model control is off: start the server with --model-control explicit "
        "(and --model-repository) to load and unload models");
  }
  return absl::OkStatus();
}

absl::Status InferenceOperations::ChangeRepository(
    const CallOrigin& origin, std::string_view method, std::string_view name, std::string_view verb,
    absl::Status (RepositoryManager::*change)(std::string_view)) const {
  absl::Status status = CheckControl(origin);
  if (status.ok()) status = CheckNameLength("model_name", name);
  if (status.ok()) status = (manager_->*change)(name);
  if (status.ok()) {
    spdlog::info("{}: model '{}' {}; peer={}", method, Printable(name), verb, origin.peer());
  } else {
    spdlog::warn("{} of '{}' refused: peer={}: {}", method, Printable(name), origin.peer(),
                 std::string(status.message()));
  }
  return status;
}

absl::Status InferenceOperations::RepositoryModelLoad(
    const CallOrigin& origin, const inference::RepositoryModelLoadRequest& request,
    inference::RepositoryModelLoadResponse*) const {
  return ChangeRepository(origin, "RepositoryModelLoad", request.model_name(), "loaded",
                          &RepositoryManager::LoadModel);
}

absl::Status InferenceOperations::RepositoryModelUnload(
    const CallOrigin& origin, const inference::RepositoryModelUnloadRequest& request,
    inference::RepositoryModelUnloadResponse*) const {
  return ChangeRepository(origin, "RepositoryModelUnload", request.model_name(), "unloaded",
                          &RepositoryManager::UnloadModel);
}

}  // namespace attention::server
