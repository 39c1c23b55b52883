// batcher_test.cc: the Batcher alone, with a fake clock that only the test
// moves, so "the batch waits for its delay" is checked without timing.
#include "server/dispatch/batcher.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attention::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Pair;

// Time stands still until Advance(). Lock-free reads, because Now() is called
// from inside absl::Condition evaluation.
class FakeClock final : public BatcherClock {
 public:
  absl::Time Now() override { return absl::UnixEpoch() + absl::Microseconds(now_us_.load()); }

  void AwaitWithDeadline(absl::Mutex& mu, const absl::Condition& condition,
                         absl::Time deadline) override {
    waiter_mu_.store(&mu);
    struct Wait {
      FakeClock* clock;
      const absl::Condition* condition;
      absl::Time deadline;
    } wait{this, &condition, deadline};
    mu.Await(absl::Condition(
        +[](Wait* w) { return w->condition->Eval() || w->clock->Now() >= w->deadline; }, &wait));
  }

  void Advance(absl::Duration d) {
    now_us_.fetch_add(absl::ToInt64Microseconds(d));
    // A waiter's condition is re-evaluated when its mutex is released.
    if (absl::Mutex* mu = waiter_mu_.load()) {
      mu->Lock();
      mu->Unlock();
    }
  }

 private:
  std::atomic<int64_t> now_us_{0};
  std::atomic<absl::Mutex*> waiter_mu_{nullptr};
};

struct TestTask {
  explicit TestTask(int id, absl::Time deadline = absl::InfiniteFuture())
      : id(id), deadline_(deadline) {}
  absl::Time deadline() const { return deadline_; }
  bool cancelled() const { return cancelled_.load(); }

  const int id;
  const absl::Time deadline_;
  std::atomic<bool> cancelled_{false};
  // Batches the task takes (a long one computed in pieces); only the
  // batcher's thread reads and writes it.
  int pieces = 1;
};

using TestBatcher = Batcher<TestTask>;

// Records what the batcher did. The first batch can be held at a gate to keep
// the batcher busy while the test fills its queue.
class Recorder {
 public:
  // Call before scheduling anything.
  void HoldFirstBatch() { hold_first_batch_.store(true); }

  TestBatcher::ProcessBatch process() {
    return [this](std::vector<std::unique_ptr<TestTask>> batch) {
      if (hold_first_batch_.load() && !first_started_.HasBeenNotified()) {
        first_started_.Notify();
        release_.WaitForNotification();
      }
      absl::MutexLock lock(&mu_);
      thread_ = std::this_thread::get_id();
      std::vector<int>& ids = batches_.emplace_back();
      std::vector<std::unique_ptr<TestTask>> unfinished;
      for (auto& task : batch) {
        ids.push_back(task->id);
        if (--task->pieces > 0) {
          unfinished.push_back(std::move(task));
        } else {
          ++answered_;
        }
      }
      return unfinished;
    };
  }
  TestBatcher::DropTask drop() {
    return [this](std::unique_ptr<TestTask> task, absl::Status why) {
      absl::MutexLock lock(&mu_);
      dropped_.emplace_back(task->id, why.code());
      ++answered_;
    };
  }

  void WaitUntilFirstBatchStarted() { first_started_.WaitForNotification(); }
  void ReleaseFirstBatch() { release_.Notify(); }

  // False if `n` tasks were not answered within a generous real-time bound.
  bool WaitForAnswered(int n) {
    absl::MutexLock lock(&mu_);
    auto done = [this, n] { return answered_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(30));
  }
  std::vector<std::vector<int>> batches() {
    absl::MutexLock lock(&mu_);
    return batches_;
  }
  std::vector<std::pair<int, absl::StatusCode>> dropped() {
    absl::MutexLock lock(&mu_);
    return dropped_;
  }
  // The thread that processed the last batch.
  std::thread::id thread() {
    absl::MutexLock lock(&mu_);
    return thread_;
  }

 private:
  std::atomic<bool> hold_first_batch_{false};
  absl::Notification first_started_;
  absl::Notification release_;
  absl::Mutex mu_;
  std::vector<std::vector<int>> batches_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int, absl::StatusCode>> dropped_ ABSL_GUARDED_BY(mu_);
  int answered_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread::id thread_ ABSL_GUARDED_BY(mu_);
};

class BatcherTest : public ::testing::Test {
 protected:
  // kFixed unless told: the tests written before kWhileBusy check today's delay.
  std::unique_ptr<TestBatcher> Make(int max_batch_size, int64_t max_queue_delay_us,
                                    int queue_capacity = 100,
                                    BatchingDelay delay = BatchingDelay::kFixed,
                                    int64_t piece_wait_us = 1000) {
    TestBatcher::Options options;
    options.piece_wait_us = piece_wait_us;
    options.delay = delay;
    options.max_batch_size = max_batch_size;
    options.max_queue_delay_us = max_queue_delay_us;
    options.queue_capacity = queue_capacity;
    options.clock = &clock_;
    auto batcher = TestBatcher::Create(options, recorder_.process(), recorder_.drop());
    EXPECT_TRUE(batcher.ok()) << batcher.status();
    return batcher.ok() ? std::move(*batcher) : nullptr;
  }

  void ScheduleOk(TestBatcher& batcher, int id, absl::Time deadline = absl::InfiniteFuture(),
                  int pieces = 1) {
    auto task = std::make_unique<TestTask>(id, deadline);
    task->pieces = pieces;
    ASSERT_TRUE(batcher.Schedule(&task).ok());
    EXPECT_EQ(task, nullptr) << "an accepted task must belong to the batcher";
  }

  // Enough real time for the batcher thread to act if it (wrongly) would.
  static void LetBatcherRun() { absl::SleepFor(absl::Milliseconds(30)); }

  FakeClock clock_;
  Recorder recorder_;
};

TEST(BatcherCreateTest, RejectsOutOfRangeOptions) {
  auto process = [](std::vector<std::unique_ptr<TestTask>>) {
    return std::vector<std::unique_ptr<TestTask>>();
  };
  auto drop = [](std::unique_ptr<TestTask>, absl::Status) {};
  struct Case {
    TestBatcher::Options options;
    const char* message;
  };
  const Case cases[] = {
      {{.max_batch_size = 0}, "max_batch_size must be >= 1; was 0"},
      {{.max_queue_delay_us = -5}, "max_queue_delay_us must be >= 0; was -5"},
      {{.piece_wait_us = -1}, "piece_wait_us must be >= 0; was -1"},
      {{.queue_capacity = 0}, "queue_capacity must be >= 1; was 0"},
  };
  for (const Case& c : cases) {
    auto batcher = TestBatcher::Create(c.options, process, drop);
    ASSERT_EQ(batcher.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(std::string(batcher.status().message()), HasSubstr(c.message));
  }
  EXPECT_TRUE(TestBatcher::Create({}, process, drop).ok());
}

TEST_F(BatcherTest, FullBatchRunsWithoutWaitingForTheDelay) {
  auto batcher = Make(/*max_batch_size=*/3, /*max_queue_delay_us=*/1'000'000);
  for (int id = 0; id < 3; ++id) ScheduleOk(*batcher, id);
  ASSERT_TRUE(recorder_.WaitForAnswered(3));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0, 1, 2)));
}

TEST_F(BatcherTest, PartialBatchWaitsExactlyTheDelay) {
  auto batcher = Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/1000);
  ScheduleOk(*batcher, 0);
  ScheduleOk(*batcher, 1);
  LetBatcherRun();
  clock_.Advance(absl::Microseconds(999));
  LetBatcherRun();
  EXPECT_THAT(recorder_.batches(), IsEmpty());
  clock_.Advance(absl::Microseconds(1));
  ASSERT_TRUE(recorder_.WaitForAnswered(2));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0, 1)));
}

TEST_F(BatcherTest, QueuedTasksRunInArrivalOrderInBatchesOfAtMostMax) {
  recorder_.HoldFirstBatch();
  auto batcher = Make(/*max_batch_size=*/3, /*max_queue_delay_us=*/0);
  ScheduleOk(*batcher, 0);
  recorder_.WaitUntilFirstBatchStarted();
  for (int id = 1; id <= 7; ++id) ScheduleOk(*batcher, id);
  EXPECT_EQ(batcher->queue_depth(), 7);
  recorder_.ReleaseFirstBatch();
  ASSERT_TRUE(recorder_.WaitForAnswered(8));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0), ElementsAre(1, 2, 3),
                                               ElementsAre(4, 5, 6), ElementsAre(7)));
  EXPECT_EQ(batcher->queue_depth(), 0);
}

TEST_F(BatcherTest, FullQueueRefusesAtOnceAndCallerKeepsTheTask) {
  recorder_.HoldFirstBatch();
  auto batcher = Make(/*max_batch_size=*/1, /*max_queue_delay_us=*/0, /*queue_capacity=*/2);
  ScheduleOk(*batcher, 0);
  recorder_.WaitUntilFirstBatchStarted();  // task 0 left the queue
  ScheduleOk(*batcher, 1);
  ScheduleOk(*batcher, 2);

  auto refused = std::make_unique<TestTask>(3);
  absl::Status status = batcher->Schedule(&refused);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(status.message()), HasSubstr("2 requests waiting"));
  ASSERT_NE(refused, nullptr);
  EXPECT_EQ(refused->id, 3);

  recorder_.ReleaseFirstBatch();
  ASSERT_TRUE(recorder_.WaitForAnswered(3));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2)));
  EXPECT_THAT(recorder_.dropped(), IsEmpty());
}

TEST_F(BatcherTest, TaskWhoseDeadlinePassesInTheQueueIsDroppedNotProcessed) {
  auto batcher = Make(/*max_batch_size=*/3, /*max_queue_delay_us=*/1000);
  ScheduleOk(*batcher, 0, clock_.Now() + absl::Microseconds(500));
  ScheduleOk(*batcher, 1);
  LetBatcherRun();
  clock_.Advance(absl::Microseconds(1000));
  ASSERT_TRUE(recorder_.WaitForAnswered(2));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(1)));
  EXPECT_THAT(recorder_.dropped(), ElementsAre(Pair(0, absl::StatusCode::kDeadlineExceeded)));
}

TEST_F(BatcherTest, TaskWithDeadlineStillAheadRuns) {
  auto batcher = Make(/*max_batch_size=*/1, /*max_queue_delay_us=*/0);
  ScheduleOk(*batcher, 0, clock_.Now() + absl::Microseconds(1));
  ASSERT_TRUE(recorder_.WaitForAnswered(1));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0)));
}

TEST_F(BatcherTest, CancelledTaskIsDroppedNotProcessed) {
  auto batcher = Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/1000);
  auto task = std::make_unique<TestTask>(0);
  TestTask* cancelled = task.get();
  ASSERT_TRUE(batcher->Schedule(&task).ok());
  ScheduleOk(*batcher, 1);
  cancelled->cancelled_.store(true);
  clock_.Advance(absl::Microseconds(1000));
  ASSERT_TRUE(recorder_.WaitForAnswered(2));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(1)));
  EXPECT_THAT(recorder_.dropped(), ElementsAre(Pair(0, absl::StatusCode::kCancelled)));
}

TEST_F(BatcherTest, FullQueueMakesRoomByDroppingCancelledTasks) {
  recorder_.HoldFirstBatch();
  auto batcher = Make(/*max_batch_size=*/1, /*max_queue_delay_us=*/0, /*queue_capacity=*/1);
  ScheduleOk(*batcher, 0);
  recorder_.WaitUntilFirstBatchStarted();
  auto task = std::make_unique<TestTask>(1);
  TestTask* cancelled = task.get();
  ASSERT_TRUE(batcher->Schedule(&task).ok());
  cancelled->cancelled_.store(true);

  ScheduleOk(*batcher, 2);
  EXPECT_THAT(recorder_.dropped(), ElementsAre(Pair(1, absl::StatusCode::kCancelled)));
  recorder_.ReleaseFirstBatch();
  ASSERT_TRUE(recorder_.WaitForAnswered(3));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0), ElementsAre(2)));
}

TEST_F(BatcherTest, DrainAnswersEveryAcceptedTaskAndRefusesNewOnes) {
  auto batcher = Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/3'600'000'000);
  ScheduleOk(*batcher, 0);
  ScheduleOk(*batcher, 1);
  batcher->Drain();  // returns without the clock moving: no wait for the delay
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0, 1)));

  auto late = std::make_unique<TestTask>(2);
  EXPECT_EQ(batcher->Schedule(&late).code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(late, nullptr);
  batcher->Drain();
}

// A chore (the start-up warm-up) runs on the thread that computes the
// batches, at once: not held back by a partial batch waiting for its delay
// (the clock never moves here), and not run inside a batch.
TEST_F(BatcherTest, ChoreRunsOnTheBatchThreadWithoutWaitingForTheBatch) {
  auto batcher = Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/3'600'000'000);
  ScheduleOk(*batcher, 0);
  std::thread::id chore_thread;
  std::vector<std::vector<int>> batches_before_chore = {{-1}};
  ASSERT_TRUE(batcher
                  ->RunOnThread([&] {
                    chore_thread = std::this_thread::get_id();
                    batches_before_chore = recorder_.batches();
                  })
                  .ok());
  EXPECT_THAT(batches_before_chore, IsEmpty()) << "task 0 still waits for its delay";
  batcher->Drain();
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0)));
  EXPECT_EQ(chore_thread, recorder_.thread());
  EXPECT_NE(chore_thread, std::this_thread::get_id());
  EXPECT_EQ(batcher->RunOnThread([] {}).code(), absl::StatusCode::kUnavailable);
}

TEST_F(BatcherTest, DestructionDrains) {
  auto batcher = Make(/*max_batch_size=*/2, /*max_queue_delay_us=*/3'600'000'000);
  for (int id = 0; id < 5; ++id) ScheduleOk(*batcher, id);
  batcher.reset();
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(0, 1), ElementsAre(2, 3), ElementsAre(4)));
}

// A task in pieces (chunked prefill) runs again first in each next batch,
// beside up to max_batch_size tasks queued meanwhile: it does not count
// against the batch size, so others take turns with it.
TEST_F(BatcherTest, UnfinishedTaskRunsFirstInTheNextBatchesBesideQueuedOnes) {
  recorder_.HoldFirstBatch();
  auto batcher = Make(/*max_batch_size=*/1, /*max_queue_delay_us=*/0);
  ScheduleOk(*batcher, 0, absl::InfiniteFuture(), /*pieces=*/3);
  recorder_.WaitUntilFirstBatchStarted();
  for (int id = 1; id <= 3; ++id) ScheduleOk(*batcher, id);
  recorder_.ReleaseFirstBatch();
  ASSERT_TRUE(recorder_.WaitForAnswered(4));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0), ElementsAre(0, 1),
                                               ElementsAre(0, 2), ElementsAre(3)));
}

// The clock never moves: carried work is ready, so it waits for no delay,
// and the batcher's destruction finishes it.
TEST_F(BatcherTest, UnfinishedTaskRunsWithoutWaitingForTheDelay) {
  auto batcher = Make(/*max_batch_size=*/2, /*max_queue_delay_us=*/3'600'000'000,
                      /*queue_capacity=*/100, BatchingDelay::kFixed, /*piece_wait_us=*/0);
  ScheduleOk(*batcher, 0, absl::InfiniteFuture(), /*pieces=*/3);
  ScheduleOk(*batcher, 1);
  ASSERT_TRUE(recorder_.WaitForAnswered(2));
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(0, 1), ElementsAre(0), ElementsAre(0)));
  ScheduleOk(*batcher, 2, absl::InfiniteFuture(), /*pieces=*/2);
  batcher.reset();
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0, 1), ElementsAre(0), ElementsAre(0),
                                               ElementsAre(2), ElementsAre(2)));
}

// After a batch that answered others, a piece waits up to piece_wait_us for
// a task to join it, and no longer; after one that answered none, not at
// all. kFixed with a delay the clock never reaches makes the first batch
// {0, 1} whatever the threads' timing (it runs once full); carried pieces
// wait for no delay, only for the piece wait.
TEST_F(BatcherTest, APieceWaitsBrieflyForTheTasksJustAnsweredToComeBack) {
  auto batcher = Make(/*max_batch_size=*/2, /*max_queue_delay_us=*/3'600'000'000,
                      /*queue_capacity=*/100, BatchingDelay::kFixed, /*piece_wait_us=*/500);
  ScheduleOk(*batcher, 0, absl::InfiniteFuture(), /*pieces=*/4);
  ScheduleOk(*batcher, 1);
  ASSERT_TRUE(recorder_.WaitForAnswered(1));
  LetBatcherRun();
  EXPECT_EQ(recorder_.batches().size(), 1u) << "the piece did not wait";
  ScheduleOk(*batcher, 2);  // came back within the wait: joins the piece
  ASSERT_TRUE(recorder_.WaitForAnswered(2));
  LetBatcherRun();
  EXPECT_EQ(recorder_.batches().size(), 2u);
  clock_.Advance(absl::Microseconds(500));  // nobody comes back: the piece runs alone,
  ASSERT_TRUE(recorder_.WaitForAnswered(3));  // and so does the next, without waiting
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0, 1), ElementsAre(0, 2),
                                               ElementsAre(0), ElementsAre(0)));
}

// kWhileBusy: the clock never moves in these tests, so a batch that runs ran
// without waiting for any delay.
TEST_F(BatcherTest, WhileBusyHandsAnIdleBatchersTaskOverAtOnce) {
  auto batcher = Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/1'000'000,
                      /*queue_capacity=*/100, BatchingDelay::kWhileBusy);
  ScheduleOk(*batcher, 0);
  ASSERT_TRUE(recorder_.WaitForAnswered(1));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0)));
}

TEST_F(BatcherTest, WhileBusyFillsBatchesUpToMaxWhileOneRuns) {
  recorder_.HoldFirstBatch();
  auto batcher = Make(/*max_batch_size=*/3, /*max_queue_delay_us=*/1'000'000,
                      /*queue_capacity=*/100, BatchingDelay::kWhileBusy);
  ScheduleOk(*batcher, 0);
  recorder_.WaitUntilFirstBatchStarted();
  for (int id = 1; id <= 7; ++id) ScheduleOk(*batcher, id);
  LetBatcherRun();
  EXPECT_EQ(batcher->queue_depth(), 7) << "tasks left the queue while a batch was running";
  recorder_.ReleaseFirstBatch();
  ASSERT_TRUE(recorder_.WaitForAnswered(8));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0), ElementsAre(1, 2, 3),
                                               ElementsAre(4, 5, 6), ElementsAre(7)));
}

TEST_F(BatcherTest, WhileBusyPartialBatchRunsAsSoonAsTheOneInFlightEnds) {
  recorder_.HoldFirstBatch();
  auto batcher = Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/1'000'000,
                      /*queue_capacity=*/100, BatchingDelay::kWhileBusy);
  ScheduleOk(*batcher, 0);
  recorder_.WaitUntilFirstBatchStarted();
  ScheduleOk(*batcher, 1);
  ScheduleOk(*batcher, 2);
  recorder_.ReleaseFirstBatch();
  ASSERT_TRUE(recorder_.WaitForAnswered(3));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0), ElementsAre(1, 2)));
}

// A caller's turn (TakeIdleTurn): one at a time, only from an idle batcher,
// and no batch forms while it is held.
TEST_F(BatcherTest, AnIdleBatcherGivesOneTurnAndFormsNoBatchUntilItEnds) {
  auto batcher = Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/1'000'000,
                      /*queue_capacity=*/100, BatchingDelay::kWhileBusy);
  {
    TestBatcher::Turn turn = batcher->TakeIdleTurn();
    ASSERT_TRUE(turn);
    EXPECT_FALSE(batcher->TakeIdleTurn()) << "a second turn while one is held";
    ScheduleOk(*batcher, 0);
    LetBatcherRun();
    EXPECT_THAT(recorder_.batches(), IsEmpty()) << "a batch formed during the turn";
    EXPECT_EQ(batcher->queue_depth(), 1);
  }
  ASSERT_TRUE(recorder_.WaitForAnswered(1));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0)));
}

TEST_F(BatcherTest, NoTurnWhileABatchRunsOrATaskIsQueued) {
  recorder_.HoldFirstBatch();
  auto batcher = Make(/*max_batch_size=*/1, /*max_queue_delay_us=*/1'000'000,
                      /*queue_capacity=*/100, BatchingDelay::kWhileBusy);
  ScheduleOk(*batcher, 0);
  recorder_.WaitUntilFirstBatchStarted();
  EXPECT_FALSE(batcher->TakeIdleTurn()) << "a turn beside the batch in flight";
  ScheduleOk(*batcher, 1);
  recorder_.ReleaseFirstBatch();
  ASSERT_TRUE(recorder_.WaitForAnswered(2));
  // Idle again once the thread is back waiting for work.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  bool turned = false;
  while (!turned && absl::Now() < give_up) {
    turned = static_cast<bool>(batcher->TakeIdleTurn());
    if (!turned) absl::SleepFor(absl::Milliseconds(1));
  }
  EXPECT_TRUE(turned);
}

TEST_F(BatcherTest, NoTurnWithTheFixedDelayOrOnceDraining) {
  EXPECT_FALSE(Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/0)->TakeIdleTurn())
      << "kFixed promises to wait for company";
  auto batcher = Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/0, /*queue_capacity=*/100,
                      BatchingDelay::kWhileBusy);
  batcher->Drain();
  EXPECT_FALSE(batcher->TakeIdleTurn());
}

TEST_F(BatcherTest, DrainWaitsForAHeldTurn) {
  auto batcher = Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/0, /*queue_capacity=*/100,
                      BatchingDelay::kWhileBusy);
  std::atomic<bool> drained{false};
  std::thread drain;
  {
    TestBatcher::Turn turn = batcher->TakeIdleTurn();
    ASSERT_TRUE(turn);
    drain = std::thread([&] {
      batcher->Drain();
      drained.store(true);
    });
    LetBatcherRun();
    EXPECT_FALSE(drained.load()) << "drained while a caller still computed in its turn";
  }
  drain.join();
  EXPECT_TRUE(drained.load());
}

// The contrast: kFixed holds an idle batcher's lone task for the delay.
TEST_F(BatcherTest, FixedHoldsAnIdleBatchersTaskForTheDelay) {
  auto batcher = Make(/*max_batch_size=*/4, /*max_queue_delay_us=*/1000);
  ScheduleOk(*batcher, 0);
  LetBatcherRun();
  EXPECT_THAT(recorder_.batches(), IsEmpty());
  EXPECT_EQ(batcher->queue_depth(), 1);
  clock_.Advance(absl::Microseconds(1000));
  ASSERT_TRUE(recorder_.WaitForAnswered(1));
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0)));
}

TEST(BatcherRealClockTest, PartialBatchRunsAfterTheDelay) {
  absl::Notification done;
  std::vector<int> ids;
  auto batcher = TestBatcher::Create(
      {.max_batch_size = 8,
       .delay = BatchingDelay::kFixed,
       .max_queue_delay_us = 100,
       .queue_capacity = 8},
      [&](std::vector<std::unique_ptr<TestTask>> batch) {
        for (const auto& task : batch) ids.push_back(task->id);
        done.Notify();
        return std::vector<std::unique_ptr<TestTask>>();
      },
      [](std::unique_ptr<TestTask>, absl::Status) {});
  ASSERT_TRUE(batcher.ok());
  auto task = std::make_unique<TestTask>(7);
  ASSERT_TRUE((*batcher)->Schedule(&task).ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_THAT(ids, ElementsAre(7));
}

}  // namespace
}  // namespace attention::server
