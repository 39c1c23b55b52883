// absl_sync_annotations.cc: tells ThreadSanitizer about Debian's absl::Mutex,
// absl::CondVar and absl::Notification, and about the hand-overs of gRPC
// batches and callbacks that happen inside libgrpc and libgrpc++ (see the end).
//
// Debian ships Abseil (and gRPC, which locks with absl::Mutex) built without
// -fsanitize=thread. TSan then sees our accesses under an absl::MutexLock but
// not the lock's acquire and release (they happen in uninstrumented code), so
// every mutex-guarded field of the batcher and the service would be reported
// as a race. Suppressing those reports would hide our real races too, so
// instead this library, LD_PRELOADed by scripts/sanitize.sh, interposes the
// public entry points of those classes: each calls the real one (found with
// dlsym(RTLD_NEXT)) and adds the happens-before edge it implies with
// __tsan_acquire / __tsan_release on the object's address, as Abseil's own
// TSan annotations would. Reader locks are treated as exclusive, which can
// only hide a race between two readers.
//
// absl::Condition functions run inside the library, at moments no wrapper
// sees: the waiting thread evaluates its own after waking, and an unlocking
// thread evaluates the waiters' before it hands the mutex on. Condition::Eval
// is interposed too: while a wrapper of mutex M runs on a thread, each
// evaluation there is bracketed by acquire(M) and release(M), which is what
// holding M at that moment means.
//
// The __tsan_* functions are weak: in a process without TSan (a shell or
// Python test run under the same LD_PRELOAD) every wrapper is a plain call.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpc/grpc.h"
#include "grpcpp/support/server_callback.h"

extern "C" {
void __tsan_acquire(void* addr) __attribute__((weak));
void __tsan_release(void* addr) __attribute__((weak));
}

namespace {

void Acquire(const void* addr) {
  if (__tsan_acquire != nullptr) __tsan_acquire(const_cast<void*>(addr));
}
void Release(const void* addr) {
  if (__tsan_release != nullptr) __tsan_release(const_cast<void*>(addr));
}

// The address of a non-virtual member function (Itanium ABI: the first word
// of the pointer to member), to look up its mangled name with dladdr.
template <typename MemberFunction>
void* AddressOf(MemberFunction function) {
  void* address;
  static_assert(sizeof(function) >= sizeof(address));
  std::memcpy(&address, &function, sizeof(address));
  return address;
}

// The next definition of the symbol that `ours` (a wrapper below) defines:
// the real one in libabsl_synchronization.so.
template <typename Real, typename MemberFunction>
Real Next(MemberFunction ours) {
  Dl_info info;
  if (dladdr(AddressOf(ours), &info) == 0 || info.dli_sname == nullptr) {
    std::fprintf(stderr, "absl_sync_annotations: cannot name a wrapper\n");
    std::abort();
  }
  void* next = dlsym(RTLD_NEXT, info.dli_sname);
  if (next == nullptr) {
    std::fprintf(stderr, "absl_sync_annotations: %s not found after this library\n",
                 info.dli_sname);
    std::abort();
  }
  return reinterpret_cast<Real>(next);
}

// absl::Notification's layout (absl/synchronization/notification.h): the
// inline HasBeenNotified() reads notified_yet_ with an acquire load, so
// Notify() must release that address too.
struct NotificationLayout {
  absl::Mutex mutex;
  std::atomic<bool> notified_yet;
};
static_assert(sizeof(NotificationLayout) == sizeof(absl::Notification));

// The mutex whose wrapper is running on this thread (null outside them).
thread_local const void* current_mutex = nullptr;

// Sets current_mutex for the lifetime of a wrapper.
class CurrentMutex {
 public:
  explicit CurrentMutex(const void* mutex) : previous_(current_mutex) { current_mutex = mutex; }
  ~CurrentMutex() { current_mutex = previous_; }
  CurrentMutex(const CurrentMutex&) = delete;
  CurrentMutex& operator=(const CurrentMutex&) = delete;

 private:
  const void* previous_;
};

}  // namespace

// `real`: the definition of Class::name that the wrapper around it replaces.
#define REAL_MEMBER(Return, Class, name, ...) \
  static const auto real = Next<Return (*)(__VA_ARGS__)>(&Class::name)

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  REAL_MEMBER(void, Mutex, Lock, Mutex*);
  real(this);
  Acquire(this);
}

void Mutex::ReaderLock() {
  REAL_MEMBER(void, Mutex, ReaderLock, Mutex*);
  real(this);
  Acquire(this);
}

bool Mutex::TryLock() {
  REAL_MEMBER(bool, Mutex, TryLock, Mutex*);
  const bool locked = real(this);
  if (locked) Acquire(this);
  return locked;
}

bool Mutex::ReaderTryLock() {
  REAL_MEMBER(bool, Mutex, ReaderTryLock, Mutex*);
  const bool locked = real(this);
  if (locked) Acquire(this);
  return locked;
}

void Mutex::Unlock() {
  REAL_MEMBER(void, Mutex, Unlock, Mutex*);
  CurrentMutex current(this);
  Release(this);
  real(this);
}

void Mutex::ReaderUnlock() {
  REAL_MEMBER(void, Mutex, ReaderUnlock, Mutex*);
  CurrentMutex current(this);
  Release(this);
  real(this);
}

void Mutex::LockWhen(const Condition& condition) {
  REAL_MEMBER(void, Mutex, LockWhen, Mutex*, const Condition&);
  CurrentMutex current(this);
  real(this, condition);
  Acquire(this);
}

void Mutex::ReaderLockWhen(const Condition& condition) {
  REAL_MEMBER(void, Mutex, ReaderLockWhen, Mutex*, const Condition&);
  CurrentMutex current(this);
  real(this, condition);
  Acquire(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& condition, absl::Duration timeout) {
  REAL_MEMBER(bool, Mutex, LockWhenWithTimeout, Mutex*, const Condition&, absl::Duration);
  CurrentMutex current(this);
  const bool result = real(this, condition, timeout);
  Acquire(this);  // held on return either way
  return result;
}

bool Mutex::LockWhenWithDeadline(const Condition& condition, absl::Time deadline) {
  REAL_MEMBER(bool, Mutex, LockWhenWithDeadline, Mutex*, const Condition&, absl::Time);
  CurrentMutex current(this);
  const bool result = real(this, condition, deadline);
  Acquire(this);
  return result;
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& condition, absl::Duration timeout) {
  REAL_MEMBER(bool, Mutex, ReaderLockWhenWithTimeout, Mutex*, const Condition&,
                 absl::Duration);
  CurrentMutex current(this);
  const bool result = real(this, condition, timeout);
  Acquire(this);
  return result;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& condition, absl::Time deadline) {
  REAL_MEMBER(bool, Mutex, ReaderLockWhenWithDeadline, Mutex*, const Condition&, absl::Time);
  CurrentMutex current(this);
  const bool result = real(this, condition, deadline);
  Acquire(this);
  return result;
}

// Await* release the mutex while they wait and hold it again on return.
void Mutex::Await(const Condition& condition) {
  REAL_MEMBER(void, Mutex, Await, Mutex*, const Condition&);
  CurrentMutex current(this);
  Release(this);
  real(this, condition);
  Acquire(this);
}

bool Mutex::AwaitWithTimeout(const Condition& condition, absl::Duration timeout) {
  REAL_MEMBER(bool, Mutex, AwaitWithTimeout, Mutex*, const Condition&, absl::Duration);
  CurrentMutex current(this);
  Release(this);
  const bool result = real(this, condition, timeout);
  Acquire(this);
  return result;
}

bool Mutex::AwaitWithDeadline(const Condition& condition, absl::Time deadline) {
  REAL_MEMBER(bool, Mutex, AwaitWithDeadline, Mutex*, const Condition&, absl::Time);
  CurrentMutex current(this);
  Release(this);
  const bool result = real(this, condition, deadline);
  Acquire(this);
  return result;
}

// CondVar waits release `mutex` and hold it again on return.
void CondVar::Wait(Mutex* mutex) {
  REAL_MEMBER(void, CondVar, Wait, CondVar*, Mutex*);
  CurrentMutex current(mutex);
  Release(mutex);
  real(this, mutex);
  Acquire(mutex);
}

bool CondVar::WaitWithTimeout(Mutex* mutex, absl::Duration timeout) {
  REAL_MEMBER(bool, CondVar, WaitWithTimeout, CondVar*, Mutex*, absl::Duration);
  CurrentMutex current(mutex);
  Release(mutex);
  const bool result = real(this, mutex, timeout);
  Acquire(mutex);
  return result;
}

bool CondVar::WaitWithDeadline(Mutex* mutex, absl::Time deadline) {
  REAL_MEMBER(bool, CondVar, WaitWithDeadline, CondVar*, Mutex*, absl::Time);
  CurrentMutex current(mutex);
  Release(mutex);
  const bool result = real(this, mutex, deadline);
  Acquire(mutex);
  return result;
}

bool Condition::Eval() const {
  REAL_MEMBER(bool, Condition, Eval, const Condition*);
  const void* mutex = current_mutex;
  if (mutex != nullptr) Acquire(mutex);
  const bool holds = real(this);
  if (mutex != nullptr) Release(mutex);
  return holds;
}

void Notification::Notify() {
  REAL_MEMBER(void, Notification, Notify, Notification*);
  Release(this);
  Release(&reinterpret_cast<NotificationLayout*>(this)->notified_yet);
  real(this);
}

void Notification::WaitForNotification() const {
  REAL_MEMBER(void, Notification, WaitForNotification, const Notification*);
  real(this);
  Acquire(this);
}

bool Notification::WaitForNotificationWithTimeout(absl::Duration timeout) const {
  REAL_MEMBER(bool, Notification, WaitForNotificationWithTimeout, const Notification*,
                 absl::Duration);
  const bool notified = real(this, timeout);
  if (notified) Acquire(this);
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  REAL_MEMBER(bool, Notification, WaitForNotificationWithDeadline, const Notification*,
                 absl::Time);
  const bool notified = real(this, deadline);
  if (notified) Acquire(this);
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl

// gRPC's server callback API counts down, per call, what must happen before
// OnDone (the handler's return, Finish, the completion op, each reaction to a
// read, a write or a cancellation): ServerCallbackCall::callbacks_outstanding_,
// decremented with acq_rel by MaybeDone(). The thread that takes it to zero
// calls ScheduleOnDone(), which runs CallOnDone() (OnDone, then the call's
// cleanup) inline or on an executor thread. MaybeDone() is inline: the copies
// in our binary are instrumented, but the one in libgrpc++'s CallOnCancel
// closure (src/cpp/server/server_callback.cc: reactor->OnCancel(), then
// MaybeDone()) is not, so TSan sees neither its release nor its acquire.
//
// Without its acquire, the fault_cancel_test server reported six races
// between CallbackWithSuccessTag::Run of the finish and completion-op tags on
// one thread and CallOnDone's cleanup of ServerCallbackReaderWriterImpl on an
// executor thread: all gRPC's accesses. Only the thread that made the last
// decrement calls ScheduleOnDone(), right after it, so acquiring the counter
// there is exactly the acquire TSan missed.
//
// Without its release, the same server reported AdmittedStream::OnDone's
// `delete this` on an executor thread racing with OrderedStream::OnCancel
// and Progress() on the thread of that closure, when another thread made the
// last decrement. CallOnCancel is therefore wrapped too: the closure calls
// OnCancel on a stand-in that forwards to the real reactor and then releases
// the counter, just before the closure's decrement.
namespace {

class CountReleasingReactor final : public grpc::internal::ServerReactor {
 public:
  CountReleasingReactor(grpc::internal::ServerReactor* reactor, const void* count)
      : reactor_(reactor), count_(count) {}

  // CallOnCancel calls OnCancel exactly once, and nothing else after it.
  void OnCancel() override {
    reactor_->OnCancel();
    Release(count_);
    delete this;
  }
  void OnDone() override { reactor_->OnDone(); }
  bool InternalInlineable() override { return reactor_->InternalInlineable(); }

 private:
  grpc::internal::ServerReactor* const reactor_;
  const void* const count_;
};

}  // namespace

namespace grpc::internal {

void ServerCallbackCall::ScheduleOnDone(bool inline_ondone) {
  REAL_MEMBER(void, ServerCallbackCall, ScheduleOnDone, ServerCallbackCall*, bool);
  Acquire(&callbacks_outstanding_);
  real(this, inline_ondone);
}

void ServerCallbackCall::CallOnCancel(ServerReactor* reactor) {
  REAL_MEMBER(void, ServerCallbackCall, CallOnCancel, ServerCallbackCall*, ServerReactor*);
  real(this, new CountReleasingReactor(reactor, &callbacks_outstanding_));
}

}  // namespace grpc::internal

// A batch of call operations is handed over inside libgrpc: everything a
// thread did before grpc_call_start_batch (filling the CallOpSet, arming its
// tag, serialising the message to write, allocating the one a read fills)
// happens before the batch's tag is run. The tag reaches the thread that runs
// it either straight from grpc_cq_end_op (a callback completion queue: run
// there, or handed on through the executor's absl::Mutex), or through a
// completion queue that a thread drains with grpc_completion_queue_next or
// _pluck: libgrpc++'s "nexting_thread"s, which run the server's callbacks
// when gRPC has no background poller, and blocking client calls. That queue
// is lock-free inside libgrpc, which TSan cannot see, so with only the
// absl::Mutex annotations it reported, in the server: CallOpSet<CallOpRecv
// Message<AttendRequest>>::FinalizeResult on a nexting thread parsing into
// the request that OrderedStream::Progress had allocated and lent to
// StartRead on a batcher thread; CallOpSet<CallOpSendInitialMetadata,
// CallOpSendMessage>::FinalizeResult against the FillOps and serialisation of
// the Write that started the batch; OnWriteDone destroying a response that a
// batcher thread had serialised; CallbackWithSuccessTag::Run against
// CallbackWithSuccessTag::Set in ServerCallbackUnaryImpl::Finish; and in the
// overload_test client, CallOpClientRecvStatus::FinishOp copying a status
// message that the completing gRPC thread had built. Releasing the tag when
// the batch starts and where it completes, and acquiring it where it is
// taken out, states that ordering. grpc_cq_end_op is gRPC's internal function, called
// through libgrpc's PLT; its declaration (src/core/lib/surface/
// completion_queue.h) is restated here.
struct grpc_cq_completion;

void grpc_cq_end_op(grpc_completion_queue* cq, void* tag, absl::Status error,
                    void (*done)(void* done_arg, grpc_cq_completion* storage), void* done_arg,
                    grpc_cq_completion* storage, bool internal);

namespace {

template <typename Function>
Function NextFunction(const char* name) {
  void* next = dlsym(RTLD_NEXT, name);
  if (next == nullptr) {
    std::fprintf(stderr, "absl_sync_annotations: %s not found after this library\n", name);
    std::abort();
  }
  return reinterpret_cast<Function>(next);
}

void AcquireCompleted(const grpc_event& event) {
  if (event.type == GRPC_OP_COMPLETE) Acquire(event.tag);
}

}  // namespace

extern "C" grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops,
                                                 void* tag, void* reserved) {
  static const auto real = NextFunction<decltype(&grpc_call_start_batch)>("grpc_call_start_batch");
  Release(tag);
  return real(call, ops, nops, tag, reserved);
}

void grpc_cq_end_op(grpc_completion_queue* cq, void* tag, absl::Status error,
                    void (*done)(void* done_arg, grpc_cq_completion* storage), void* done_arg,
                    grpc_cq_completion* storage, bool internal) {
  static const auto real = NextFunction<decltype(&grpc_cq_end_op)>(
      "_Z14grpc_cq_end_opP21grpc_completion_queuePvN4absl7debian36StatusEPFvS1_P18grpc_cq_"
      "completionES1_S6_b");
  // What the batch's start did, for a tag run on this thread; then what this
  // thread did to complete it (a status, a message received), for the thread
  // that runs the tag.
  Acquire(tag);
  Release(tag);
  real(cq, tag, std::move(error), done, done_arg, storage, internal);
}

extern "C" grpc_event grpc_completion_queue_next(grpc_completion_queue* cq, gpr_timespec deadline,
                                                 void* reserved) {
  static const auto real =
      NextFunction<decltype(&grpc_completion_queue_next)>("grpc_completion_queue_next");
  const grpc_event event = real(cq, deadline, reserved);
  AcquireCompleted(event);
  return event;
}

extern "C" grpc_event grpc_completion_queue_pluck(grpc_completion_queue* cq, void* tag,
                                                  gpr_timespec deadline, void* reserved) {
  static const auto real =
      NextFunction<decltype(&grpc_completion_queue_pluck)>("grpc_completion_queue_pluck");
  const grpc_event event = real(cq, tag, deadline, reserved);
  AcquireCompleted(event);
  return event;
}
