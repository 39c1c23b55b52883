// session.h: a decoding session (docs/api.md section 11) over one
// AttendSession stream that survives losing its server.
//
// A session lives in one server process, so a replica that restarts, dies or
// shuts down takes it along. Session keeps what it sent (the opening, and
// for self memory every answered step's rows) and, when its stream breaks
// (UNAVAILABLE, CANCELLED), opens a new stream through the same client (the
// same target), replays the rows as one prefill step, whose answer it drops,
// and sends the broken step again (docs/api.md section 11.6). Self memory's
// step equals causal attention on the whole prefix, so the replayed session
// holds what the lost one held, and later steps answer as they would have.
//
//   SessionOptions options;
//   options.open.set_model("mh_torch_small");                 // self memory, B = 1
//   absl::StatusOr<std::unique_ptr<Session>> session = Session::Open(*client, options);
//   if (!session.ok()) return session.status();             // NOT_FOUND, RESOURCE_EXHAUSTED...
//   absl::StatusOr<attention::v1::SessionResponse> step = (*session)->Step(rows);
//   step->output(); step->length(); (*session)->replays();
//
// A Session is used from one thread: each Step blocks until its answer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attention.grpc.pb.h"
#include "client/cpp/attention_client.h"

namespace attention::client {

struct SessionOptions {
  // The opening: model, version, memory (self or cross), batch; for cross
  // memory keys, values and valid_lens; scale.
  attention::v1::SessionOpen open;
  // When the stream breaks, replay the session on a new stream and send the
  // step again. false: the break is the step's error (the stream's status).
  bool replay = true;
  // Most bytes the opening and the kept rows may take (default 64 MiB). Past
  // it they are dropped, and a later break fails with the break's code and a
  // message naming this bound.
  int64_t replay_limit_bytes = int64_t{64} << 20;
};

class Session {
 public:
  // Opens the session through `client`, which must outlive it. The error is
  // the server's refusal (its code and message: NOT_FOUND, INVALID_ARGUMENT,
  // RESOURCE_EXHAUSTED naming the limit) or the call's status.
  static absl::StatusOr<std::unique_ptr<Session>> Open(AttentionClient& client,
                                                       SessionOptions options);

  // Closes the stream: the server frees the session's keys and values.
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // One step: `rows` (B, n_new, d) are the new tokens (self memory) or the
  // queries (cross memory). Returns the answer (output, attention_weights
  // when asked, length); a step the server refused is its error (code and
  // message), and the session is as before it. A break is replayed first
  // (replays() counts it); without replay, its status. A break that cannot
  // be replayed (rows past the bound, the new server refusing the replay, no
  // server reached) fails with the break's code and the reason, and the
  // session is over: later steps are FAILED_PRECONDITION.
  absl::StatusOr<attention::v1::SessionResponse> Step(const attention::v1::Tensor& rows,
                                                      bool return_attention_weights = false);
  // A step as the message carries it: a dot_product self session over
  // grouped heads takes 4-D rows (B, n_new, H, d) and the step's own `keys`
  // (B, n_new, H_kv, d) and `values` (B, n_new, H_kv, d_v), which a replay
  // sends again too (steps that differ in which of them they carry cannot
  // be replayed as one prefill: a later break then fails, saying so).
  absl::StatusOr<attention::v1::SessionResponse> Step(const attention::v1::SessionStep& step);

  int replays() const { return replays_; }
  int64_t length() const { return length_; }
  // The server's id of the session; a replay changes it.
  const std::string& session_id() const { return session_id_; }

 private:
  Session(AttentionClient& client, SessionOptions options);

  // Opens a stream and sends the opening; the server's refusal as an error.
  absl::Status Start();
  // Writes `request` on the stream and reads its answer; an error status
  // means the stream broke (the call's status).
  absl::StatusOr<attention::v1::SessionResponse> Exchange(
      const attention::v1::SessionRequest& request);
  // Ends the current stream (if any) and returns its status.
  absl::Status EndStream();
  // After `broke`: a new stream holding the session as it was, or the error.
  absl::Status Replay(const absl::Status& broke);
  // Keeps an answered step's rows (and its own keys and values) for a
  // replay, within the bound.
  void Keep(const attention::v1::SessionStep& step);
  // Drops what is kept for a replay; a later break fails with `reason`.
  void Forget(std::string reason);
  // The kept rows as one (B, n, ...) step.
  attention::v1::SessionRequest Prefill() const;

  // One tensor's answered rows, per example, row after row.
  struct KeptRows {
    std::vector<std::vector<float>> examples;
    int64_t rows = 0;
    std::vector<int64_t> row_shape;  // the axes after n: (d), or (H, d)
    void Append(const attention::v1::Tensor& tensor);
    void To(attention::v1::Tensor* tensor) const;
  };

  AttentionClient& client_;  // not owned
  const SessionOptions options_;
  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<attention::v1::SessionRequest,
                                           attention::v1::SessionResponse>>
      stream_;
  // Self memory's answered rows, and the steps' own keys and values when
  // they carry them (`carries_keys_`, `carries_values_`, as the first kept
  // step did).
  KeptRows kept_, kept_keys_, kept_values_;
  bool carries_keys_ = false, carries_values_ = false;
  int64_t kept_bytes_ = 0;     // the opening's and the rows'
  std::string unreplayable_;   // why a break can no longer be replayed
  bool over_ = false;          // a break could not be replayed
  int replays_ = 0;
  int64_t length_ = 0;
  std::string session_id_;
};

}  // namespace attention::client
