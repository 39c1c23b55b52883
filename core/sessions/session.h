// session.h: decoding sessions: keys and values kept across steps, in
// fixed-size blocks of a pool shared by every session of a server.
//
// A session is one model's attention memory, opened once and then stepped:
//
//   self   every step brings new token rows (B, n_new, d_q). Their keys and
//          values (multi_head: projected, once; dot_product: the rows
//          themselves) are appended to the memory, and the step's queries
//          attend to everything before them and causally among themselves:
//          query i of a step that starts at length L sees keys [0, L + i].
//          A first step may carry a whole prompt (prefill). So step by step
//          the outputs equal Attend() on the whole prefix with causal = true.
//   cross  keys and values (B, n_k, ...) with valid lengths are given at open
//          and stay (multi_head: projected once; additive: W_k k once); every
//          step's queries attend to them, as Attend() with that memory would.
//
// Memory lives in blocks of kKvBlockRows rows from a KvBlockPool, as vLLM's
// paged KV cache keeps it, so a session wastes at most one block per example
// and per tensor; a block holds its rows head-major (each kv head's slices
// of the rows together), and the kernels read the blocks in place. A step that fails
// (validation, the pool full, a limit, a stop) leaves its session exactly as
// it was before the step.
//
//   KvBlockPool pool(1 << 30);
//   auto session = Session::Open(model, pool, {.memory = SessionMemory::kSelf});
//   SessionStep step{.queries = prompt};
//   absl::StatusOr<ValidatedStep> validated = ValidateStep(**session, step);
//   AttentionResult result;
//   engine.RunSteps({&*validated, 1}, {&result, 1});
//
// KvBlockPool befriends Session and Session befriends ValidateStep, which
// reach the blocks and the session's state through them
// (core/sessions/session_state.h), so that neither is public API.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>

#include "absl/status/statusor.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/engine/request.h"
#include "core/kernels/float16.h"
#include "core/tensor.h"
#include "core/kernels/tile_sizes.h"

namespace attention {

class Session;
namespace internal {
absl::Status AppendUncomputed(Session& session, int64_t rows, uint32_t seed);
}  // namespace internal

// Rows of one block: a multiple of the flash kernel's key tile, so a key
// tile never straddles two blocks. One tile: sessions that share a prompt
// (KvBlockPool's prefix sharing) each hold their own last partial block,
// so the smaller the block, the less a shared prompt's sessions hold apart.
inline constexpr int64_t kKvBlockRows = kFlashKeyTile;

class Session;

// Blocks of kKvBlockRows x width floats (a 16-bit session's rows of 2 width
// elements take width floats), for every session of a server, with
// one byte budget. Thread-safe. Freed blocks are kept for reuse up to the
// budget, so a server's memory for sessions never exceeds capacity_bytes.
//
// Prefix sharing (on unless the pool is made without it), as vLLM's
// automatic prefix caching: every full block of a self session is keyed by
// a hash chain over the input rows that produced it and everything before
// them, with the model and the session's parameters, and a session whose
// step begins at a block boundary with rows whose blocks are held already
// (by another session, or cached) takes those blocks instead of new ones:
// one block, several holders. Only full blocks are shared; a session's last
// partial block is its own, so no holder ever writes a shared block. A keyed
// block no session holds stays cached, least recently freed first to go,
// until the pool needs its room: a cached block gives way before any
// session is asked to (Reclaim). The outputs of a prompt's pieces are
// cached too, and a later session's same piece over shared blocks copies
// them (Session::State::row_keys); they give way first. Answers are the
// same bit for bit with sharing on or off: a shared block holds exactly the
// rows the session would have computed, and cached outputs the bits its
// piece would have.
class KvBlockPool {
 public:
  // Asked for room when `bytes` more do not fit for `asking` (null: a
  // session being opened): ends a session that holds blocks (its destructor
  // gives them back) and returns true, or returns false when none can be
  // ended, and the blocks are refused. Called without the pool's lock, on
  // the thread that asked for the blocks, which holds `asking`: the
  // reclaimer must never end that one (a server ends only sessions with no
  // step in flight, and the one asking either is in a step or is not open
  // yet).
  using Reclaim = std::function<bool(const Session* asking, int64_t bytes)>;

  explicit KvBlockPool(int64_t capacity_bytes, Reclaim reclaim = nullptr,
                       bool prefix_sharing = true);
  ~KvBlockPool();
  KvBlockPool(const KvBlockPool&) = delete;
  KvBlockPool& operator=(const KvBlockPool&) = delete;

  int64_t capacity_bytes() const;
  // Bytes of blocks sessions hold now, a block held by several once.
  int64_t used_bytes() const;

  struct PrefixStats {
    int64_t shared_bytes = 0;  // of used_bytes: blocks two or more sessions hold
    int64_t cached_bytes = 0;  // keyed blocks no session holds, kept until needed
    // Rows of prompts (steps of more than one row, per example) looked up,
    // and those of them found in blocks held or cached; since the pool began.
    int64_t query_tokens = 0;
    int64_t hit_tokens = 0;
  };
  PrefixStats prefix_stats() const;

  class Impl;

 private:
  // Sessions take and return blocks through impl_ (core/sessions/session_state.h).
  friend class Session;
  std::unique_ptr<Impl> impl_;
};

enum class SessionMemory { kSelf, kCross };

struct SessionStep;
struct ValidatedStep;

struct SessionOpen {
  SessionMemory memory = SessionMemory::kSelf;
  // self: examples decoded side by side; every step has this batch.
  int64_t batch = 1;
  // cross: keys (B, n_k, d_k) and values (B, n_k, d_v; absent: values =
  // keys), and their valid lengths (empty, or B entries). Read only by
  // Open(): it copies or projects them into the pool.
  std::optional<TensorView> keys{}, values{};
  std::span<const int32_t> valid_lens{};
  // Replaces the kind's default scale, for every step.
  std::optional<float> scale{};
  // dot_product self memory: key j is allowed for query i only if
  // i - j < sliding_window, and scores are soft-capped to
  // softcap * tanh(s / softcap), for every step (0: none), as an Attend
  // request's fields of the same names.
  int64_t sliding_window = 0;
  float softcap = 0;
  // Most tokens a self session may hold per example; 0 = no limit.
  int64_t max_length = 0;
  // What the blocks hold: float32, or keys and values rounded once to 16
  // bits when they enter the memory (half the pool's bytes a row, and half
  // the bytes a step reads); the kernels read them as held.
  KvDtype kv_dtype = KvDtype::kFloat32;
};

class Session {
 public:
  // Validates `open` against the model (INVALID_ARGUMENT naming the field:
  // self memory only for multi_head and dot_product, cross memory for every
  // kind) and, for cross memory, projects its keys and values into blocks
  // of `pool` (RESOURCE_EXHAUSTED naming the pool's capacity when it is
  // full). The session keeps `model` (the version it opened with) and
  // `pool`, which must outlive it.
  static absl::StatusOr<std::unique_ptr<Session>> Open(std::shared_ptr<const Model> model,
                                                       KvBlockPool& pool, const SessionOpen& open,
                                                       const Limits& limits = {});
  // Returns every block to the pool.
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const Model& model() const;
  SessionMemory memory() const;
  int64_t batch() const;
  // Tokens held per example: self, the sum of the steps so far; cross, n_k.
  int64_t length() const;
  // Bytes of the pool this session holds. Like length(), not to be read
  // while a step of the session runs; KvBlockPool::used_bytes() may be.
  int64_t held_bytes() const;
  // Its owner ended it with `why` while a step of it waits for the pool
  // (PoolWasFull), which is then answered `why` rather than tried again.
  // Thread-safe, as ended() is; OK until then.
  void MarkEnded(absl::Status why);
  absl::Status ended() const;

  class State;

 private:
  explicit Session(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
  friend class Engine;
  friend absl::StatusOr<ValidatedStep> ValidateStep(Session& session, const SessionStep& step,
                                                    const Limits& limits);
  friend int64_t ChunkRows(const ValidatedStep& step, double max_work);
  friend void AbandonStep(const ValidatedStep& step);
  friend absl::Status internal::AppendUncomputed(Session& session, int64_t rows, uint32_t seed);
};

struct SessionStep {
  // (B, n_new, d_q). Self: the new tokens, which are also the step's keys
  // and values. Cross: the step's queries.
  TensorView queries;
  bool return_attention_weights = false;
  // A dot_product self session over grouped heads (4-D rows): the step's own
  // keys (B, n_new, H_kv, d) and values (B, n_new, H_kv, d_v), appended
  // instead of the queries; absent: the queries serve, as for 3-D rows.
  std::optional<TensorView> keys{}, values{};
};

// A step that passed ValidateStep() for its session. Several sessions'
// steps of one model run as one engine execution (Engine::RunSteps).
struct ValidatedStep {
  Session* session = nullptr;       // not owned; one step at a time per session
  const SessionStep* step = nullptr;  // not owned; outlives RunSteps()
  // The step as Attend() would see it: n_q = n_new, n_k = the length after
  // the step (self) or n_k (cross).
  AttentionDims dims;
  StopCheck stop = nullptr;
  // A long step may be computed in pieces, one RunSteps call each, in order
  // (chunked prefill, so that other sessions' steps run between them):
  // `done_rows` rows of each example were computed by the calls before, and
  // this call computes the next `chunk_rows` (0: all the rest). Between
  // pieces the session holds the rows computed so far past its length, not
  // yet its own: a later piece's queries see them, length() grows by the
  // whole step with its last piece, and a piece that fails (or
  // AbandonStep()) gives every row of the step back. The caller advances
  // done_rows by chunk_rows after each piece answered OK, and passes the
  // same result to every piece: it gathers the outputs of all of them.
  int64_t done_rows = 0;
  int64_t chunk_rows = 0;
};

// Engine::RunSteps(steps, results) (engine.h) computes validated steps of
// one model (sessions opened on the same Model), as Run() does requests: one
// projection GEMM over the new rows of every step, then attention per
// session over its blocks in place. results[s] answers steps[s]: output
// (B, n_new, d_v or E), attention weights (B, H, n_new, n_k) if asked; its
// status is not OK when the step stopped (its StopCheck), the pool could
// not hold the step's rows (RESOURCE_EXHAUSTED naming the pool's capacity),
// the answer overflows float32 (INVALID_ARGUMENT, as Run() says), or the
// step cannot run with the others (FAILED_PRECONDITION: a second step of
// one session in the same call, or a session of another model), and then
// that session is as before the step while the others go on. A step in
// pieces takes the blocks of all its rows with its first piece (so a full
// pool refuses it before any work), and each later piece asks its StopCheck
// before it begins; results[s] is whole once its last piece is computed.

// INVALID_ARGUMENT naming the field (shape, batch, sizes, non-finite
// values, the request limits), or RESOURCE_EXHAUSTED when the step would take
// a self session past its max_length (naming it, the length and n_new).
// Elements and scratch are counted over the whole step; work over its
// costliest row (the last, which sees every key): a step is computed in
// pieces (ValidatedStep::chunk_rows), each of which the caller keeps within
// the work limit with ChunkRows().
absl::StatusOr<ValidatedStep> ValidateStep(Session& session, const SessionStep& step,
                                           const Limits& limits = {});

// Rows of the step's next piece, from done_rows on: the most whose work
// (RequestWork of the piece, less the projections of the rows held before
// it) is at most `max_work`, and at least one row; every remaining row when
// max_work <= 0. Pieces of one step so cut cost about the same work each:
// fewer rows as the keys before them grow.
int64_t ChunkRows(const ValidatedStep& step, double max_work);

// Whether `status` refused a step or an opening only because the pool was
// full then (and its Reclaim, if any, found nothing to end): the same step
// fits once sessions give blocks back. A session too large for the empty
// pool is refused RESOURCE_EXHAUSTED too, but not so.
bool PoolWasFull(const absl::Status& status);

// For a step given up between its pieces (its caller failed): gives back
// the rows its pieces appended, so the session is as before the step.
void AbandonStep(const ValidatedStep& step);

}  // namespace attention
