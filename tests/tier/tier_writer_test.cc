// The write-behind: batches go out in slices, index entries after every object they name, and
// each slice waits for the lookups in flight (bounded by the lookup timeout, and only for those
// already in flight, so lookups cannot starve it).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "tier/store.h"
#include "tier/writer.h"

namespace kvsnap {
namespace {

using namespace std::chrono_literals;
using detail::LookupGate;
using detail::WriteBatch;
using detail::WriteBehind;

// A store that records every write (the real backends have their own tests).
class RecordingStore : public detail::Store {
 public:
  void probe(std::span<const std::string>, std::span<const std::string>, detail::Deadline,
             std::vector<std::vector<std::string>>&, std::vector<bool>&) override {}
  std::vector<std::optional<std::string>> fetch(std::span<const std::string>,
                                                detail::Deadline) override {
    return {};
  }
  int64_t write(const WriteBatch& batch, detail::Deadline) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    writes_.push_back(batch);
    ++write_count_;
    return 0;
  }
  std::vector<WriteBatch> writes() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return writes_;
  }
  int write_count() const { return write_count_; }

 private:
  std::mutex mutex_;
  std::vector<WriteBatch> writes_;
  std::atomic<int> write_count_{0};
};

WriteBatch batch_of(int objects, size_t bytes_each) {
  WriteBatch batch;
  for (int i = 0; i < objects; ++i) {
    batch.objects.emplace_back("object" + std::to_string(i), std::string(bytes_each, 'x'));
  }
  batch.index.emplace_back("set", "1");
  batch.index.emplace_back("set", "2");
  return batch;
}

struct Writer {
  explicit Writer(std::chrono::milliseconds lookup_timeout) {
    auto owned = std::make_unique<RecordingStore>();
    store = owned.get();
    WriteBehind::Options options;
    options.lookup_timeout = lookup_timeout;
    writer = std::make_unique<WriteBehind>(std::move(owned), options, counters);
  }
  detail::TierCounters counters;
  RecordingStore* store = nullptr;
  std::unique_ptr<WriteBehind> writer;
};

TEST(TierWriteBehind, ABatchGoesOutInSlicesWithTheIndexAfterEveryObject) {
  Writer w(50ms);
  const auto object_bytes = static_cast<size_t>(WriteBehind::kSliceBytes / 2 + 1);
  ASSERT_TRUE(w.writer->push(batch_of(5, object_bytes)));
  ASSERT_TRUE(w.writer->flush(10s));
  const std::vector<WriteBatch> writes = w.store->writes();
  // Two objects exceed a slice: slices of 2, 2 and 1 objects.
  ASSERT_EQ(writes.size(), 3u);
  int next = 0;
  for (size_t s = 0; s < writes.size(); ++s) {
    EXPECT_LE(writes[s].bytes(), WriteBehind::kSliceBytes + static_cast<int64_t>(object_bytes));
    for (const auto& object : writes[s].objects) {
      EXPECT_EQ(object.first, "object" + std::to_string(next++));  // in order
    }
    EXPECT_EQ(writes[s].index.size(), s + 1 == writes.size() ? 2u : 0u);
  }
  EXPECT_EQ(next, 5);
  EXPECT_EQ(w.counters.objects_written.load(), 5);
  EXPECT_EQ(w.counters.bytes_written.load(), 5 * static_cast<int64_t>(object_bytes));
}

TEST(TierWriteBehind, WritesWaitForTheLookupInFlight) {
  Writer w(60s);  // the bound is not what ends the wait here
  std::optional<LookupGate::Entry> lookup;
  lookup.emplace(w.writer->lookups());
  ASSERT_TRUE(w.writer->push(batch_of(1, 10)));
  EXPECT_FALSE(w.writer->flush(100ms));  // held back while the lookup is in flight
  EXPECT_EQ(w.store->write_count(), 0);
  lookup.reset();
  ASSERT_TRUE(w.writer->flush(10s));
  EXPECT_EQ(w.store->write_count(), 1);
}

TEST(TierWriteBehind, AWriteWaitsAtMostTheLookupTimeout) {
  Writer w(20ms);
  const LookupGate::Entry stuck(w.writer->lookups());  // never finishes during the test
  ASSERT_TRUE(w.writer->push(batch_of(3, static_cast<size_t>(WriteBehind::kSliceBytes))));
  ASSERT_TRUE(w.writer->flush(10s));
  EXPECT_EQ(w.store->write_count(), 3);
}

TEST(TierWriteBehind, LookupsThatStartWhileTheWriterWaitsDoNotHoldItBack) {
  Writer w(60s);
  std::optional<LookupGate::Entry> first;
  first.emplace(w.writer->lookups());
  ASSERT_TRUE(w.writer->push(batch_of(1, 10)));
  EXPECT_FALSE(w.writer->flush(200ms));  // the writer now waits for `first`
  const LookupGate::Entry second(w.writer->lookups());
  first.reset();
  ASSERT_TRUE(w.writer->flush(10s));  // while `second` is still in flight
  EXPECT_EQ(w.store->write_count(), 1);
}

}  // namespace
}  // namespace kvsnap
