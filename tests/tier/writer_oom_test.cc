// The write-behind running out of memory while it queues a batch: that batch is lost, and
// nothing else — the bytes it would have queued are not kept counted against the budget, so the
// writer, idle again, still takes a batch of any size.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support/failing_allocation.h"
#include "tier/store.h"
#include "tier/writer.h"

namespace kvsnap::writer_oom_test {
namespace {

using namespace std::chrono_literals;

// A store whose writes wait, without allocating, until the gate opens.
class GatedStore : public detail::Store {
 public:
  void probe(std::span<const std::string> sets, std::span<const std::string> keys, detail::Deadline,
             std::vector<std::vector<std::string>>& members, std::vector<int64_t>& sizes) override {
    members.assign(sets.size(), {});
    sizes.assign(keys.size(), -1);
  }
  std::vector<std::optional<std::string>> fetch(std::span<const std::string>, detail::Deadline,
                                                int64_t) override {
    return {};
  }
  Refused write(const detail::WriteBatch&, detail::Deadline) override {
    entered.fetch_add(1);
    while (!open.load()) std::this_thread::sleep_for(1ms);
    return {};
  }
  std::atomic<bool> open{false};
  std::atomic<int> entered{0};
};

detail::WriteBatch small_batch(int i) {
  detail::WriteBatch batch;
  batch.objects.emplace_back("object" + std::to_string(i), std::string(100, 'x'));
  return batch;
}

TEST(WriterOom, ABatchLostToOutOfMemoryLeavesNoBytesQueued) {
  constexpr int64_t kBudget = 1000;
  int64_t lost = 0;
  const int64_t runs = testing::sweep([&] {
    detail::TierCounters counters;
    auto owned = std::make_unique<GatedStore>();
    GatedStore* store = owned.get();
    detail::WriteBehind::Options options;
    options.capacity_bytes = kBudget;
    detail::WriteBehind writer(std::move(owned), options, counters);
    // The writer thread waits inside the first batch's write, so the pushes below are the only
    // allocations counted: the queue's own.
    ASSERT_TRUE(writer.push(small_batch(0)));
    while (store->entered.load() == 0) std::this_thread::sleep_for(1ms);
    std::vector<detail::WriteBatch> batches;
    for (int i = 1; i <= 8; ++i) batches.push_back(small_batch(i));
    for (detail::WriteBatch& batch : batches) {
      if (!testing::armed_call([&] { (void)writer.push(std::move(batch)); })) ++lost;
    }
    testing::disarm();
    store->open.store(true);
    ASSERT_TRUE(writer.flush(10s));
    // Idle: one batch of any size goes, as when nothing had been lost.
    EXPECT_TRUE(writer.has_room(10 * kBudget));
  });
  EXPECT_GT(runs, 1);
  EXPECT_GT(lost, 0);  // some push did run out
}

}  // namespace
}  // namespace kvsnap::writer_oom_test
