// The admission queue on a fake clock: order, priority, bound, timeout, the
// request's deadline, cancel, and keeping one's place across waits.
#include "router/admission_queue.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "gtest/gtest.h"
#include "metrics/registry.h"

namespace tandem::router {
namespace {

using Lane = AdmissionQueue::Lane;

class AdmissionQueueTest : public ::testing::Test {
 protected:
  explicit AdmissionQueueTest(
      AdmissionQueueOptions options = {.max_queued_requests = 3,
                                       .queue_timeout = absl::Seconds(10)})
      : metrics_(&registry_), queue_(&clock_, &metrics_, options) {}

  // Pushes request `name`; its end is recorded as "name:CODE".
  absl::StatusOr<uint64_t> Push(const std::string& name, int32_t priority = 0,
                                absl::Time deadline = absl::InfiniteFuture(),
                                Lane lane = Lane::kDecode) {
    return queue_.Push(
        lane, priority, deadline, &places_[name], [this, name](const absl::Status& s) {
          ended_.push_back(absl::StrCat(name, ":", absl::StatusCodeToString(s.code())));
        });
  }
  double Rejections(const std::string& reason) {
    return metrics_.rejections->Add({{"reason", reason}}).Value();
  }

  FakeClock clock_;
  metrics::Registry registry_;
  AdmissionQueueMetrics metrics_;
  AdmissionQueue queue_;
  std::map<std::string, QueuePlace> places_;
  std::vector<std::string> ended_;
};

TEST_F(AdmissionQueueTest, FirstComeFirstServedWithinAPriority) {
  ASSERT_TRUE(Push("a").ok());
  ASSERT_TRUE(Push("b").ok());
  ASSERT_TRUE(Push("c").ok());
  EXPECT_EQ(queue_.depth(), 3u);
  EXPECT_EQ(metrics_.depth->Value(), 3);
  EXPECT_EQ(queue_.Wake(Lane::kDecode, 2), 2);
  EXPECT_EQ(ended_, (std::vector<std::string>{"a:OK", "b:OK"}));
  EXPECT_EQ(queue_.Wake(Lane::kDecode, 5), 1);
  EXPECT_EQ(ended_.back(), "c:OK");
  EXPECT_EQ(queue_.depth(), 0u);
  EXPECT_EQ(metrics_.depth->Value(), 0);
  EXPECT_EQ(metrics_.wait_seconds->Count(), 3u);
}

TEST_F(AdmissionQueueTest, LowerPriorityFirst) {
  ASSERT_TRUE(Push("late", 5).ok());
  ASSERT_TRUE(Push("urgent", -1).ok());
  ASSERT_TRUE(Push("normal", 0).ok());
  queue_.Wake(Lane::kDecode, 3);
  EXPECT_EQ(ended_, (std::vector<std::string>{"urgent:OK", "normal:OK", "late:OK"}));
}

TEST_F(AdmissionQueueTest, LanesAreWokenApart) {
  ASSERT_TRUE(Push("slot", 0, absl::InfiniteFuture(), Lane::kInFlight).ok());
  ASSERT_TRUE(Push("room", 0, absl::InfiniteFuture(), Lane::kDecode).ok());
  EXPECT_EQ(queue_.Wake(Lane::kDecode, 5), 1);
  EXPECT_EQ(ended_, (std::vector<std::string>{"room:OK"}));
  EXPECT_EQ(queue_.Wake(Lane::kInFlight, 5), 1);
  EXPECT_EQ(ended_.back(), "slot:OK");
}

TEST_F(AdmissionQueueTest, FullQueueRefusesAtOnce) {
  ASSERT_TRUE(Push("a").ok());
  ASSERT_TRUE(Push("b").ok());
  ASSERT_TRUE(Push("c", 0, absl::InfiniteFuture(), Lane::kInFlight).ok());
  absl::StatusOr<uint64_t> d = Push("d", -10);  // priority does not jump the bound
  EXPECT_EQ(d.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(d.status().message().find("queue is full"), std::string::npos);
  EXPECT_EQ(Rejections("queue_full"), 1);
  EXPECT_TRUE(ended_.empty());
  queue_.Wake(Lane::kDecode, 1);
  EXPECT_TRUE(Push("e").ok());  // a freed place can be taken
}

TEST_F(AdmissionQueueTest, NoQueueRefusesEverything) {
  AdmissionQueue none(&clock_, &metrics_, {.max_queued_requests = 0});
  QueuePlace place;
  EXPECT_EQ(none.Push(Lane::kDecode, 0, absl::InfiniteFuture(), &place,
                      [](const absl::Status&) {})
                .status()
                .code(),
            absl::StatusCode::kResourceExhausted);
}

TEST_F(AdmissionQueueTest, TimeoutEndsWithResourceExhausted) {
  ASSERT_TRUE(Push("a").ok());
  clock_.Advance(absl::Seconds(4));
  ASSERT_TRUE(Push("b").ok());
  clock_.Advance(absl::Seconds(5.9));
  EXPECT_EQ(queue_.Expire(), 0);
  clock_.Advance(absl::Seconds(0.1));  // a: 10 s
  EXPECT_EQ(queue_.Expire(), 1);
  EXPECT_EQ(ended_, (std::vector<std::string>{"a:RESOURCE_EXHAUSTED"}));
  EXPECT_EQ(Rejections("queue_timeout"), 1);
  EXPECT_EQ(queue_.depth(), 1u);
  EXPECT_DOUBLE_EQ(metrics_.wait_seconds->Sum(), 10);
}

TEST_F(AdmissionQueueTest, RequestDeadlineEndsWithDeadlineExceeded) {
  ASSERT_TRUE(Push("a", 0, clock_.Now() + absl::Seconds(2)).ok());
  clock_.Advance(absl::Seconds(2));
  EXPECT_EQ(queue_.Expire(), 1);
  EXPECT_EQ(ended_, (std::vector<std::string>{"a:DEADLINE_EXCEEDED"}));
  EXPECT_EQ(Rejections("queue_timeout"), 0);
  EXPECT_EQ(metrics_.wait_seconds->Count(), 1u);
}

TEST_F(AdmissionQueueTest, CancelFreesThePlaceWithoutAnEnd) {
  absl::StatusOr<uint64_t> a = Push("a");
  ASSERT_TRUE(Push("b").ok());
  ASSERT_TRUE(Push("c").ok());
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(queue_.Remove(*a));
  EXPECT_FALSE(queue_.Remove(*a));
  EXPECT_EQ(queue_.depth(), 2u);
  EXPECT_TRUE(Push("d").ok());  // its place is free
  queue_.Wake(Lane::kDecode, 5);
  EXPECT_EQ(ended_, (std::vector<std::string>{"b:OK", "c:OK", "d:OK"}));
  EXPECT_EQ(metrics_.wait_seconds->Count(), 4u);
}

TEST_F(AdmissionQueueTest, AWaiterPushedAgainKeepsItsPlaceAndExpiry) {
  ASSERT_TRUE(Push("a").ok());
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(Push("b").ok());
  queue_.Wake(Lane::kDecode, 1);  // a finds no room after all
  clock_.Advance(absl::Seconds(1));
  ASSERT_TRUE(Push("a").ok());
  queue_.Wake(Lane::kDecode, 1);
  EXPECT_EQ(ended_.back(), "a:OK");  // still ahead of b
  ASSERT_TRUE(Push("a").ok());
  clock_.Advance(absl::Seconds(8));  // 10 s since a first queued
  queue_.Expire();
  EXPECT_EQ(ended_.back(), "a:RESOURCE_EXHAUSTED");
  // Pushed again once expired: refused at once.
  clock_.Advance(absl::Seconds(1));
  places_["b"].expires = clock_.Now();
  queue_.Remove(places_["b"].seq);
  EXPECT_EQ(Push("b").status().code(), absl::StatusCode::kResourceExhausted);
}

// A woken waiter that ends at once and wakes the next from its on_end (every
// request failing fast while no worker is alive) must not recurse once per
// waiter: nested wakes run in the outermost call's loop.
TEST(AdmissionQueueWakeTest, WakesFromOnEndRunInALoopNotARecursion) {
  FakeClock clock;
  metrics::Registry registry;
  AdmissionQueueMetrics metrics(&registry);
  AdmissionQueue queue(
      &clock, &metrics,
      {.max_queued_requests = 5000, .queue_timeout = absl::Seconds(10)});
  constexpr int kWaiters = 3000;
  std::vector<QueuePlace> places(kWaiters);
  int depth = 0, max_depth = 0, ended = 0;
  for (int i = 0; i < kWaiters; ++i) {
    ASSERT_TRUE(queue
                    .Push(Lane::kDecode, 0, absl::InfiniteFuture(), &places[i],
                          [&](const absl::Status&) {
                            max_depth = std::max(max_depth, ++depth);
                            ++ended;
                            EXPECT_EQ(queue.Wake(Lane::kDecode, 1), 0);  // nested
                            --depth;
                          })
                    .ok());
  }
  EXPECT_EQ(queue.Wake(Lane::kDecode, 1), 1);
  EXPECT_EQ(ended, kWaiters);  // the nested wakes drained the rest
  EXPECT_EQ(max_depth, 1);
  EXPECT_EQ(queue.depth(), 0u);
}

// The bound is for arrivals: a woken request that must wait again keeps its
// place even when a newcomer took the room it left.
TEST_F(AdmissionQueueTest, AWokenRequestBackInLineIsNotRefusedAsFull) {
  ASSERT_TRUE(Push("a").ok());
  ASSERT_TRUE(Push("b").ok());
  ASSERT_TRUE(Push("c").ok());
  EXPECT_EQ(queue_.Wake(Lane::kDecode, 1), 1);  // a leaves: 2 waiting
  ASSERT_TRUE(Push("d").ok());                  // a newcomer fills the bound
  EXPECT_EQ(Push("e").status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(Push("a").ok());  // a is back, in its old place (first)
  EXPECT_EQ(queue_.Wake(Lane::kDecode, 1), 1);
  EXPECT_EQ(ended_.back(), "a:OK");
}

}  // namespace
}  // namespace tandem::router
