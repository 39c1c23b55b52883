// session.cc: Session, a decoding session that replays itself on a new
// stream when its server is lost (session.h).
#include "client/cpp/session.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attention::client {
namespace {

using attention::v1::SessionRequest;
using attention::v1::SessionResponse;
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
  if (over_) {
    return absl::FailedPreconditionError(
        "the session is over: its stream broke and could not be replayed");
  }
  SessionRequest request;
  *request.mutable_step()->mutable_queries() = rows;
  request.mutable_step()->set_return_attention_weights(return_attention_weights);
  absl::StatusOr<SessionResponse> answer = Exchange(request);
  if (!answer.ok()) {
    if (!options_.replay || !IsBreak(answer.status())) {
      over_ = true;
      return answer.status();
    }
    if (absl::Status replayed = Replay(answer.status()); !replayed.ok()) {
      over_ = true;
      return replayed;
    }
    answer = Exchange(request);
    if (!answer.ok()) {
      over_ = true;
      return answer.status();
    }
  }
  length_ = answer->length();
  if (answer->has_error()) return AnswerError(*answer);
  Keep(rows);
  return answer;
}

void Session::Keep(const Tensor& rows) {
  if (!options_.replay || !unreplayable_.empty() ||
      options_.open.memory() != attention::v1::SESSION_MEMORY_SELF) {
    return;  // cross memory is all in the opening: steps change nothing to replay
  }
  kept_bytes_ += static_cast<int64_t>(rows.data_size()) * 4;
  if (kept_bytes_ > options_.replay_limit_bytes) {
    unreplayable_ = absl::StrCat("its opening and rows take ", kept_bytes_,
                                 " bytes, more than replay_limit_bytes=",
                                 options_.replay_limit_bytes);
    kept_.clear();
    kept_.shrink_to_fit();
    return;
  }
  // The server answered, so the shape is (B, n, d) with the session's B and d.
  const int64_t batch = rows.shape(0), n = rows.shape(1);
  width_ = rows.shape(2);
  kept_.resize(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const float* from = rows.data().data() + b * n * width_;
    kept_[b].insert(kept_[b].end(), from, from + n * width_);
  }
  kept_rows_ += n;
}

SessionRequest Session::Prefill() const {
  SessionRequest request;
  Tensor* rows = request.mutable_step()->mutable_queries();
  rows->add_shape(static_cast<int64_t>(kept_.size()));
  rows->add_shape(kept_rows_);
  rows->add_shape(width_);
  rows->mutable_data()->Reserve(static_cast<int>(kept_.size() * kept_rows_ * width_));
  for (const std::vector<float>& example : kept_) {
    rows->mutable_data()->Add(example.begin(), example.end());
  }
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
    if (replayed.ok() && kept_rows_ > 0) {
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
