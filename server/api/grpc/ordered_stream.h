// ordered_stream.h: what AttendStream (attention_api.cc) and ModelStreamInfer
// (inference_api.cc) share: a bidirectional stream whose requests are
// read one after another and submitted as they come, so several can compute
// at once (at most kMaxStreamInFlight), and whose answers are written one at
// a time, in request order. A stream whose client is gone drops the answers
// left.
//
// Every decision is taken under mu_ and acted on after it is released (see
// Progress()). The lifetime rule: once Finish() is called nothing touches the
// reactor, because the subclass's OnDone() deletes it. gRPC runs OnDone only
// after every reaction (OnReadDone, OnWriteDone, OnCancel) has returned, but
// nothing holds it back for a call from another thread (Answered(),
// Withdrawn(), End() from a worker or the session table). So such a call
// changes the state in the same critical section that counts it acting, and
// Finish() is decided only by the last actor to leave.
#pragma once

#include <cstddef>
#include <deque>
#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"

namespace attention::server {

// Answers a stream holds at once (computing or waiting to be written); the
// stream stops reading beyond, so one stream cannot hoard server memory.
inline constexpr size_t kMaxStreamInFlight = 32;

// `Slot` holds one request of the stream and its answer: members
// `wire_request` and `wire_response` (grpc::ByteBuffer: the bytes read and
// the bytes to write; wire_message.h) and `bool answered`, which only this
// class touches.
template <typename Slot>
class OrderedStream : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  void OnReadDone(bool ok) override {
    Slot* slot = nullptr;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      // A stream finished by End() drops what its read in flight brought.
      if (!ok || finished_) {
        reads_done_ = true;
        incoming_.reset();
      } else {
        slot = incoming_.get();
        slots_.push_back(std::move(incoming_));
      }
    }
    if (slot != nullptr) Submit(*slot);
    Progress();
  }

  void OnWriteDone(bool ok) override {
    Progress([&] {
      writing_ = false;
      slots_.pop_front();
      if (!ok) broken_ = true;  // the client is gone; answers left are dropped
    });
  }

  void OnCancel() override {
    Progress([&] { broken_ = true; });
  }

 protected:
  // Starts computing `slot`'s request; once its `wire_response` is written,
  // the subclass calls Answered(slot).
  virtual void Submit(Slot& slot) = 0;

  void Answered(Slot& slot) {
    Progress([&] { slot.answered = true; });
  }

  // As Answered(), for a request that gets no answer of its own: its place
  // is skipped, and the status End() gives the stream stands for it (a step
  // of a session the server ended before the step began).
  void Withdrawn(Slot& slot) {
    Progress([&] {
      slot.answered = true;
      withdrawn_.insert(&slot);
    });
  }

  // Ends the call before it reads anything; only a stream's opening calls it.
  void Refuse(const grpc::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
    }
    this->Finish(status);
  }

  // Stops reading and finishes the call with `status` once the answers of
  // the requests read so far are written (a session the server ended).
  void End(const grpc::Status& status) {
    Progress([&] {
      ending_ = true;
      end_status_ = status;
    });
  }

  // Applies `change` to the state under mu_, then starts whatever the state
  // allows: the next write, the next read, or Finish() once every answer is
  // out and no other thread is acting on the reactor.
  void Progress(absl::FunctionRef<void()> change = [] {}) {
    const grpc::ByteBuffer* write = nullptr;
    grpc::ByteBuffer* read = nullptr;
    {
      absl::MutexLock lock(&mu_);
      change();
      if (finished_) return;
      ++acting_;
      if (!writing_) {
        while (!slots_.empty() && slots_.front()->answered &&
               (broken_ || withdrawn_.contains(slots_.front().get()))) {
          withdrawn_.erase(slots_.front().get());
          slots_.pop_front();
        }
        if (!broken_ && !slots_.empty() && slots_.front()->answered) {
          writing_ = true;
          write = &slots_.front()->wire_response;
        }
      }
      if (!reading_ && !reads_done_ && !broken_ && !ending_ &&
          slots_.size() < kMaxStreamInFlight) {
        reading_ = true;
        incoming_ = std::make_unique<Slot>();
        read = &incoming_->wire_request;
      }
    }
    if (write != nullptr) this->StartWrite(write);
    if (read != nullptr) this->StartRead(read);
    bool finish = false;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      --acting_;
      // An ending stream does not wait for its read in flight: its client
      // may be waiting for answers before it sends more.
      if (acting_ == 0 && (!reading_ || ending_) && !writing_ && slots_.empty() &&
          (reads_done_ || broken_ || ending_)) {
        finished_ = true;
        finish = true;
        status = ending_ && !broken_ ? end_status_ : grpc::Status::OK;
      }
    }
    if (finish) this->Finish(status);
  }

 private:
  absl::Mutex mu_;
  // Requests read, in order, until their answer is written; the front one is
  // the next to write.
  std::deque<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Slot> incoming_ ABSL_GUARDED_BY(mu_);  // target of the read in flight
  // Slots answered by Withdrawn(): nothing of theirs is written.
  absl::flat_hash_set<const Slot*> withdrawn_ ABSL_GUARDED_BY(mu_);
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;  // End() was called
  int acting_ ABSL_GUARDED_BY(mu_) = 0;       // Progress() calls between their two sections
  grpc::Status end_status_ ABSL_GUARDED_BY(mu_);
};

// Lets something outside a stream end it with End() (a session the server
// ended at shutdown or preempted, SessionTable::OnEnd) without reaching a reactor that is
// gone: the reactor calls Detach() in its OnDone, and the outside holds the
// link by std::weak_ptr. `Reactor` exposes End().
template <typename Reactor>
class StreamEndLink {
 public:
  explicit StreamEndLink(Reactor* reactor) : reactor_(reactor) {}
  void End(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    if (reactor_ != nullptr) reactor_->End(status);
  }
  void Detach() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }

 private:
  absl::Mutex mu_;
  Reactor* reactor_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::server
