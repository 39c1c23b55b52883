// rest_api.cc: the REST routes, the HTTP form of a call's origin, and the
// mapping of status codes to HTTP statuses.
#include "server/api/rest/rest_api.h"

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "server/api/rest/rest_codec.h"
#include "server/dispatch/call_origin.h"
#include "server/observability/request_names.h"
#include "server/security/access_policy.h"

namespace attention::server {
namespace {

// The `api` label of REST requests.
constexpr std::string_view kRestApi = "http";

enum class Endpoint {
  kLive,
  kReady,
  kServerMetadata,
  kModelMetadata,
  kModelReady,
  kModelConfig,
  kModelStatistics,
  kInfer,
  kRepositoryIndex,
  kRepositoryLoad,
  kRepositoryUnload,
};

// An HTTP call as the dispatcher sees it: a client that closes its
// connection has cancelled its call.
class HttpCallOrigin final : public CallOrigin {
 public:
  // `exchange` alive as long as this. Takes its traceparent header
  // (trace_context.h).
  HttpCallOrigin(const HttpExchange* exchange, absl::Time deadline)
      : exchange_(exchange), deadline_(deadline) {
    if (const std::string* traceparent = exchange->request().Header("traceparent")) {
      SetTraceparent(*traceparent);
    }
  }

  absl::Time deadline() const override { return deadline_; }
  bool cancelled() const override { return exchange_->client_gone(); }
  std::string peer() const override { return exchange_->request().peer; }
  absl::Status Authenticate(const AccessPolicy& access) const override {
    return access.CheckHttp(exchange_->request().client_certificate_names,
                            exchange_->request().Header("authorization"));
  }

 private:
  const HttpExchange* const exchange_;
  const absl::Time deadline_;
};

// KServe's mapping of the protocol's errors to HTTP statuses, extended to
// every code the server answers.
int HttpStatusOf(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kAborted:
      return 409;
    case absl::StatusCode::kResourceExhausted:
      return 429;
    case absl::StatusCode::kCancelled:
      return 499;
    case absl::StatusCode::kUnimplemented:
      return 501;
    case absl::StatusCode::kUnavailable:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

HttpResponse JsonResponse(int status, std::string body) {
  HttpResponse response;
  response.status = status;
  response.body = std::move(body);
  return response;
}

HttpResponse ErrorResponse(const absl::Status& status) {
  HttpResponse response =
      JsonResponse(HttpStatusOf(status.code()), ErrorJson(std::string(status.message())));
  if (status.code() == absl::StatusCode::kUnauthenticated) {
    response.headers.emplace_back("WWW-Authenticate", "Bearer");
  }
  return response;
}

// "%2F" -> "/"; nullopt for a broken escape.
std::optional<std::string> PercentDecode(std::string_view text) {
  std::string decoded;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '%') {
      decoded.push_back(text[i]);
      continue;
    }
    int value = 0;
    if (i + 2 >= text.size() ||
        !absl::SimpleHexAtoi(absl::string_view(text.data() + i + 1, 2), &value)) {
      return std::nullopt;
    }
    decoded.push_back(static_cast<char>(value));
    i += 2;
  }
  return decoded;
}

// The deadline a request's header sets, from `arrived`.
absl::StatusOr<absl::Time> DeadlineOf(const HttpRequest& request, absl::Time arrived) {
  const std::string* header = request.Header(kTimeoutHeader);
  if (header == nullptr) return absl::InfiniteFuture();
  int64_t milliseconds = 0;
  if (!absl::SimpleAtoi(*header, &milliseconds) || milliseconds <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("header Inference-Timeout-Ms: expected a positive whole number of "
                     "milliseconds, got '",
                     Printable(*header), "'"));
  }
  return arrived + absl::Milliseconds(milliseconds);
}

absl::StatusOr<std::optional<size_t>> JsonLengthOf(const HttpRequest& request) {
  const std::string* header = request.Header(kInferenceHeaderLength);
  if (header == nullptr) return std::optional<size_t>();
  size_t length = 0;
  if (!absl::SimpleAtoi(*header, &length)) {
    return absl::InvalidArgumentError(
        absl::StrCat("header Inference-Header-Content-Length: expected a byte count, got '",
                     Printable(*header), "'"));
  }
  return std::optional<size_t>(length);
}

}  // namespace

struct RestApi::Route {
  explicit Route(Endpoint endpoint, std::string model = "", std::string version = "")
      : endpoint(endpoint), model(std::move(model)), version(std::move(version)) {}

  Endpoint endpoint;
  std::string model;
  std::string version;
};

namespace {

const char* MethodOf(Endpoint endpoint) {
  switch (endpoint) {
    case Endpoint::kInfer:
    case Endpoint::kRepositoryIndex:
    case Endpoint::kRepositoryLoad:
    case Endpoint::kRepositoryUnload:
      return "POST";
    default:
      return "GET";
  }
}

// The endpoint of a model's path after /v2/models/{name}[/versions/{v}].
std::optional<Endpoint> ModelEndpoint(std::string_view tail) {
  if (tail.empty()) return Endpoint::kModelMetadata;
  if (tail == "ready") return Endpoint::kModelReady;
  if (tail == "config") return Endpoint::kModelConfig;
  if (tail == "stats") return Endpoint::kModelStatistics;
  if (tail == "infer") return Endpoint::kInfer;
  return std::nullopt;
}

absl::StatusOr<std::string> Segment(std::string_view text) {
  std::optional<std::string> decoded = PercentDecode(text);
  if (!decoded) {
    return absl::InvalidArgumentError(
        absl::StrCat("the path has a broken %-escape in '", Printable(text), "'"));
  }
  return *std::move(decoded);
}

// /v2/models/... and /v2/repository/...; `parts` start after "v2".
absl::StatusOr<std::optional<RestApi::Route>> ModelRoute(
    const std::vector<std::string_view>& parts) {
  using Route = RestApi::Route;
  if (parts[0] == "repository") {
    if (parts.size() == 2 && parts[1] == "index") return Route{Endpoint::kRepositoryIndex};
    if (parts.size() != 4 || parts[1] != "models") return std::optional<Route>();
    absl::StatusOr<std::string> model = Segment(parts[2]);
    if (!model.ok()) return model.status();
    if (parts[3] == "load") return Route{Endpoint::kRepositoryLoad, *model};
    if (parts[3] == "unload") return Route{Endpoint::kRepositoryUnload, *model};
    return std::optional<Route>();
  }
  if (parts[0] != "models" || parts.size() < 2) return std::optional<Route>();
  if (parts.size() == 2 && parts[1] == "stats") return Route{Endpoint::kModelStatistics};
  absl::StatusOr<std::string> model = Segment(parts[1]);
  if (!model.ok()) return model.status();
  size_t next = 2;
  std::string version;
  if (parts.size() >= 4 && parts[2] == "versions") {
    absl::StatusOr<std::string> decoded = Segment(parts[3]);
    if (!decoded.ok()) return decoded.status();
    version = *std::move(decoded);
    next = 4;
  }
  if (parts.size() > next + 1) return std::optional<Route>();
  const std::optional<Endpoint> endpoint =
      ModelEndpoint(parts.size() == next ? std::string_view() : parts[next]);
  if (!endpoint) return std::optional<Route>();
  return Route{*endpoint, *std::move(model), std::move(version)};
}

// The route of `request`; NOT_FOUND for a path the API does not have,
// UNIMPLEMENTED (405) for the wrong method.
absl::StatusOr<RestApi::Route> FindRoute(const HttpRequest& request) {
  const std::string_view path =
      std::string_view(request.target).substr(0, request.target.find('?'));
  std::vector<std::string_view> parts;
  for (absl::string_view part :
       absl::StrSplit(absl::string_view(path.data(), path.size()), '/', absl::SkipEmpty())) {
    parts.emplace_back(part.data(), part.size());
  }
  std::optional<RestApi::Route> route;
  if (parts.size() == 1 && parts[0] == "v2") {
    route = RestApi::Route{Endpoint::kServerMetadata};
  } else if (parts.size() == 3 && parts[0] == "v2" && parts[1] == "health" &&
             (parts[2] == "live" || parts[2] == "ready")) {
    route = RestApi::Route{parts[2] == "live" ? Endpoint::kLive : Endpoint::kReady};
  } else if (parts.size() >= 2 && parts[0] == "v2") {
    absl::StatusOr<std::optional<RestApi::Route>> found =
        ModelRoute(std::vector<std::string_view>(parts.begin() + 1, parts.end()));
    if (!found.ok()) return found.status();
    route = *std::move(found);
  }
  if (!route) {
    return absl::NotFoundError(
        absl::StrCat("no endpoint at '", Printable(path),
                     "': the Open Inference Protocol's paths start with /v2 (docs/api.md)"));
  }
  if (request.method != MethodOf(route->endpoint)) {
    return absl::UnimplementedError(absl::StrCat("method ", Printable(request.method),
                                                 " is not allowed on '", Printable(path),
                                                 "': expected ", MethodOf(route->endpoint)));
  }
  return *std::move(route);
}

template <typename Request, typename Response>
using Operation = absl::Status (InferenceOperations::*)(const CallOrigin&, const Request&,
                                                        Response*) const;

// Runs `operation`; `write` turns its answer into the JSON body.
template <typename Request, typename Response, typename Write>
HttpResponse Answer(const InferenceOperations& operations, Operation<Request, Response> operation,
                    const CallOrigin& origin, const Request& request, Write write) {
  Response response;
  const absl::Status status = (operations.*operation)(origin, request, &response);
  if (!status.ok()) return ErrorResponse(status);
  return write(response);
}

HttpResponse Json(const google::protobuf::Message& message) {
  return JsonResponse(200, ProtoToJson(message));
}

// Readiness: 200 when ready; otherwise `not_ready`, the body saying which.
HttpResponse Readiness(bool ready, int not_ready) {
  return JsonResponse(ready ? 200 : not_ready, ready ? "{\"ready\":true}" : "{\"ready\":false}");
}

}  // namespace

void RestApi::Handle(std::shared_ptr<HttpExchange> exchange) {
  absl::StatusOr<Route> route = FindRoute(exchange->request());
  if (!route.ok()) {
    HttpResponse response = ErrorResponse(route.status());
    if (route.status().code() == absl::StatusCode::kUnimplemented) response.status = 405;
    exchange->Respond(std::move(response));
    return;
  }
  if (const std::string* encoding = exchange->request().Header("content-encoding");
      encoding != nullptr && *encoding != "identity") {
    HttpResponse response = ErrorResponse(
        absl::InvalidArgumentError(absl::StrCat("header Content-Encoding: '", Printable(*encoding),
                                                "' is not supported; send the body uncompressed")));
    response.status = 415;
    exchange->Respond(std::move(response));
    return;
  }
  if (route->endpoint == Endpoint::kInfer) return Infer(std::move(exchange), *route);
  Describe(*exchange, *route);
}

namespace {

HttpResponse DescribeServer(const InferenceOperations& ops, const CallOrigin& origin,
                            Endpoint endpoint) {
  switch (endpoint) {
    case Endpoint::kLive:
      return Answer(ops, &InferenceOperations::ServerLive, origin, inference::ServerLiveRequest(),
                    Json);
    case Endpoint::kReady:
      return Answer(ops, &InferenceOperations::ServerReady, origin, inference::ServerReadyRequest(),
                    [](const auto& r) { return Readiness(r.ready(), 503); });
    default:
      return Answer(ops, &InferenceOperations::ServerMetadata, origin,
                    inference::ServerMetadataRequest(), Json);
  }
}

// The request of a model's endpoint: its name and version from the path.
template <typename Request>
Request ForModel(const RestApi::Route& route) {
  Request request;
  request.set_name(route.model);
  request.set_version(route.version);
  return request;
}

HttpResponse DescribeModel(const InferenceOperations& ops, const CallOrigin& origin,
                           const RestApi::Route& route) {
  switch (route.endpoint) {
    case Endpoint::kModelReady:
      return Answer(ops, &InferenceOperations::ModelReady, origin,
                    ForModel<inference::ModelReadyRequest>(route),
                    [](const auto& r) { return Readiness(r.ready(), 400); });
    case Endpoint::kModelConfig:
      // Triton's HTTP API answers the config itself, unwrapped.
      return Answer(ops, &InferenceOperations::ModelConfig, origin,
                    ForModel<inference::ModelConfigRequest>(route),
                    [](const auto& r) { return Json(r.config()); });
    case Endpoint::kModelStatistics:
      return Answer(ops, &InferenceOperations::ModelStatistics, origin,
                    ForModel<inference::ModelStatisticsRequest>(route), Json);
    default:
      return Answer(ops, &InferenceOperations::ModelMetadata, origin,
                    ForModel<inference::ModelMetadataRequest>(route), Json);
  }
}

HttpResponse IndexRepository(const InferenceOperations& ops, const CallOrigin& origin,
                             const std::string& body) {
  absl::StatusOr<bool> ready = ReadBoolField(body, "ready", false);
  if (!ready.ok()) return ErrorResponse(ready.status());
  inference::RepositoryIndexRequest request;
  request.set_ready(*ready);
  // Triton's HTTP API answers the list itself.
  return Answer(ops, &InferenceOperations::RepositoryIndex, origin, request,
                [](const inference::RepositoryIndexResponse& r) {
                  std::vector<std::string> models;
                  for (const auto& model : r.models()) models.push_back(ProtoToJson(model));
                  return JsonResponse(200, absl::StrCat("[", absl::StrJoin(models, ","), "]"));
                });
}

HttpResponse ChangeRepository(const InferenceOperations& ops, const CallOrigin& origin,
                              const RestApi::Route& route) {
  auto empty = [](const auto&) { return JsonResponse(200, "{}"); };
  if (route.endpoint == Endpoint::kRepositoryLoad) {
    inference::RepositoryModelLoadRequest request;
    request.set_model_name(route.model);
    return Answer(ops, &InferenceOperations::RepositoryModelLoad, origin, request, empty);
  }
  inference::RepositoryModelUnloadRequest request;
  request.set_model_name(route.model);
  return Answer(ops, &InferenceOperations::RepositoryModelUnload, origin, request, empty);
}

}  // namespace

void RestApi::Describe(HttpExchange& exchange, const Route& route) {
  const HttpCallOrigin origin(&exchange, absl::InfiniteFuture());
  switch (route.endpoint) {
    case Endpoint::kLive:
    case Endpoint::kReady:
    case Endpoint::kServerMetadata:
      return exchange.Respond(DescribeServer(*operations_, origin, route.endpoint));
    case Endpoint::kRepositoryIndex:
      return exchange.Respond(IndexRepository(*operations_, origin, exchange.request().body));
    case Endpoint::kRepositoryLoad:
    case Endpoint::kRepositoryUnload:
      return exchange.Respond(ChangeRepository(*operations_, origin, route));
    default:
      return exchange.Respond(DescribeModel(*operations_, origin, route));
  }
}

// One infer call: what its answer needs until it is sent.
struct RestApi::InferCall {
  InferCall(std::shared_ptr<HttpExchange> exchange, absl::Time deadline)
      : exchange(std::move(exchange)), origin(this->exchange.get(), deadline) {}

  std::shared_ptr<HttpExchange> exchange;
  HttpCallOrigin origin;
  inference::ModelInferRequest proto;
  DecodedInferRequest decoded;
  int64_t served_version = 0;
  bool open = false;  // counted open in the dispatcher until sent
};

namespace {

// The infer request in `call`'s body, once its credentials are accepted (a
// refused caller's body is never parsed).
absl::Status ReadInfer(const HttpRequest& request, const absl::Status& deadline,
                       inference::ModelInferRequest* proto) {
  if (!deadline.ok()) return deadline;
  absl::StatusOr<std::optional<size_t>> json_length = JsonLengthOf(request);
  if (!json_length.ok()) return json_length.status();
  return ParseRestInferRequest(request.body, *json_length, proto);
}

HttpResponse InferResponse(const inference::ModelInferRequest& request,
                           const DecodedInferRequest& decoded, const AttentionResult& result,
                           int64_t version) {
  inference::ModelInferResponse answer;
  EncodeInferResponse(request, decoded, result, &answer, version);
  RestBody body = WriteRestInferResponse(request, answer);
  HttpResponse response = JsonResponse(200, std::move(body.bytes));
  if (body.json_length) {
    response.content_type = "application/octet-stream";
    response.headers.emplace_back("Inference-Header-Content-Length",
                                  std::to_string(*body.json_length));
  }
  return response;
}

}  // namespace

// Sends `call`'s answer and deletes it; the call stays open in the
// dispatcher until the answer is written.
Dispatcher::Done RestApi::Finisher(InferCall* call) const {
  Dispatcher* const dispatcher = dispatcher_;
  return [call, dispatcher](const absl::Status& status, const AttentionResult* result) {
    std::unique_ptr<InferCall> owned(call);
    HttpResponse response =
        status.ok() ? InferResponse(call->proto, call->decoded, *result, call->served_version)
                    : ErrorResponse(status);
    response.headers.emplace_back("traceparent", call->origin.trace().Traceparent());
    const bool open = call->open;
    call->exchange->Respond(std::move(response), [dispatcher, open] {
      if (open) dispatcher->CloseCall();
    });
  };
}

void RestApi::Infer(std::shared_ptr<HttpExchange> exchange, const Route& route) {
  const absl::StatusOr<absl::Time> deadline = DeadlineOf(exchange->request(), absl::Now());
  auto* call = new InferCall(std::move(exchange), deadline.value_or(absl::InfiniteFuture()));
  call->open = dispatcher_->OpenCall("requests").ok();
  HttpRequest& request = call->exchange->request();
  const bool authenticated = call->origin.Authenticate(dispatcher_->access()).ok();
  // The path names the model, so a body that does not parse is answered
  // once the model is found, as a decoding fault.
  absl::Status encoding;
  if (authenticated) encoding = ReadInfer(request, deadline.status(), &call->proto);
  // Parsed: the body's bytes are not held while the request waits.
  std::string().swap(request.body);
  call->proto.set_model_name(route.model);
  call->proto.set_model_version(route.version);
  operations_->Infer(call->origin, kRestApi, call->proto, absl::OkStatus(), &call->decoded,
                     &call->served_version, authenticated, Finisher(call), std::move(encoding));
}

}  // namespace attention::server
