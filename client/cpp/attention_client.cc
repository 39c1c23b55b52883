// attention_client.cc: AttentionClient (see attention_client.h). Blocking
// calls use the callback API and wait on it: the Await() bridge of gRPC's
// callback examples; AttendStream has its own reactor.
#include "client/cpp/attention_client.h"

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/cpp/channel.h"
#include "grpcpp/alarm.h"

namespace attention::client {
namespace {

using attention::v1::AttendRequest;
using attention::v1::AttendResponse;
using attention::v1::ListModelsRequest;
using attention::v1::ListModelsResponse;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// The header an edge routes a sequence's unary steps by (docs/api.md
// section 11.3).
constexpr char kSequenceIdHeader[] = "attention-sequence-id";

// The value of kSequenceIdHeader for `request`: its sequence id, decimal for
// an integer, the string as it is; nullopt when it names no sequence (no
// sequence_id, 0 or "") or when the string cannot be a header value (HTTP/2
// allows visible ASCII and spaces only, and gRPC fails a call that has
// anything else, whereas the header only helps routing).
std::optional<std::string> SequenceIdHeaderValue(const inference::ModelInferRequest& request) {
  const auto found = request.parameters().find("sequence_id");
  if (found == request.parameters().end()) return std::nullopt;
  const inference::InferParameter& id = found->second;
  switch (id.parameter_choice_case()) {
    case inference::InferParameter::kInt64Param:
      if (id.int64_param() != 0) return absl::StrCat(id.int64_param());
      break;
    case inference::InferParameter::kUint64Param:
      if (id.uint64_param() != 0) return absl::StrCat(id.uint64_param());
      break;
    case inference::InferParameter::kStringParam:
      if (!id.string_param().empty() &&
          std::all_of(id.string_param().begin(), id.string_param().end(),
                      [](char c) { return c >= 0x20 && c <= 0x7e; })) {
        return id.string_param();
      }
      break;
    default:
      break;
  }
  return std::nullopt;
}

// Blocks a thread until one callback-API call reports its status.
class CallAwaiter {
 public:
  std::function<void(grpc::Status)> Done() {
    return [this](grpc::Status status) {
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(status);
      done_ = true;
      cv_.notify_one();
    };
  }

  grpc::Status Await() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_; });
    return status_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  grpc::Status status_;
};

// One stream's answer as a result: the response, or its AttendError as a
// status. A code that is not an error code (0, or beyond the known ones)
// still comes back as an error, UNKNOWN, naming the code the server sent.
absl::StatusOr<AttendResponse> StreamAnswer(AttendResponse response) {
  if (!response.has_error()) return response;
  const int code = response.error().code();
  if (code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    return absl::UnknownError(absl::StrCat("the server answered with error code ", code,
                                           ": ", response.error().message()));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), response.error().message());
}

// One AttendStream call over a non-empty span of requests. Writes chain
// through OnWriteDone and reads through OnReadDone, one of each in flight,
// so writing never waits for reading. Lives on the caller's stack: Await()
// returns only after OnDone, the reactor's last callback.
class StreamCall final : public grpc::ClientBidiReactor<AttendRequest, AttendResponse> {
 public:
  StreamCall(attention::v1::AttentionService::Stub* stub, grpc::ClientContext* context,
             std::span<const AttendRequest> requests)
      : requests_(requests) {
    results_.reserve(requests_.size());
    stub->async()->AttendStream(context, this);
    WriteNext();
    StartRead(&response_);
    StartCall();
  }

  // The call's status, or every answer in request order.
  absl::StatusOr<AttentionClient::StreamResults> Await() {
    if (grpc::Status status = awaiter_.Await(); !status.ok()) return ToAbslStatus(status);
    if (results_.size() != requests_.size() || extra_answers_ > 0) {
      return absl::InternalError(absl::StrCat("AttendStream: the server answered ",
                                              results_.size() + extra_answers_, " of ",
                                              requests_.size(), " requests"));
    }
    return std::move(results_);
  }

  // `ok` false: the call is over; OnDone reports why.
  void OnWriteDone(bool ok) override {
    if (ok && next_write_ < requests_.size()) WriteNext();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (results_.size() < requests_.size()) {
      results_.push_back(StreamAnswer(std::move(response_)));
    } else {
      ++extra_answers_;
    }
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override { done_(status); }

 private:
  // The last request also half-closes the stream, in the same operation.
  void WriteNext() {
    const AttendRequest& request = requests_[next_write_++];
    if (next_write_ == requests_.size()) {
      StartWriteLast(&request, grpc::WriteOptions());
    } else {
      StartWrite(&request);
    }
  }

  const std::span<const AttendRequest> requests_;  // owned by the caller of AttendStream
  size_t next_write_ = 0;                          // touched by writes only
  AttendResponse response_;                        // target of the read in flight
  AttentionClient::StreamResults results_;         // touched by reads only, then Await()
  size_t extra_answers_ = 0;                       // answers beyond one per request
  CallAwaiter awaiter_;
  const std::function<void(grpc::Status)> done_ = awaiter_.Done();
};

// When an Attend is sent again: its answer was cut off on its way (UNKNOWN:
// an edge in front lost the replica that was sending it, and ended the
// stream after the message without the status; attention-server itself
// never answers UNKNOWN). gRPC's retry policy cannot resend it, as a call is
// committed once its answer's headers arrived. So it is sent again here,
// up to the policy's max_attempts tries in all and within the call's
// deadline, after pauses from its initial_backoff, times its multiplier each
// time, up to its max_backoff, each varied by up to 20% either way.
class CutOffResends {
 public:
  CutOffResends(const RetryOptions& retry, absl::Time deadline)
      : retry_(retry), deadline_(deadline), backoff_(retry.initial_backoff) {}

  // The pause before sending again after `status`; nullopt: report it.
  std::optional<absl::Duration> Next(const grpc::Status& status) {
    if (status.error_code() != grpc::StatusCode::UNKNOWN || sent_ >= retry_.max_attempts) {
      return std::nullopt;
    }
    thread_local std::minstd_rand random(std::random_device{}());
    const absl::Duration pause =
        backoff_ * std::uniform_real_distribution<double>(0.8, 1.2)(random);
    if (absl::Now() + pause >= deadline_) return std::nullopt;
    backoff_ = std::min(backoff_ * retry_.backoff_multiplier, retry_.max_backoff);
    ++sent_;
    return pause;
  }

 private:
  const RetryOptions retry_;
  const absl::Time deadline_;
  absl::Duration backoff_;
  int sent_ = 1;
};

}  // namespace

// What an AttendAsync or InferAsync call keeps alive until it ends; deleted
// then. A call sent again gets a new context.
template <typename Response>
struct AttentionClient::AsyncCall {
  std::optional<grpc::ClientContext> context;
  Response response;
  std::function<void(absl::StatusOr<Response>)> done;
  std::optional<CutOffResends> resends;  // set for an Attend
  // Before it is sent again; a new one each time, as the send may end (and
  // need the next pause) inside the last one's callback.
  std::optional<grpc::Alarm> pause;
};

absl::Status ToAbslStatus(const grpc::Status& status) {
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

absl::StatusOr<std::unique_ptr<AttentionClient>> AttentionClient::Create(
    ClientOptions options) {
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "timeout must be positive; was ", absl::FormatDuration(options.timeout)));
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = CreateChannel(options);
  if (!channel.ok()) return channel.status();
  ClientOptions stream_options = options;
  stream_options.retry.max_attempts = 1;
  absl::StatusOr<std::shared_ptr<grpc::Channel>> stream_channel = CreateChannel(stream_options);
  if (!stream_channel.ok()) return stream_channel.status();
  return std::unique_ptr<AttentionClient>(new AttentionClient(
      std::move(options), *std::move(channel), *std::move(stream_channel)));
}

AttentionClient::AttentionClient(ClientOptions options, std::shared_ptr<grpc::Channel> channel,
                                 std::shared_ptr<grpc::Channel> stream_channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(attention::v1::AttentionService::NewStub(channel_)),
      health_stub_(grpc::health::v1::Health::NewStub(channel_)),
      inference_stub_(inference::GRPCInferenceService::NewStub(channel_)),
      stream_channel_(std::move(stream_channel)),
      stream_stub_(attention::v1::AttentionService::NewStub(stream_channel_)) {}

void AttentionClient::Prepare(grpc::ClientContext& context, absl::Duration timeout) const {
  Prepare(context, DeadlineAfter(timeout));
}

absl::Time AttentionClient::DeadlineAfter(absl::Duration timeout) {
  return timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
}

void AttentionClient::Prepare(grpc::ClientContext& context, absl::Time deadline) const {
  if (deadline != absl::InfiniteFuture()) context.set_deadline(absl::ToChronoTime(deadline));
  if (!options_.token.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.token));
  }
}

absl::StatusOr<AttendResponse> AttentionClient::Attend(const AttendRequest& request) {
  return Attend(request, options_.timeout);
}

absl::StatusOr<AttendResponse> AttentionClient::Attend(const AttendRequest& request,
                                                       absl::Duration timeout) {
  const absl::Time deadline = DeadlineAfter(timeout);
  CutOffResends resends(options_.retry, deadline);
  for (;;) {
    grpc::ClientContext context;
    Prepare(context, deadline);
    AttendResponse response;
    CallAwaiter awaiter;
    stub_->async()->Attend(&context, &request, &response, awaiter.Done());
    const grpc::Status status = awaiter.Await();
    if (status.ok()) return response;
    const std::optional<absl::Duration> pause = resends.Next(status);
    if (!pause) return ToAbslStatus(status);
    absl::SleepFor(*pause);
  }
}

AttentionClient::~AttentionClient() {
  absl::MutexLock lock(&async_mu_);
  async_mu_.Await(absl::Condition(
      +[](int* calls) { return *calls == 0; }, &async_calls_));
}

template <typename Response, typename Start>
void AttentionClient::StartAsync(std::function<void(absl::StatusOr<Response>)> done,
                                 Start start, CutOffs cut_offs) {
  {
    absl::MutexLock lock(&async_mu_);
    ++async_calls_;
  }
  auto* call = new AsyncCall<Response>;
  call->done = std::move(done);
  const absl::Time deadline = DeadlineAfter(options_.timeout);
  if (cut_offs == CutOffs::kSendAgain) call->resends.emplace(options_.retry, deadline);
  SendAsync(call, std::move(start), deadline);
}

template <typename Response, typename Start>
void AttentionClient::SendAsync(AsyncCall<Response>* call, Start start, absl::Time deadline) {
  call->context.emplace();
  Prepare(*call->context, deadline);
  call->response.Clear();
  start(&*call->context, &call->response, [this, call, start, deadline](grpc::Status status) {
    const std::optional<absl::Duration> pause =
        call->resends ? call->resends->Next(status) : std::nullopt;
    if (pause) {
      call->pause.emplace();
      call->pause->Set(absl::ToChronoTime(absl::Now() + *pause),
                       [this, call, start, deadline](bool) { SendAsync(call, start, deadline); });
      return;
    }
    if (status.ok()) {
      call->done(std::move(call->response));
    } else {
      call->done(ToAbslStatus(status));
    }
    delete call;
    absl::MutexLock lock(&async_mu_);
    --async_calls_;
  });
}

void AttentionClient::AttendAsync(const AttendRequest* request, AttendCallback done) {
  StartAsync(std::move(done), [this, request](grpc::ClientContext* context,
                                              AttendResponse* response,
                                              std::function<void(grpc::Status)> finished) {
    stub_->async()->Attend(context, request, response, std::move(finished));
  }, CutOffs::kSendAgain);
}

void AttentionClient::InferAsync(const inference::ModelInferRequest* request,
                                 InferCallback done) {
  StartAsync(std::move(done), [this, request](grpc::ClientContext* context,
                                              inference::ModelInferResponse* response,
                                              std::function<void(grpc::Status)> finished) {
    if (std::optional<std::string> id = SequenceIdHeaderValue(*request)) {
      context->AddMetadata(kSequenceIdHeader, *id);
    }
    inference_stub_->async()->ModelInfer(context, request, response, std::move(finished));
  }, CutOffs::kReport);
}

std::unique_ptr<grpc::ClientReaderWriter<attention::v1::SessionRequest,
                                         attention::v1::SessionResponse>>
AttentionClient::AttendSession(grpc::ClientContext& context) {
  Prepare(context, absl::InfiniteDuration());
  return stream_stub_->AttendSession(&context);
}

bool AttentionClient::WaitForStreamConnection(absl::Time deadline) {
  return stream_channel_->WaitForConnected(absl::ToChronoTime(deadline));
}

absl::StatusOr<AttentionClient::StreamResults> AttentionClient::AttendStream(
    std::span<const AttendRequest> requests) {
  return AttendStream(requests, options_.timeout);
}

absl::StatusOr<AttentionClient::StreamResults> AttentionClient::AttendStream(
    std::span<const AttendRequest> requests, absl::Duration timeout) {
  if (requests.empty()) return StreamResults();
  grpc::ClientContext context;
  Prepare(context, timeout);
  StreamCall call(stream_stub_.get(), &context, requests);
  return call.Await();
}

absl::StatusOr<ListModelsResponse> AttentionClient::ListModels() {
  grpc::ClientContext context;
  Prepare(context, options_.timeout);
  ListModelsRequest request;
  ListModelsResponse response;
  CallAwaiter awaiter;
  stub_->async()->ListModels(&context, &request, &response, awaiter.Done());
  if (grpc::Status status = awaiter.Await(); !status.ok()) return ToAbslStatus(status);
  return response;
}

absl::StatusOr<inference::RepositoryIndexResponse> AttentionClient::RepositoryIndex() {
  grpc::ClientContext context;
  Prepare(context, options_.timeout);
  inference::RepositoryIndexRequest request;
  inference::RepositoryIndexResponse response;
  CallAwaiter awaiter;
  inference_stub_->async()->RepositoryIndex(&context, &request, &response, awaiter.Done());
  if (grpc::Status status = awaiter.Await(); !status.ok()) return ToAbslStatus(status);
  return response;
}

absl::Status AttentionClient::LoadModel(const std::string& model) {
  grpc::ClientContext context;
  Prepare(context, options_.timeout);
  inference::RepositoryModelLoadRequest request;
  request.set_model_name(model);
  inference::RepositoryModelLoadResponse response;
  CallAwaiter awaiter;
  inference_stub_->async()->RepositoryModelLoad(&context, &request, &response, awaiter.Done());
  return ToAbslStatus(awaiter.Await());
}

absl::Status AttentionClient::UnloadModel(const std::string& model) {
  grpc::ClientContext context;
  Prepare(context, options_.timeout);
  inference::RepositoryModelUnloadRequest request;
  request.set_model_name(model);
  inference::RepositoryModelUnloadResponse response;
  CallAwaiter awaiter;
  inference_stub_->async()->RepositoryModelUnload(&context, &request, &response, awaiter.Done());
  return ToAbslStatus(awaiter.Await());
}

absl::StatusOr<HealthCheckResponse::ServingStatus> AttentionClient::Health(
    const std::string& service) {
  grpc::ClientContext context;
  Prepare(context, options_.timeout);
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  CallAwaiter awaiter;
  health_stub_->async()->Check(&context, &request, &response, awaiter.Done());
  if (grpc::Status status = awaiter.Await(); !status.ok()) return ToAbslStatus(status);
  return response.status();
}

}  // namespace attention::client
