// session_table.cc: opening, stepping, ending and expiring sessions.
#include "server/sessions/session_table.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/thread_name.h"

namespace attention::server {
namespace {

// Ended sequences whose end is remembered for their next request; beyond
// it the oldest are forgotten, so no client can grow the table.
constexpr size_t kRememberedEnds = 4096;

// The sweeper wakes this often at most, so expiry is late by at most this.
constexpr absl::Duration kLongestSweepPause = absl::Seconds(1);

// A session whose step took blocks is not preempted for this many times
// that step's time after it (a prefill's, a replay's): what preemption
// costs, the step again, stays within a fifth of a session's time in the
// pool, however many sessions want the memory.
constexpr int kResidencyPerStepTime = 4;

// After the pool found no session to preempt, every step that ends within
// this long looks again (EndStep) and preempts the session it can: a step
// waiting for blocks retries only with its model's next batch, by when the
// sessions just answered have mostly sent their next step (busy again), so
// the end of their step is when they can be taken.
constexpr absl::Duration kWantedFor = absl::Milliseconds(50);

absl::Status WhyEnded(SessionEnd reason, const std::string& id, double idle_seconds) {
  switch (reason) {
    case SessionEnd::kPreempted:
      return absl::UnavailableError(absl::StrCat(
          "session ", id, " was preempted: the server's session memory (--session-memory-bytes) "
          "was full and its blocks went to another session; its keys and values are gone: open "
          "it again and send its rows as one step"));
    case SessionEnd::kExpired:
      return absl::AbortedError(absl::StrCat("session ", id, " expired after ", idle_seconds,
                                             " s without a step (--session-idle-seconds); its "
                                             "keys and values are gone: open a new session"));
    case SessionEnd::kReplaced:
      return absl::AbortedError(
          absl::StrCat("session ", id, " was replaced by a new sequence_start of its id"));
    case SessionEnd::kShutdown:
      return absl::UnavailableError(absl::StrCat(
          "the server shut down; session ", id, " and its keys and values are gone"));
    case SessionEnd::kClosed:
    case SessionEnd::kFailed:
      break;
  }
  return absl::FailedPreconditionError(absl::StrCat("session ", id, " has ended"));
}

}  // namespace

struct SessionTable::Entry {
  std::string id;   // "s-<n>"
  std::string key;  // open_'s key: the SequenceKey, or the id
  std::string model;
  ServerMetrics::SessionCounters counters;  // its model's steps and tokens
  ServedModel served;
  std::unique_ptr<Session> session;  // null once freed
  OnEnd on_end;
  absl::Time last_step;
  // The step in flight: when it began, and the bytes held before it.
  absl::Time step_began;
  // When the pool last found no room for its step (Preempt): the step's
  // time for kResidencyPerStepTime is counted from then, not its wait.
  absl::Time refused_at = absl::InfinitePast();
  int64_t held_before_step = 0;
  // Not preempted before then (kResidencyPerStepTime).
  absl::Time kept_until = absl::InfinitePast();
  bool busy = false;
  // Preempted while its step waited for the pool: freed at EndStep.
  bool preempted_busy = false;
  absl::Status ended;  // OK while open
  SessionEnd end_reason = SessionEnd::kClosed;  // once ended
};

std::string_view SessionEndName(SessionEnd reason) {
  switch (reason) {
    case SessionEnd::kClosed:
      return "closed";
    case SessionEnd::kExpired:
      return "expired";
    case SessionEnd::kReplaced:
      return "replaced";
    case SessionEnd::kFailed:
      return "failed";
    case SessionEnd::kShutdown:
      return "shutdown";
    case SessionEnd::kPreempted:
      return "preempted";
  }
  return "closed";
}

// The model name and the id are joined by a byte no name holds.
std::string SequenceKey(std::string_view model, int64_t id) {
  return absl::StrCat(std::string(model), "\n#", id);
}
std::string SequenceKey(std::string_view model, std::string_view id) {
  return absl::StrCat(std::string(model), "\n'", std::string(id));
}

SessionTable::SessionTable(SessionOptions options, Limits limits, ServerMetrics* metrics)
    : options_(options),
      limits_(limits),
      metrics_(metrics),
      // The pool asks again while the bytes do not fit, so one session a call.
      pool_(options.memory_bytes,
            options.preemption ? KvBlockPool::Reclaim([this](const Session* asking, int64_t) {
              return Preempt(asking);
            })
                               : nullptr,
            options.prefix_sharing) {
  UpdateGauges();
  sweeper_ = std::thread([this] {
    NameCurrentThread("session-sweep");
    SweepLoop();
  });
}

SessionTable::~SessionTable() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  sweeper_.join();
  EndAll();
}

absl::StatusOr<SessionTable::Handle> SessionTable::Open(std::string_view model,
                                                        const ServedModel& served,
                                                        SessionOpen open, std::string key,
                                                        OnEnd on_end) {
  {
    absl::MutexLock lock(&mu_);
    if (!opening_) {
      return absl::UnavailableError("the server is shutting down and opens no new sessions");
    }
    auto existing = key.empty() ? open_.end() : open_.find(key);
    if (existing != open_.end() && existing->second->busy) {
      return absl::FailedPreconditionError(
          "sequence_start: a request of this sequence is still being computed; send a "
          "sequence's requests one after another");
    }
    const size_t others = open_.size() - (existing != open_.end() ? 1 : 0);
    if (static_cast<int64_t>(others) >= options_.max_sessions) {
      return absl::ResourceExhaustedError(
          absl::StrCat("--max-sessions ", options_.max_sessions,
                       " sessions are open; close one or retry later"));
    }
    if (existing != open_.end()) {
      EndLocked(existing->second, SessionEnd::kReplaced,
                WhyEnded(SessionEnd::kReplaced, existing->second->id, 0));
    }
  }
  open.max_length = options_.max_length;
  open.kv_dtype = served.model->kv_cache_dtype.value_or(options_.kv_dtype);
  absl::StatusOr<std::unique_ptr<Session>> session =
      Session::Open(served.model, pool_, open, limits_);
  if (!session.ok()) return NameLimits(session.status());
  auto entry = std::make_shared<Entry>();
  entry->model = std::string(model);
  entry->counters = metrics_->SessionCountersFor(model);
  entry->served = served;
  entry->session = *std::move(session);
  entry->on_end = std::move(on_end);
  entry->last_step = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    // Checked again: other opens may have raced this one's projection.
    if (!opening_ || static_cast<int64_t>(open_.size()) >= options_.max_sessions ||
        (!key.empty() && open_.contains(key))) {
      return absl::ResourceExhaustedError(
          absl::StrCat("--max-sessions ", options_.max_sessions,
                       " sessions are open (or the sequence was opened meanwhile); retry"));
    }
    entry->id = absl::StrCat("s-", next_id_++);
    entry->key = key.empty() ? entry->id : std::move(key);
    ended_.erase(entry->key);
    open_.emplace(entry->key, entry);
  }
  metrics_->CountSessionOpened(entry->model);
  UpdateGauges();
  return entry;
}

absl::StatusOr<SessionTable::Handle> SessionTable::Find(std::string_view key,
                                                        std::string_view what) const {
  const absl::string_view k(key.data(), key.size());
  absl::MutexLock lock(&mu_);
  if (auto it = open_.find(k); it != open_.end()) return it->second;
  if (auto it = ended_.find(k); it != ended_.end()) return it->second;
  return absl::InvalidArgumentError(absl::StrCat(
      std::string(what),
      " names no open sequence of this model: its first request needs sequence_start (behind "
      "a load balancer of several replicas, send every request of the sequence with the header "
      "attention-sequence-id: <sequence id>, so that all reach the replica holding it)"));
}

absl::StatusOr<Session*> SessionTable::BeginStep(const Handle& handle) {
  absl::MutexLock lock(&mu_);
  if (!handle->ended.ok()) return handle->ended;
  if (handle->busy) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session ", handle->id,
        ": a step is still being computed; send a session's steps one after another"));
  }
  handle->busy = true;
  handle->step_began = absl::Now();
  handle->held_before_step = handle->session->held_bytes();
  return handle->session.get();
}

void SessionTable::EndStep(const Handle& handle, int64_t tokens) {
  bool freed = false;
  OnEnd on_end;
  absl::Status why;
  bool preempted = false;
  {
    absl::MutexLock lock(&mu_);
    handle->busy = false;
    handle->last_step = absl::Now();
    if (!handle->ended.ok() && handle->session != nullptr) {
      handle->session.reset();
      freed = true;
      if (std::exchange(handle->preempted_busy, false)) --preempted_busy_;
    } else if (handle->session != nullptr &&
               handle->session->held_bytes() > handle->held_before_step) {
      const absl::Time began = std::max(handle->step_began, handle->refused_at);
      handle->kept_until = handle->last_step + kResidencyPerStepTime * (handle->last_step - began);
    }
    if (handle->last_step < wanted_until_) {
      if (Handle victim = VictimLocked(handle->last_step); victim != nullptr) {
        wanted_until_ = absl::InfinitePast();
        on_end = PreemptLocked(victim, &why);
        preempted = true;
      }
    }
  }
  if (on_end) on_end(SessionEnd::kPreempted, why);
  if (tokens > 0) {
    handle->counters.steps->Increment();
    handle->counters.tokens->Increment(static_cast<double>(tokens));
  }
  if (freed || tokens > 0 || preempted) UpdateGauges();
}

void SessionTable::Close(const Handle& handle, SessionEnd reason) {
  {
    absl::MutexLock lock(&mu_);
    handle->on_end = nullptr;
    if (!handle->ended.ok()) return;
    EndLocked(handle, reason, WhyEnded(reason, handle->id, 0));
  }
  UpdateGauges();
}

void SessionTable::EndLocked(Handle entry, SessionEnd reason, absl::Status why) {
  entry->ended = std::move(why);
  entry->end_reason = reason;
  open_.erase(entry->key);
  // A sequence the server ended tells its next request why; one its client
  // ended is simply unknown again.
  const bool told = reason != SessionEnd::kClosed && reason != SessionEnd::kFailed;
  if (entry->key != entry->id && told) Remember(entry->key, entry->ended);
  if (!entry->busy) entry->session.reset();
  metrics_->CountSessionEnd(SessionEndName(reason));
}

void SessionTable::Remember(const std::string& key, absl::Status why) {
  if (ended_.insert_or_assign(key, std::move(why)).second) ended_order_.push_back(key);
  while (ended_order_.size() > kRememberedEnds) {
    ended_.erase(ended_order_.front());
    ended_order_.pop_front();
  }
}

void SessionTable::StopOpening() {
  absl::MutexLock lock(&mu_);
  opening_ = false;
}

SessionTable::Handle SessionTable::VictimLocked(absl::Time now) const {
  // A busy session's blocks are the engine's until EndStep: neither its
  // held bytes nor its end are touched here.
  Handle victim;
  for (const auto& [key, entry] : open_) {
    if (entry->busy || entry->session == nullptr || now < entry->kept_until ||
        entry->session->held_bytes() == 0) {
      continue;
    }
    if (victim == nullptr || entry->last_step < victim->last_step) victim = entry;
  }
  return victim;
}

SessionTable::OnEnd SessionTable::PreemptLocked(const Handle& victim, absl::Status* why) {
  *why = WhyEnded(SessionEnd::kPreempted, victim->id, 0);
  EndLocked(victim, SessionEnd::kPreempted, *why);
  return std::exchange(victim->on_end, nullptr);
}

bool SessionTable::Preempt(const Session* asking) {
  OnEnd on_end;
  absl::Status why;
  bool freed = false;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    if (asking != nullptr) {
      for (const auto& [key, entry] : open_) {
        if (entry->session.get() == asking) entry->refused_at = now;
      }
    }
    Handle victim = VictimLocked(now);
    if (victim == nullptr) {
      wanted_until_ = now + kWantedFor;
      victim = StuckLocked(asking);
      if (victim == nullptr) return false;
      // Its blocks come back once its waiting step is answered (EndStep):
      // the steps asking wait for them.
      on_end = PreemptLocked(victim, &why);
      victim->session->MarkEnded(why);
      victim->preempted_busy = true;
      ++preempted_busy_;
    } else {
      on_end = PreemptLocked(victim, &why);
      freed = true;
    }
  }
  if (on_end) on_end(SessionEnd::kPreempted, why);
  UpdateGauges();
  return freed;
}

SessionTable::Handle SessionTable::StuckLocked(const Session* asking) const {
  if (preempted_busy_ > 0) return nullptr;  // one already gives its blocks back
  Handle stuck;
  bool others_wait = false;
  for (const auto& [key, entry] : open_) {
    // A busy session holds what it held before its step until the step
    // takes blocks; a waiting one took none.
    const bool holds = entry->busy ? entry->held_before_step > 0
                                   : entry->session != nullptr && entry->session->held_bytes() > 0;
    if (!holds) continue;
    const bool waiting = entry->busy && entry->refused_at >= entry->step_began;
    if (!waiting) return nullptr;  // its step ends, or it is kept for a while
    // The one asking is a candidate too, so that which of them is preempted
    // does not depend on which asked last.
    if (entry->session.get() != asking) others_wait = true;
    if (stuck == nullptr || entry->last_step < stuck->last_step) stuck = entry;
  }
  // Never preempted for itself alone.
  return others_wait ? stuck : nullptr;
}

int SessionTable::EndAll() {
  std::vector<std::pair<OnEnd, absl::Status>> to_call;
  int ended = 0;
  {
    absl::MutexLock lock(&mu_);
    opening_ = false;
    std::vector<Handle> open;
    for (auto& [key, handle] : open_) open.push_back(handle);
    for (const Handle& handle : open) {
      absl::Status why = WhyEnded(SessionEnd::kShutdown, handle->id, 0);
      if (handle->on_end) to_call.emplace_back(std::exchange(handle->on_end, nullptr), why);
      EndLocked(handle, SessionEnd::kShutdown, std::move(why));
      ++ended;
    }
  }
  for (auto& [on_end, why] : to_call) on_end(SessionEnd::kShutdown, why);
  UpdateGauges();
  return ended;
}

void SessionTable::ExpireIdle(absl::Time now) {
  if (options_.idle_seconds <= 0) return;
  const absl::Time idle_since = now - absl::Seconds(options_.idle_seconds);
  {
    absl::MutexLock lock(&mu_);
    std::vector<Handle> idle;
    for (auto& [key, handle] : open_) {
      if (!handle->busy && handle->last_step < idle_since) idle.push_back(handle);
    }
    for (const Handle& handle : idle) {
      EndLocked(handle, SessionEnd::kExpired,
                WhyEnded(SessionEnd::kExpired, handle->id, options_.idle_seconds));
    }
    if (idle.empty()) return;
  }
  UpdateGauges();
}

absl::Status SessionTable::NameLimits(const absl::Status& status) const {
  if (status.code() != absl::StatusCode::kResourceExhausted) return status;
  return absl::ResourceExhaustedError(absl::StrCat(
      status.message(), " (the server's --session-memory-bytes ", options_.memory_bytes,
      ", --max-session-length ", options_.max_length, ")"));
}

int SessionTable::open_sessions() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(open_.size());
}

bool SessionTable::AwaitNoneOpen(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return open_.empty(); };
  return mu_.AwaitWithDeadline(absl::Condition(&none), deadline);
}

int64_t SessionTable::Length(const Handle& handle) const {
  absl::MutexLock lock(&mu_);
  return handle->session != nullptr ? handle->session->length() : 0;
}

bool SessionTable::Preempted(const Handle& handle) const {
  absl::MutexLock lock(&mu_);
  return !handle->ended.ok() && handle->end_reason == SessionEnd::kPreempted;
}

const std::string& SessionTable::Id(const Handle& handle) { return handle->id; }
const ServedModel& SessionTable::Served(const Handle& handle) { return handle->served; }

void SessionTable::UpdateGauges() const {
  metrics_->SetSessionGauges(open_sessions(), pool_.used_bytes(), pool_.capacity_bytes());
  const KvBlockPool::PrefixStats prefix = pool_.prefix_stats();
  metrics_->SetSessionPrefixStats(prefix.shared_bytes, prefix.cached_bytes, prefix.query_tokens,
                                  prefix.hit_tokens);
}

void SessionTable::SweepLoop() {
  const absl::Duration pause =
      options_.idle_seconds > 0
          ? std::min(kLongestSweepPause, absl::Seconds(options_.idle_seconds) / 4)
          : kLongestSweepPause;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), pause)) return;
    }
    ExpireIdle(absl::Now());
  }
}

}  // namespace attention::server
