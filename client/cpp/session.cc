// session.cc: Session, a decoding session that replays itself on a new
// stream when its server is lost (session.h).
#include "client/cpp/session.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attention::client {
namespace {

using attention::v1::SessionRequest;
using attention::v1::SessionResponse;
using attention::v1::SessionStep;
using attention::v1::Tensor;

// How a stream ends when its server went away: UNAVAILABLE (a connection
// lost, a replica's shutdown: docs/api.md sections 6.5 and 11.5), CANCELLED
// (a stream reset by a proxy or a server that stopped without gRPC's
// shutdown), UNKNOWN (a stream an edge ended without its status when the
// replica behind it died; attention-server never answers UNKNOWN).
bool IsBreak(const absl::Status& status) {
  return absl::IsUnavailable(status) || absl::IsCancelled(status) || absl::IsUnknown(status);
}

// The pauses between tries at opening the stream again, as the channel's
// retry policy waits (channel.cc): from 50 ms, doubling, at most 1 s.
constexpr absl::Duration kFirstReopenBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMaxReopenBackoff = absl::Seconds(1);

absl::Status AnswerError(const SessionResponse& response) {
  return absl::Status(static_cast<absl::StatusCode>(response.error().code()),
                      response.error().message());
}

}  // namespace

absl::StatusOr<std::unique_ptr<Session>> Session::Open(AttentionClient& client,
                                                       SessionOptions options) {
  std::unique_ptr<Session> session(new Session(client, std::move(options)));
  if (absl::Status started = session->Start(); !started.ok()) return started;
  return session;
}

Session::Session(AttentionClient& client, SessionOptions options)
    : client_(client), options_(std::move(options)) {
  kept_bytes_ = static_cast<int64_t>(options_.open.ByteSizeLong());
  if (options_.replay && kept_bytes_ > options_.replay_limit_bytes) {
    unreplayable_ = absl::StrCat("its opening takes ", kept_bytes_,
                                 " bytes, more than replay_limit_bytes=",
                                 options_.replay_limit_bytes);
  }
}

Session::~Session() { static_cast<void>(EndStream()); }

absl::Status Session::Start() {
  context_ = std::make_unique<grpc::ClientContext>();
  stream_ = client_.AttendSession(*context_);
  SessionRequest request;
  *request.mutable_open() = options_.open;
  absl::StatusOr<SessionResponse> opened = Exchange(request);
  if (!opened.ok()) return opened.status();
  if (opened->has_error()) return AnswerError(*opened);
  session_id_ = opened->session_id();
  length_ = opened->length();
  return absl::OkStatus();
}

absl::StatusOr<SessionResponse> Session::Exchange(const SessionRequest& request) {
  SessionResponse response;
  if (stream_->Write(request) && stream_->Read(&response)) return response;
  absl::Status status = EndStream();
  if (status.ok()) {
    return absl::InternalError("AttendSession: the stream ended without an answer");
  }
  return status;
}

absl::Status Session::EndStream() {
  if (stream_ == nullptr) return absl::OkStatus();
  stream_->WritesDone();
  const absl::Status status = ToAbslStatus(stream_->Finish());
  stream_.reset();
  context_.reset();
  return status;
}

absl::StatusOr<SessionResponse> Session::Step(const Tensor& rows, bool return_attention_weights) {
  SessionStep step;
  *step.mutable_queries() = rows;
  step.set_return_attention_weights(return_attention_weights);
  return Step(step);
}

absl::StatusOr<SessionResponse> Session::Step(const SessionStep& step) {
  if (over_) {
    return absl::FailedPreconditionError(
        "the session is over: its stream broke and could not be replayed");
  }
  SessionRequest request;
  *request.mutable_step() = step;
  absl::StatusOr<SessionResponse> answer = Exchange(request);
  // The replayed stream may break too before it answers (a server short of
  // session memory preempts the session again): it is replayed again, until
  // the client's timeout after the first break.
  std::optional<absl::Time> give_up;
  while (!answer.ok()) {
    if (!give_up) give_up = absl::Now() + client_.timeout();
    if (!options_.replay || !IsBreak(answer.status()) || absl::Now() > *give_up) {
      over_ = true;
      return answer.status();
    }
    if (absl::Status replayed = Replay(answer.status()); !replayed.ok()) {
      over_ = true;
      return replayed;
    }
    answer = Exchange(request);
  }
  length_ = answer->length();
  if (answer->has_error()) return AnswerError(*answer);
  Keep(step);
  return answer;
}

void Session::KeptRows::Append(const Tensor& tensor) {
  // The server answered, so the shape is (B, n, ...) with the session's B
  // and row shape.
  const int64_t batch = tensor.shape(0), n = tensor.shape(1);
  row_shape.assign(tensor.shape().begin() + 2, tensor.shape().end());
  int64_t width = 1;
  for (int64_t size : row_shape) width *= size;
  examples.resize(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const float* from = tensor.data().data() + b * n * width;
    examples[b].insert(examples[b].end(), from, from + n * width);
  }
  rows += n;
}

void Session::KeptRows::To(Tensor* tensor) const {
  tensor->add_shape(static_cast<int64_t>(examples.size()));
  tensor->add_shape(rows);
  tensor->mutable_shape()->Add(row_shape.begin(), row_shape.end());
  for (const std::vector<float>& example : examples) {
    tensor->mutable_data()->Add(example.begin(), example.end());
  }
}

void Session::Forget(std::string reason) {
  unreplayable_ = std::move(reason);
  kept_ = kept_keys_ = kept_values_ = KeptRows();
}

void Session::Keep(const SessionStep& step) {
  if (!options_.replay || !unreplayable_.empty() ||
      options_.open.memory() != attention::v1::SESSION_MEMORY_SELF) {
    return;  // cross memory is all in the opening: steps change nothing to replay
  }
  if (kept_.rows == 0) {
    carries_keys_ = step.has_keys();
    carries_values_ = step.has_values();
  } else if (step.has_keys() != carries_keys_ || step.has_values() != carries_values_) {
    Forget("its steps differ in whether they carry keys and values");
    return;
  }
  kept_bytes_ += static_cast<int64_t>(step.queries().data_size() + step.keys().data_size() +
                                      step.values().data_size()) *
                 4;
  if (kept_bytes_ > options_.replay_limit_bytes) {
    Forget(absl::StrCat("its opening and rows take ", kept_bytes_,
                        " bytes, more than replay_limit_bytes=", options_.replay_limit_bytes));
    return;
  }
  kept_.Append(step.queries());
  if (carries_keys_) kept_keys_.Append(step.keys());
  if (carries_values_) kept_values_.Append(step.values());
}

SessionRequest Session::Prefill() const {
  SessionRequest request;
  kept_.To(request.mutable_step()->mutable_queries());
  if (carries_keys_) kept_keys_.To(request.mutable_step()->mutable_keys());
  if (carries_values_) kept_values_.To(request.mutable_step()->mutable_values());
  return request;
}

absl::Status Session::Replay(const absl::Status& broke) {
  const std::string what =
      absl::StrCat("the session's stream broke (", absl::StatusCodeToString(broke.code()), ": ",
                   broke.message(), ")");
  if (!unreplayable_.empty()) {
    return absl::Status(broke.code(), absl::StrCat(what, " and cannot be replayed: ",
                                                   unreplayable_));
  }
  const int64_t length = length_;
  const absl::Time give_up = absl::Now() + client_.timeout();
  absl::Duration backoff = kFirstReopenBackoff;
  int tries = 0;
  std::string last;
  while (true) {
    ++tries;
    // A target that is restarting: wait for a connection first.
    if (!client_.WaitForStreamConnection(give_up)) {
      last = "no server took a connection";
      break;
    }
    absl::Status replayed = Start();
    if (replayed.ok() && kept_.rows > 0) {
      absl::StatusOr<SessionResponse> prefill = Exchange(Prefill());
      if (!prefill.ok()) {
        replayed = prefill.status();
      } else if (prefill->has_error()) {
        replayed = AnswerError(*prefill);
      }
    }
    if (replayed.ok()) {
      length_ = length;
      ++replays_;
      return absl::OkStatus();
    }
    if (!IsBreak(replayed)) {  // the server refused the replay
      return absl::Status(replayed.code(),
                          absl::StrCat(what, "; replaying it on a new stream was refused: ",
                                       replayed.message()));
    }
    // A stream that broke too, or a server that refused it while draining.
    static_cast<void>(EndStream());
    last = absl::StrCat(absl::StatusCodeToString(replayed.code()), ": ", replayed.message());
    if (absl::Now() + backoff > give_up) break;
    absl::SleepFor(backoff);
    backoff = std::min(2 * backoff, kMaxReopenBackoff);
  }
  return absl::Status(broke.code(),
                      absl::StrCat(what, "; ", tries, " tries at opening it again in ",
                                   absl::FormatDuration(client_.timeout()),
                                   " failed, the last: ", last));
}

}  // namespace attention::client
