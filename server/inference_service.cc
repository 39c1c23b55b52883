// inference_service.cc: the Open Inference Protocol RPC handlers, ModelInfer's
// reactor and the ModelStreamInfer reactor.
#include "server/inference_service.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/inference_adapter.h"
#include "server/ordered_stream.h"
#include "server/proto_adapter.h"
#include "server/repository_views.h"
#include "server/request_names.h"
#include "spdlog/spdlog.h"

namespace attention::server {
namespace {

// The `api` label of Open Inference Protocol requests.
constexpr std::string_view kInferenceApi = "inference";

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

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

InferenceService::InferenceService(AttentionService* attention, const ModelRegistry* registry,
                                   RepositoryManager* manager, ServerMetrics* metrics)
    : attention_(attention), registry_(registry), manager_(manager), metrics_(metrics) {}

absl::StatusOr<ServedModel> InferenceService::FindModelFor(
    const grpc::CallbackServerContext& context, std::string_view name,
    std::string_view version) const {
  if (absl::Status auth = attention_->Authenticate(context); !auth.ok()) return auth;
  return FindModel(name, version);
}

absl::StatusOr<ServedModel> InferenceService::FindModel(std::string_view name,
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

std::vector<int64_t> InferenceService::ReadyVersions(std::string_view name) const {
  std::vector<int64_t> versions;
  const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
  if (const auto it = index->find(name); it != index->end()) {
    for (const ModelVersion& version : it->second.versions) {
      if (version.state == VersionState::kReady) versions.push_back(version.version);
    }
  }
  return versions;
}

void InferenceService::Infer(grpc::CallbackServerContext* context,
                             const inference::ModelInferRequest& proto,
                             DecodedInferRequest* decoded, int64_t* served_version,
                             bool credentials_checked,
                             AttentionService::Done done) {
  // SubmitIncoming() refuses unauthenticated calls and calls while draining
  // before it looks at the request, so those are not decoded at all.
  absl::StatusOr<AttentionRequest> request = AttentionRequest{};
  if (attention_->accepting() &&
      (credentials_checked || attention_->Authenticate(*context).ok())) {
    if (absl::Status s = DecodeInferRequest(proto, decoded); !s.ok()) {
      request = s;
    } else {
      request = decoded->request;
    }
  }
  attention_->SubmitIncoming(
      context,
      AttentionService::Incoming{
          .api = kInferenceApi,
          .model = proto.model_name(),
          .version = ParseModelVersion(proto.model_version()),
          .request_id = proto.id(),
          .request = std::move(request),
          .message_bytes = static_cast<int64_t>(proto.ByteSizeLong()),
          .served_version = served_version},
      credentials_checked, std::move(done));
}

grpc::ServerUnaryReactor* InferenceService::ServerLive(grpc::CallbackServerContext* context,
                                                       const inference::ServerLiveRequest*,
                                                       inference::ServerLiveResponse* response) {
  response->set_live(true);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ServerReady(grpc::CallbackServerContext* context,
                                                        const inference::ServerReadyRequest*,
                                                        inference::ServerReadyResponse* response) {
  response->set_ready(attention_->accepting());
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelReady(grpc::CallbackServerContext* context,
                                                       const inference::ModelReadyRequest* request,
                                                       inference::ModelReadyResponse* response) {
  if (absl::Status auth = attention_->Authenticate(*context); !auth.ok()) {
    return Reply(context, auth);
  }
  response->set_ready(attention_->accepting() &&
                      FindModel(request->name(), request->version()).ok());
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  if (absl::Status auth = attention_->Authenticate(*context); !auth.ok()) {
    return Reply(context, auth);
  }
  response->set_name("attention-server");
  response->set_version(ATTENTION_VERSION);
  for (const char* extension : kExtensions) response->add_extensions(extension);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  absl::StatusOr<ServedModel> model = FindModelFor(*context, request->name(), request->version());
  if (model.ok()) *response = ToModelMetadata(*model->model, ReadyVersions(request->name()));
  return Reply(context, model.status());
}

grpc::ServerUnaryReactor* InferenceService::ModelConfig(grpc::CallbackServerContext* context,
                                                        const inference::ModelConfigRequest* request,
                                                        inference::ModelConfigResponse* response) {
  absl::StatusOr<ServedModel> model = FindModelFor(*context, request->name(), request->version());
  if (model.ok()) *response->mutable_config() = ToModelConfig(*model->model);
  return Reply(context, model.status());
}

grpc::ServerUnaryReactor* InferenceService::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  if (absl::Status auth = attention_->Authenticate(*context); !auth.ok()) {
    return Reply(context, auth);
  }
  if (!request->name().empty()) {
    if (absl::StatusOr<ServedModel> model = FindModel(request->name(), request->version());
        !model.ok()) {
      return Reply(context, model.status());
    }
  }
  // Counted per model name, whichever versions served the requests.
  for (const auto& [name, entry] : *registry_->snapshot()) {
    if (!request->name().empty() && name != request->name()) continue;
    const ModelVersion* newest = entry.NewestReady();
    if (newest == nullptr) continue;
    ModelMetrics* metrics = metrics_->ForModel(name);
    if (metrics == nullptr) continue;
    const ModelTotals& totals = *metrics->totals;
    inference::ModelStatistics* stats = response->add_model_stats();
    stats->set_name(name);
    stats->set_version(request->version().empty() ? std::to_string(newest->version)
                                                  : request->version());
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
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* InferenceService::RepositoryIndex(
    grpc::CallbackServerContext* context, const inference::RepositoryIndexRequest* request,
    inference::RepositoryIndexResponse* response) {
  if (absl::Status auth = attention_->Authenticate(*context); !auth.ok()) {
    return Reply(context, auth);
  }
  IndexRegistry(*registry_, request->ready(), response);
  return Reply(context, absl::OkStatus());
}

absl::Status InferenceService::CheckControl(const grpc::CallbackServerContext& context) const {
  if (absl::Status auth = attention_->Authenticate(context); !auth.ok()) return auth;
  if (manager_ == nullptr) {
    return absl::FailedPreconditionError(
        "explicit model control is off: start the server with --model-control explicit "
        "(and --model-repository) to load and unload models");
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* InferenceService::RepositoryModelLoad(
    grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
    inference::RepositoryModelLoadResponse*) {
  absl::Status status = CheckControl(*context);
  if (status.ok()) status = CheckNameLength("model_name", request->model_name());
  if (status.ok()) status = manager_->LoadModel(request->model_name());
  if (status.ok()) {
    spdlog::info("RepositoryModelLoad: model '{}' loaded; peer={}",
                 Printable(request->model_name()), context->peer());
  } else {
    spdlog::warn("RepositoryModelLoad of '{}' refused: peer={}: {}",
                 Printable(request->model_name()), context->peer(),
                 std::string(status.message()));
  }
  return Reply(context, status);
}

grpc::ServerUnaryReactor* InferenceService::RepositoryModelUnload(
    grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
    inference::RepositoryModelUnloadResponse*) {
  absl::Status status = CheckControl(*context);
  if (status.ok()) status = CheckNameLength("model_name", request->model_name());
  if (status.ok()) status = manager_->UnloadModel(request->model_name());
  if (status.ok()) {
    spdlog::info("RepositoryModelUnload: model '{}' unloaded; peer={}",
                 Printable(request->model_name()), context->peer());
  } else {
    spdlog::warn("RepositoryModelUnload of '{}' refused: peer={}: {}",
                 Printable(request->model_name()), context->peer(),
                 std::string(status.message()));
  }
  return Reply(context, status);
}

// ModelInfer's reactor: holds the decoded request the engine reads, and
// counts the call as open until gRPC is done with it, as Attend's does.
class InferenceService::InferReactor final : public grpc::ServerUnaryReactor {
 public:
  InferReactor(AttentionService* attention, bool admitted)
      : attention_(attention), admitted_(admitted) {}

  void OnDone() override {
    if (admitted_) attention_->CallDone();
    delete this;
  }

  DecodedInferRequest decoded;
  int64_t served_version = 0;

 private:
  AttentionService* const attention_;
  const bool admitted_;
};

grpc::ServerUnaryReactor* InferenceService::ModelInfer(grpc::CallbackServerContext* context,
                                                       const inference::ModelInferRequest* request,
                                                       inference::ModelInferResponse* response) {
  // Not admitted only while shutting down, and then Submit() refuses it.
  auto* reactor = new InferReactor(attention_, attention_->AdmitCall());
  Infer(context, *request, &reactor->decoded, &reactor->served_version,
        /*credentials_checked=*/false,
        [reactor, request, response](const absl::Status& status, const AttentionResult* result) {
          if (status.ok()) {
            EncodeInferResponse(*request, reactor->decoded, *result, response,
                                reactor->served_version);
          }
          reactor->Finish(ToGrpcStatus(status));
        });
  return reactor;
}

// One request of a ModelStreamInfer call and its answer.
struct InferSlot {
  inference::ModelInferRequest request;
  DecodedInferRequest decoded;
  inference::ModelStreamInferResponse response;
  int64_t served_version = 0;
  bool answered = false;  // OrderedStream's
};

// One ModelStreamInfer call, run like AttendStream (ordered_stream.h): a
// failed request's answer is its `error_message`.
class InferenceService::StreamReactor final : public OrderedStream<InferSlot> {
 public:
  StreamReactor(InferenceService* service, grpc::CallbackServerContext* context)
      : service_(service), context_(context) {
    AttentionService& attention = *service_->attention_;
    if (absl::Status auth = attention.Authenticate(*context); !auth.ok()) {
      spdlog::warn("ModelStreamInfer refused: peer={}: {}", context->peer(),
                   std::string(auth.message()));
      RefuseStream(auth);
      return;
    }
    admitted_ = attention.AdmitCall();
    if (!admitted_) {
      RefuseStream(absl::UnavailableError("the server is shutting down and takes no new streams"));
      return;
    }
    Progress();
  }

  void OnDone() override {
    if (admitted_) service_->attention_->CallDone();
    delete this;
  }

  // Counted, as AttendStream's are (attention_streams_refused_total).
  void RefuseStream(const absl::Status& status) {
    service_->metrics_->CountRefusedStream("inference", status.code());
    Refuse(ToGrpcStatus(status));
  }

 private:
  void Submit(InferSlot& slot) override {
    // Credentials were checked once, when the stream opened.
    service_->Infer(context_, slot.request, &slot.decoded, &slot.served_version,
                    /*credentials_checked=*/true,
                    [this, &slot](const absl::Status& status, const AttentionResult* result) {
                      Answer(slot, status, result);
                    });
  }

  void Answer(InferSlot& slot, const absl::Status& status, const AttentionResult* result) {
    inference::ModelInferResponse& answer = *slot.response.mutable_infer_response();
    if (status.ok()) {
      EncodeInferResponse(slot.request, slot.decoded, *result, &answer, slot.served_version);
    } else {
      // The protocol carries no code here, so the message leads with it.
      slot.response.set_error_message(absl::StrCat(absl::StatusCodeToString(status.code()), ": ",
                                                   std::string(status.message())));
      answer.set_model_name(slot.request.model_name());
      answer.set_id(slot.request.id());
    }
    Answered(slot);
  }

  InferenceService* const service_;
  grpc::CallbackServerContext* const context_;  // owned by gRPC; alive until OnDone
  bool admitted_ = false;                       // set before anything can call OnDone
};

grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>*
InferenceService::ModelStreamInfer(grpc::CallbackServerContext* context) {
  return new StreamReactor(this, context);
}

}  // namespace attention::server
