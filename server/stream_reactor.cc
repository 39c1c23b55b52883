// stream_reactor.cc: the AttendStream reactor (see stream_reactor.h).
#include "server/stream_reactor.h"

#include <string>
#include <utility>

#include "server/auth.h"
#include "server/proto_adapter.h"
#include "spdlog/spdlog.h"

namespace attention::server {

AttentionService::StreamReactor::StreamReactor(AttentionService* service,
                                               grpc::CallbackServerContext* context)
    : service_(service), context_(context) {
  if (absl::Status auth = service_->Authenticate(*context);
      !auth.ok()) {
    spdlog::warn("AttendStream refused: peer={}: {}", context->peer(), std::string(auth.message()));
    Refuse(auth);
    return;
  }
  admitted_ = service_->AdmitCall();
  if (!admitted_) {
    Refuse(absl::UnavailableError("the server is shutting down and takes no new streams"));
    return;
  }
  Progress();
}

void AttentionService::StreamReactor::OnReadDone(bool ok) {
  Slot* slot = nullptr;
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (!ok) {
      reads_done_ = true;
      incoming_.reset();
    } else {
      slot = incoming_.get();
      slots_.push_back(std::move(incoming_));
    }
  }
  if (slot != nullptr) {
    service_->Submit(context_, slot->request,
                     [this, slot](const absl::Status& status, const AttentionResult* result) {
                       Answered(*slot, status, result);
                     });
  }
  Progress();
}

void AttentionService::StreamReactor::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    slots_.pop_front();
    if (!ok) broken_ = true;  // the client is gone; answers left are dropped
  }
  Progress();
}

void AttentionService::StreamReactor::OnCancel() {
  {
    absl::MutexLock lock(&mu_);
    broken_ = true;
  }
  Progress();
}

void AttentionService::StreamReactor::OnDone() {
  if (admitted_) service_->CallDone();
  delete this;
}

void AttentionService::StreamReactor::Refuse(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }
  service_->metrics_->CountRefusedStream(status.code());
  Finish(ToGrpcStatus(status));
}

void AttentionService::StreamReactor::Answered(Slot& slot, const absl::Status& status,
                                               const AttentionResult* result) {
  v1::AttendResponse& response = slot.response;
  if (status.ok()) {
    ToAttendResponse(*result, &response);
  } else {
    response.mutable_error()->set_code(static_cast<int32_t>(status.code()));
    response.mutable_error()->set_message(std::string(status.message()));
  }
  response.set_request_id(slot.request.request_id());
  response.set_model(slot.request.model());
  {
    absl::MutexLock lock(&mu_);
    slot.answered = true;
  }
  Progress();
}

void AttentionService::StreamReactor::Progress() {
  const v1::AttendResponse* write = nullptr;
  v1::AttendRequest* read = nullptr;
  bool finish = false;
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (!writing_) {
      while (broken_ && !slots_.empty() && slots_.front()->answered) slots_.pop_front();
      if (!broken_ && !slots_.empty() && slots_.front()->answered) {
        writing_ = true;
        write = &slots_.front()->response;
      }
    }
    if (!reading_ && !reads_done_ && !broken_ && slots_.size() < kMaxStreamInFlight) {
      reading_ = true;
      incoming_ = std::make_unique<Slot>();
      read = &incoming_->request;
    }
    if (!reading_ && !writing_ && slots_.empty() && (reads_done_ || broken_)) {
      finished_ = true;
      finish = true;
    }
  }
  if (write != nullptr) StartWrite(write);
  if (read != nullptr) StartRead(read);
  if (finish) Finish(grpc::Status::OK);
}

}  // namespace attention::server
