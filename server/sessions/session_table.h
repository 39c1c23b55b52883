// session_table.h: the server's decoding sessions (core/sessions/session.h), whatever
// API opened them: their one KvBlockPool (--session-memory-bytes), their
// count (--max-sessions), length (--max-session-length) and idle time
// (--session-idle-seconds), and their end.
//
// An AttendSession stream's session is anonymous (the stream holds its
// handle); an Open Inference Protocol sequence is keyed by model and
// sequence id (SequenceKey) so that later requests find it. A session keeps
// the ServedModel it opened with, so a reload never changes it. Steps run one
// at a time per session: BeginStep() marks it busy until EndStep(), and a
// session that ends meanwhile (closed, expired, shut down) frees its blocks
// only then, so the engine never reads freed memory. An ended session
// answers its next step with why it ended: ABORTED when it expired or was
// replaced, UNAVAILABLE when the server shut down or preempted it.
//
// Preemption (--session-preemption, as vLLM's preemption by recompute): when
// the pool is full, the blocks a new session or a step needs are taken from
// the session stepped least recently among those with no step queued or
// running, which ends with UNAVAILABLE; clients that keep their rows replay
// it (docs/api.md 11.6). A session whose step took blocks is kept for four
// times that step's time after it, so the memory does not go round faster
// than the prefills it costs. The pool asks for them (KvBlockPool::Reclaim) on
// the thread that needs the blocks, with no lock of the table held.
//
//   SessionTable table(options, limits, &metrics);
//   auto handle = table.Open("model", served, {.memory = SessionMemory::kSelf});
//   auto session = table.BeginStep(*handle);   // busy until EndStep
//   ... Dispatcher::SubmitStep ... table.EndStep(*handle, tokens);
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/engine/request.h"
#include "core/sessions/session.h"
#include "server/observability/metrics.h"
#include "server/repository/registry.h"

namespace attention::server {

// What an operator sets on sessions; the defaults are the documented ones
// (docs/api.md, "Sessions").
struct SessionOptions {
  // Bytes of keys and values all sessions hold together (--session-memory-bytes).
  int64_t memory_bytes = int64_t{1} << 30;
  // Sessions open at once, streams and sequences together (--max-sessions).
  int max_sessions = 1024;
  // Tokens one self-memory session holds per example; 0: no cap
  // (--max-session-length).
  int64_t max_length = 32768;
  // A session with no step for this long is freed; 0: never
  // (--session-idle-seconds).
  double idle_seconds = 300.0;
  // A full pool ends the least recently stepped idle session for the blocks
  // another needs, instead of refusing them (--session-preemption).
  bool preemption = true;
  // Sessions whose prompts begin alike share the blocks of its full blocks,
  // and blocks no session holds stay cached for a later prompt
  // (KvBlockPool's prefix sharing; off: --no-prefix-sharing).
  bool prefix_sharing = true;
  // What sessions hold their keys and values in, unless their model's file
  // says (--kv-cache-dtype; Model::kv_cache_dtype).
  KvDtype kv_dtype = KvDtype::kFloat32;
};

// Why a session ended: the `reason` label of attention_sessions_ended_total.
enum class SessionEnd { kClosed, kExpired, kReplaced, kFailed, kShutdown, kPreempted };
std::string_view SessionEndName(SessionEnd reason);

// The key of an Open Inference Protocol sequence: its model and its id.
// Integer and string ids are distinct (1 is not "1").
std::string SequenceKey(std::string_view model, int64_t id);
std::string SequenceKey(std::string_view model, std::string_view id);

class SessionTable {
 public:
  struct Entry;
  using Handle = std::shared_ptr<Entry>;
  // Called once, outside the table's lock, when the server ends the session
  // (kShutdown: EndAll; kPreempted: its blocks went to another session),
  // with why, so that a stream holding it can end too.
  using OnEnd = std::function<void(SessionEnd reason, const absl::Status& why)>;

  // `limits` bound a cross session's memory as they bound a request.
  // `metrics` is not owned and must outlive the table. Starts the thread
  // that frees idle sessions.
  SessionTable(SessionOptions options, Limits limits, ServerMetrics* metrics);
  // Ends every session and stops that thread.
  ~SessionTable();
  SessionTable(const SessionTable&) = delete;
  SessionTable& operator=(const SessionTable&) = delete;

  // Opens a session of `model` on `served`. `key`: empty for an anonymous
  // session, or a SequenceKey, which replaces an idle session of that key
  // (a step in flight: FAILED_PRECONDITION). RESOURCE_EXHAUSTED naming
  // --max-sessions or --session-memory-bytes; UNAVAILABLE once StopOpening()
  // ran; core's INVALID_ARGUMENT for an `open` the model cannot take.
  absl::StatusOr<Handle> Open(std::string_view model, const ServedModel& served,
                              SessionOpen open, std::string key = {}, OnEnd on_end = nullptr);
  // The open session of `key`; ABORTED when it expired lately, INVALID_ARGUMENT
  // when there is none (`what` names it in the message).
  absl::StatusOr<Handle> Find(std::string_view key, std::string_view what) const;

  // Marks the session busy for one step and gives it; why it ended, or
  // FAILED_PRECONDITION when a step is in flight.
  absl::StatusOr<Session*> BeginStep(const Handle& handle);
  // The step begun is answered; `tokens` (new rows of a step that
  // succeeded, else 0) are counted. Frees the session if it ended meanwhile.
  void EndStep(const Handle& handle, int64_t tokens);
  // Ends the session at its owner's request; a no-op if it ended already.
  void Close(const Handle& handle, SessionEnd reason);

  // Refuses new sessions from now on (the server drains).
  void StopOpening();
  // Ends every session with UNAVAILABLE (the server stops); returns how many
  // were open.
  int EndAll();
  // Ends the sessions idle since before `now` - idle_seconds. The table's
  // thread calls it; tests may too.
  void ExpireIdle(absl::Time now);

  // A step's answer as its client sees it: a RESOURCE_EXHAUSTED (the pool
  // full, a session at its length) names the flags that set the limits.
  absl::Status NameLimits(const absl::Status& status) const;

  int open_sessions() const;
  // Waits until no session is open, or until `deadline`; false on the
  // deadline.
  bool AwaitNoneOpen(absl::Time deadline) const;
  // Tokens the session holds per example (Session::length()); 0 once freed.
  int64_t Length(const Handle& handle) const;
  // Whether the session ended because its blocks went to another session.
  bool Preempted(const Handle& handle) const;
  const KvBlockPool& pool() const { return pool_; }
  const SessionOptions& options() const { return options_; }

  // The session's id (e.g. "s-17"), model and version; fixed at Open().
  static const std::string& Id(const Handle& handle);
  static const ServedModel& Served(const Handle& handle);

 private:
  // Ends `entry` under mu_: drops it from the table and frees it unless a
  // step is in flight (EndStep frees it then).
  void EndLocked(Handle entry, SessionEnd reason, absl::Status why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Remember(const std::string& key, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pool's Reclaim: ends the least recently stepped session that holds
  // blocks, has no step in flight and is past its kept time; false when
  // there is none, and then for kWantedFor every EndStep looks again and
  // preempts the session it can, whose blocks the waiting step takes.
  bool Preempt(const Session* asking);
  // When no session can be preempted and every one holding memory waits
  // for more (none can end its step until another gives memory back): the
  // least recently stepped of them, `asking` included when another waits
  // too, to preempt while it waits.
  Handle StuckLocked(const Session* asking) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The session Preempt() ends, if any.
  Handle VictimLocked(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends `victim` as preempted: why, and the OnEnd to call without mu_.
  OnEnd PreemptLocked(const Handle& victim, absl::Status* why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateGauges() const;
  void SweepLoop();

  const SessionOptions options_;
  const Limits limits_;
  ServerMetrics* const metrics_;  // not owned
  KvBlockPool pool_;

  mutable absl::Mutex mu_;
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool opening_ ABSL_GUARDED_BY(mu_) = true;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Every open session, by id (anonymous ones) or key (sequences).
  absl::flat_hash_map<std::string, Handle> open_ ABSL_GUARDED_BY(mu_);
  // Why recently ended sequences ended, so their next request is told; the
  // oldest forgotten beyond kRememberedEnds.
  absl::flat_hash_map<std::string, absl::Status> ended_ ABSL_GUARDED_BY(mu_);
  // Until when a step wants blocks no session could give it (Preempt).
  absl::Time wanted_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Sessions preempted while their step waited, not yet freed (EndStep).
  int preempted_busy_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::string> ended_order_ ABSL_GUARDED_BY(mu_);
  std::thread sweeper_;
};

}  // namespace attention::server
