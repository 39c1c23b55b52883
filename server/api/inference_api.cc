// inference_api.cc: the Open Inference Protocol RPC handlers and the
// ModelStreamInfer reactor.
#include "server/api/inference_api.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/api/attention_adapter.h"
#include "server/api/grpc_call.h"
#include "server/api/inference_adapter.h"
#include "server/observability/request_names.h"
#include "server/api/repository_views.h"
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

}  // namespace

InferenceApi::InferenceApi(Dispatcher* dispatcher, const ModelRegistry* registry,
                           RepositoryManager* manager, ServerMetrics* metrics)
    : dispatcher_(dispatcher), registry_(registry), manager_(manager), metrics_(metrics) {}

absl::StatusOr<ServedModel> InferenceApi::FindModelFor(const grpc::CallbackServerContext& context,
                                                       std::string_view name,
                                                       std::string_view version) const {
  if (absl::Status auth = dispatcher_->access().Check(context); !auth.ok()) return auth;
  return FindModel(name, version);
}

absl::StatusOr<ServedModel> InferenceApi::FindModel(std::string_view name,
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

std::vector<int64_t> InferenceApi::ReadyVersions(std::string_view name) const {
  std::vector<int64_t> versions;
  const std::shared_ptr<const ModelRegistry::Index> index = registry_->snapshot();
  if (const auto it = index->find(name); it != index->end()) {
    for (const ModelVersion& version : it->second.versions) {
      if (version.state == VersionState::kReady) versions.push_back(version.version);
    }
  }
  return versions;
}

void InferenceApi::Infer(const CallOrigin& origin, const inference::ModelInferRequest& proto,
                         absl::Status readable, DecodedInferRequest* decoded,
                         int64_t* served_version, bool credentials_checked, Dispatcher::Done done) {
  dispatcher_->Submit(
      origin,
      Dispatcher::Request{.api = kInferenceApi,
                          .model = proto.model_name(),
                          .version = ParseModelVersion(proto.model_version()),
                          .request_id = proto.id(),
                          .message_bytes = static_cast<int64_t>(proto.ByteSizeLong()),
                          .served_version = served_version,
                          .credentials_checked = credentials_checked,
                          .readable = std::move(readable)},
      [&proto, decoded]() -> absl::StatusOr<AttentionRequest> {
        if (absl::Status s = DecodeInferRequest(proto, decoded); !s.ok()) return s;
        return decoded->request;
      },
      std::move(done));
}

grpc::ServerUnaryReactor* InferenceApi::ServerLive(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &InferenceApi::AnswerServerLive);
}

absl::Status InferenceApi::AnswerServerLive(const grpc::CallbackServerContext&,
                                            const inference::ServerLiveRequest&,
                                            inference::ServerLiveResponse* response) const {
  response->set_live(true);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* InferenceApi::ServerReady(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request,
                                                    grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &InferenceApi::AnswerServerReady);
}

absl::Status InferenceApi::AnswerServerReady(const grpc::CallbackServerContext&,
                                             const inference::ServerReadyRequest&,
                                             inference::ServerReadyResponse* response) const {
  response->set_ready(dispatcher_->accepting());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* InferenceApi::ModelReady(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &InferenceApi::AnswerModelReady);
}

absl::Status InferenceApi::AnswerModelReady(const grpc::CallbackServerContext& context,
                                            const inference::ModelReadyRequest& request,
                                            inference::ModelReadyResponse* response) const {
  if (absl::Status auth = dispatcher_->access().Check(context); !auth.ok()) {
    return auth;
  }
  response->set_ready(dispatcher_->accepting() &&
                      FindModel(request.name(), request.version()).ok());
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* InferenceApi::ServerMetadata(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &InferenceApi::AnswerServerMetadata);
}

absl::Status InferenceApi::AnswerServerMetadata(const grpc::CallbackServerContext& context,
                                                const inference::ServerMetadataRequest&,
                                                inference::ServerMetadataResponse* response) const {
  if (absl::Status auth = dispatcher_->access().Check(context); !auth.ok()) {
    return auth;
  }
  response->set_name("attention-server");
  response->set_version(ATTENTION_VERSION);
  for (const char* extension : kExtensions) response->add_extensions(extension);
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* InferenceApi::ModelMetadata(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request,
                                                      grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &InferenceApi::AnswerModelMetadata);
}

absl::Status InferenceApi::AnswerModelMetadata(const grpc::CallbackServerContext& context,
                                               const inference::ModelMetadataRequest& request,
                                               inference::ModelMetadataResponse* response) const {
  absl::StatusOr<ServedModel> model = FindModelFor(context, request.name(), request.version());
  if (model.ok()) *response = ToModelMetadata(*model->model, ReadyVersions(request.name()));
  return model.status();
}

grpc::ServerUnaryReactor* InferenceApi::ModelConfig(grpc::CallbackServerContext* context,
                                                    const grpc::ByteBuffer* request,
                                                    grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &InferenceApi::AnswerModelConfig);
}

absl::Status InferenceApi::AnswerModelConfig(const grpc::CallbackServerContext& context,
                                             const inference::ModelConfigRequest& request,
                                             inference::ModelConfigResponse* response) const {
  absl::StatusOr<ServedModel> model = FindModelFor(context, request.name(), request.version());
  if (model.ok()) *response->mutable_config() = ToModelConfig(*model->model);
  return model.status();
}

grpc::ServerUnaryReactor* InferenceApi::ModelStatistics(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &InferenceApi::AnswerModelStatistics);
}

absl::Status InferenceApi::AnswerModelStatistics(
    const grpc::CallbackServerContext& context, const inference::ModelStatisticsRequest& request,
    inference::ModelStatisticsResponse* response) const {
  if (absl::Status auth = dispatcher_->access().Check(context); !auth.ok()) {
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

grpc::ServerUnaryReactor* InferenceApi::RepositoryIndex(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &InferenceApi::AnswerRepositoryIndex);
}

absl::Status InferenceApi::AnswerRepositoryIndex(
    const grpc::CallbackServerContext& context, const inference::RepositoryIndexRequest& request,
    inference::RepositoryIndexResponse* response) const {
  if (absl::Status auth = dispatcher_->access().Check(context); !auth.ok()) {
    return auth;
  }
  IndexRegistry(*registry_, request.ready(), response);
  return absl::OkStatus();
}

absl::Status InferenceApi::CheckControl(const grpc::CallbackServerContext& context) const {
  if (absl::Status auth = dispatcher_->access().Check(context); !auth.ok()) return auth;
  if (manager_ == nullptr) {
    return absl::FailedPreconditionError(
        "explicit model control is off: start the server with --model-control explicit "
        "(and --model-repository) to load and unload models");
  }
  return absl::OkStatus();
}

absl::Status InferenceApi::ChangeRepository(
    const grpc::CallbackServerContext& context, std::string_view method, std::string_view name,
    std::string_view verb, absl::Status (RepositoryManager::*change)(std::string_view)) const {
  absl::Status status = CheckControl(context);
  if (status.ok()) status = CheckNameLength("model_name", name);
  if (status.ok()) status = (manager_->*change)(name);
  if (status.ok()) {
    spdlog::info("{}: model '{}' {}; peer={}", method, Printable(name), verb, context.peer());
  } else {
    spdlog::warn("{} of '{}' refused: peer={}: {}", method, Printable(name), context.peer(),
                 std::string(status.message()));
  }
  return status;
}

grpc::ServerUnaryReactor* InferenceApi::RepositoryModelLoad(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &InferenceApi::AnswerRepositoryModelLoad);
}

absl::Status InferenceApi::AnswerRepositoryModelLoad(
    const grpc::CallbackServerContext& context,
    const inference::RepositoryModelLoadRequest& request,
    inference::RepositoryModelLoadResponse*) const {
  return ChangeRepository(context, "RepositoryModelLoad", request.model_name(), "loaded",
                          &RepositoryManager::LoadModel);
}

grpc::ServerUnaryReactor* InferenceApi::RepositoryModelUnload(grpc::CallbackServerContext* context,
                                                              const grpc::ByteBuffer* request,
                                                              grpc::ByteBuffer* response) {
  return AnswerAtOnce(context, request, response, this, &InferenceApi::AnswerRepositoryModelUnload);
}

absl::Status InferenceApi::AnswerRepositoryModelUnload(
    const grpc::CallbackServerContext& context,
    const inference::RepositoryModelUnloadRequest& request,
    inference::RepositoryModelUnloadResponse*) const {
  return ChangeRepository(context, "RepositoryModelUnload", request.model_name(), "unloaded",
                          &RepositoryManager::UnloadModel);
}

// What ModelInfer's answer needs besides its messages: the decoded request
// the engine reads.
struct InferState {
  DecodedInferRequest decoded;
  int64_t served_version = 0;
};
using InferReactor =
    WireUnaryReactor<inference::ModelInferRequest, inference::ModelInferResponse, InferState>;

grpc::ServerUnaryReactor* InferenceApi::ModelInfer(grpc::CallbackServerContext* context,
                                                   const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  auto* reactor = new InferReactor(dispatcher_, context, request, response);
  Infer(reactor->origin, reactor->request, reactor->readable, &reactor->state.decoded,
        &reactor->state.served_version, /*credentials_checked=*/false,
        [reactor](const absl::Status& status, const AttentionResult* result) {
          if (status.ok()) {
            EncodeInferResponse(reactor->request, reactor->state.decoded, *result,
                                &reactor->response, reactor->state.served_version);
          }
          reactor->Answer(status);
        });
  return reactor;
}

// One request of a ModelStreamInfer call and its answer.
struct InferSlot {
  grpc::ByteBuffer wire_request;
  inference::ModelInferRequest request;
  DecodedInferRequest decoded;
  inference::ModelStreamInferResponse response;
  grpc::ByteBuffer wire_response;
  int64_t served_version = 0;
  bool answered = false;  // OrderedStream's
};

// One ModelStreamInfer call, run like AttendStream (ordered_stream.h): a
// failed request's answer is its `error_message`.
class InferenceApi::StreamReactor final : public AdmittedStream<InferSlot> {
 public:
  StreamReactor(InferenceApi* service, grpc::CallbackServerContext* context)
      : AdmittedStream(service->dispatcher_, context), service_(service) {
    Open(kInferenceApi, "ModelStreamInfer");
  }

 private:
  void Submit(InferSlot& slot) override {
    // Credentials were checked once, when the stream opened.
    absl::Status readable = ParseWire(&slot.wire_request, &slot.request);
    service_->Infer(origin(), slot.request, std::move(readable), &slot.decoded,
                    &slot.served_version, /*credentials_checked=*/true,
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
    WriteWire(slot.response, &slot.wire_response);
    Answered(slot);
  }

  InferenceApi* const service_;
};

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* InferenceApi::ModelStreamInfer(
    grpc::CallbackServerContext* context) {
  return new StreamReactor(this, context);
}

}  // namespace attention::server
