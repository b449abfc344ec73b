// The write-behind: batches go out in slices, index entries after every object they name, and
// each slice waits for the lookups in flight (bounded by the lookup timeout, and only for those
// already in flight, so lookups cannot starve it).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <new>
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
  // Every set lists `listed`'s members, every key is there.
  void probe(std::span<const std::string> sets, std::span<const std::string> keys, detail::Deadline,
             std::vector<std::vector<std::string>>& members, std::vector<int64_t>& sizes) override {
    members.assign(sets.size(), listed);
    sizes.assign(keys.size(), 1);
  }
  std::vector<std::string> listed;
  std::vector<std::optional<std::string>> fetch(std::span<const std::string>, detail::Deadline,
                                                int64_t) override {
    return {};
  }
  Refused write(const WriteBatch& batch, detail::Deadline deadline) override {
    ++entered;
    while (held && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    const std::lock_guard<std::mutex> lock(mutex_);
    if (std::chrono::steady_clock::now() >= deadline) {  // as the real backends do
      throw detail::StoreFailure("no time left", detail::StoreFailure::Reason::timed_out);
    }
    if (++attempts_ == fail_at) {
      throw detail::StoreFailure("connection lost", detail::StoreFailure::Reason::failed);
    }
    if (attempts_ == out_of_memory_at) throw std::bad_alloc();
    writes_.push_back(batch);
    ++write_count_;
    Refused refused;
    for (const auto& [key, value] : batch.objects) {
      if (static_cast<int64_t>(value.size()) <= refuse_over) continue;
      ++refused.objects;
      refused.bytes += static_cast<int64_t>(value.size());
    }
    return refused;
  }
  int64_t refuse_over = INT64_MAX;  // objects larger are refused one by one
  int fail_at = 0;                  // the write that fails (1-based; 0: none)
  int out_of_memory_at = 0;         // the write that runs out of memory (1-based; 0: none)
  std::atomic<bool> held{false};    // writes wait while set (a stalled store)
  std::atomic<int> entered{0};      // writes begun
  std::vector<WriteBatch> writes() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return writes_;
  }
  int write_count() const { return write_count_; }

 private:
  std::mutex mutex_;
  std::vector<WriteBatch> writes_;
  std::atomic<int> write_count_{0};
  int attempts_ = 0;
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
  explicit Writer(std::chrono::milliseconds lookup_timeout,
                  std::chrono::milliseconds write_timeout = std::chrono::seconds(2),
                  int fail_at = 0, int64_t capacity_bytes = int64_t(1) << 30) {
    auto owned = std::make_unique<RecordingStore>();
    store = owned.get();
    store->fail_at = fail_at;
    WriteBehind::Options options;
    options.lookup_timeout = lookup_timeout;
    options.write_timeout = write_timeout;
    options.capacity_bytes = capacity_bytes;
    options.written = [this](const std::vector<std::string>& keys) {
      const std::lock_guard<std::mutex> lock(mutex);
      known.insert(known.end(), keys.begin(), keys.end());
    };
    writer = std::make_unique<WriteBehind>(std::move(owned), options, counters);
  }
  std::vector<std::string> known_keys() {
    const std::lock_guard<std::mutex> lock(mutex);
    return known;
  }
  detail::TierCounters counters;
  std::mutex mutex;
  std::vector<std::string> known;
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

// Keys doomed while the store is stalled wait apart from the queue (at most kMaxDoomedKeys,
// each once), so they never take the room the sessions' batches need, and go out with the next
// batch, deleted before its objects are written.
TEST(TierWriteBehind, DoomedKeysWaitApartAndGoWithTheNextBatch) {
  Writer w(50ms);
  w.store->held = true;
  ASSERT_TRUE(w.writer->push(batch_of(1, 10)));  // in flight, stalled
  while (w.store->entered == 0) std::this_thread::sleep_for(1ms);
  w.writer->doom("doomed0");  // twice: kept once
  for (size_t i = 0; i < WriteBehind::kMaxDoomedKeys + 100; ++i) {
    w.writer->doom("doomed" + std::to_string(i));
  }
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(w.writer->push(batch_of(1, 10))) << i;
  EXPECT_EQ(w.counters.dropped_batches.load(), 0);
  w.store->held = false;
  ASSERT_TRUE(w.writer->flush(10s));
  const std::vector<WriteBatch> writes = w.store->writes();
  ASSERT_EQ(writes.size(), 11u);  // the doomed keys joined a batch rather than one each
  size_t doomed = 0;
  for (const WriteBatch& batch : writes) doomed += batch.doomed.size();
  EXPECT_EQ(doomed, WriteBehind::kMaxDoomedKeys);
  EXPECT_EQ(writes[1].doomed.size(), WriteBehind::kMaxDoomedKeys);
  EXPECT_EQ(std::count(writes[1].doomed.begin(), writes[1].doomed.end(), "doomed0"), 1);
  EXPECT_EQ(writes[1].objects.size(), 1u);  // its objects are written in the same write
  // Alone, with nothing queued: they go on their own.
  w.writer->doom("late");
  ASSERT_TRUE(w.writer->flush(10s));
  ASSERT_EQ(w.store->writes().size(), 12u);
  EXPECT_EQ(w.store->writes().back().doomed, std::vector<std::string>{"late"});
}

// Objects the store refuses one by one count as errors, neither written nor in bytes_written.
TEST(TierWriteBehind, RefusedObjectsAreNotCountedWritten) {
  Writer w(50ms);
  w.store->refuse_over = 100;
  WriteBatch batch;
  batch.objects = {{"small", std::string(10, 'x')}, {"large", std::string(1000, 'x')}};
  ASSERT_TRUE(w.writer->push(batch));
  ASSERT_TRUE(w.writer->flush(10s));
  EXPECT_EQ(w.counters.objects_written.load(), 1);
  EXPECT_EQ(w.counters.bytes_written.load(), 10);
  EXPECT_EQ(w.counters.store_errors.load(), 1);
}

// A stalled store: what waits for it (queued, and the batch in flight) is held to
// capacity_bytes of objects; a batch that would pass it is dropped and counted, and the room
// comes back as batches are written.
TEST(TierWriteBehind, WhatWaitsForAStalledStoreIsBoundedInBytes) {
  Writer w(50ms, 10s, 0, /*capacity_bytes=*/1000);
  w.store->held = true;
  EXPECT_TRUE(w.writer->push(batch_of(2, 300)));  // 600 bytes: in flight, stalled
  EXPECT_FALSE(w.writer->has_room(500));
  EXPECT_TRUE(w.writer->has_room(400));
  EXPECT_FALSE(w.writer->push(batch_of(2, 250)));  // 1100 > 1000
  EXPECT_EQ(w.counters.dropped_batches.load(), 1);
  EXPECT_TRUE(w.writer->push(batch_of(1, 400)));  // exactly 1000
  EXPECT_FALSE(w.writer->has_room(1));
  w.store->held = false;
  ASSERT_TRUE(w.writer->flush(10s));
  EXPECT_TRUE(w.writer->has_room(1000));
  EXPECT_EQ(w.counters.objects_written.load(), 3);
  EXPECT_EQ(w.counters.dropped_batches.load(), 1);
  // Larger than the budget: goes when nothing else waits or is written, and only then.
  w.store->held = true;
  EXPECT_TRUE(w.writer->has_room(5000));
  EXPECT_TRUE(w.writer->push(batch_of(1, 5000)));
  EXPECT_FALSE(w.writer->push(batch_of(1, 5000)));
  EXPECT_FALSE(w.writer->has_room(1));
  w.store->held = false;
  ASSERT_TRUE(w.writer->flush(10s));
  EXPECT_EQ(w.counters.objects_written.load(), 4);
  EXPECT_EQ(w.counters.dropped_batches.load(), 2);
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

TEST(TierWriteBehind, AFailureMidBatchDropsTheRestAndMarksNothingKnown) {
  Writer w(50ms, 2s, /*fail_at=*/2);
  ASSERT_TRUE(w.writer->push(batch_of(4, static_cast<size_t>(WriteBehind::kSliceBytes))));
  ASSERT_TRUE(w.writer->flush(10s));
  const std::vector<WriteBatch> writes = w.store->writes();
  ASSERT_EQ(writes.size(), 1u);  // the first slice; the second failed, the rest was dropped
  EXPECT_TRUE(writes[0].index.empty());
  EXPECT_EQ(w.counters.dropped_batches.load(), 1);
  // Nothing counts as stored: the next close writes (and indexes) these objects again.
  EXPECT_TRUE(w.known_keys().empty());
}

// Anything else thrown on the writer's thread (here out of memory) costs that batch, not the
// process (an exception leaving a thread's function ends the process).
TEST(TierWriteBehind, RunningOutOfMemoryDropsTheBatchAndTheWriterGoesOn) {
  Writer w(50ms);
  w.store->out_of_memory_at = 1;
  ASSERT_TRUE(w.writer->push(batch_of(2, 10)));
  ASSERT_TRUE(w.writer->flush(10s));
  EXPECT_EQ(w.counters.dropped_batches.load(), 1);
  EXPECT_TRUE(w.known_keys().empty());
  ASSERT_TRUE(w.writer->push(batch_of(1, 10)));  // the next batch goes out
  ASSERT_TRUE(w.writer->flush(10s));
  EXPECT_EQ(w.store->write_count(), 1);
  EXPECT_EQ(w.known_keys(), (std::vector<std::string>{"object0"}));
}

// A batch the store took is written, whatever happens noting it: not counted dropped too.
TEST(TierWriteBehind, ABatchStoredStaysCountedWrittenWhenNotingItFails) {
  detail::TierCounters counters;
  WriteBehind::Options options;
  options.written = [](const std::vector<std::string>&) { throw std::bad_alloc(); };
  WriteBehind writer(std::make_unique<RecordingStore>(), options, counters);
  ASSERT_TRUE(writer.push(batch_of(2, 10)));
  ASSERT_TRUE(writer.flush(10s));
  EXPECT_EQ(counters.objects_written.load(), 2);
  EXPECT_EQ(counters.dropped_batches.load(), 0);
}

TEST(TierWriteBehind, ABatchWrittenWholeMarksEveryObjectKnownOnce) {
  Writer w(50ms);
  ASSERT_TRUE(w.writer->push(batch_of(3, static_cast<size_t>(WriteBehind::kSliceBytes))));
  ASSERT_TRUE(w.writer->flush(10s));
  EXPECT_EQ(w.known_keys(), (std::vector<std::string>{"object0", "object1", "object2"}));
}

TEST(TierWriteBehind, WaitingForLookupsDoesNotUseUpTheWriteTimeout) {
  // Each of 3 slices waits 60 ms for a lookup that never ends; the store gets 100 ms.
  Writer w(60ms, 100ms);
  const LookupGate::Entry stuck(w.writer->lookups());
  ASSERT_TRUE(w.writer->push(batch_of(3, static_cast<size_t>(WriteBehind::kSliceBytes))));
  ASSERT_TRUE(w.writer->flush(10s));
  const std::vector<WriteBatch> writes = w.store->writes();
  ASSERT_EQ(writes.size(), 3u);
  EXPECT_EQ(writes.back().index.size(), 2u);
  EXPECT_EQ(w.counters.dropped_batches.load(), 0);
}

// An index entry this process knows the store holds is still there when the index lists its
// offset, whatever size the member says (one the store has is "31:4096"; the writer that skips a
// known point has not encoded it, so knows only "31").
TEST(TierWriteBehind, AKnownIndexEntryIsHeldByAnyMemberOfItsOffset) {
  for (const auto& [listed, held] : std::vector<std::pair<std::vector<std::string>, bool>>{
           {{"31:4096"}, true}, {{"31"}, true}, {{"26:100", "310:4"}, false}, {{}, false}}) {
    detail::TierCounters counters;
    int lost = 0;
    WriteBehind::Options options;
    options.lost = [&] { ++lost; };
    auto store = std::make_unique<RecordingStore>();
    store->listed = listed;
    WriteBehind writer(std::move(store), options, counters);
    WriteBatch batch = batch_of(1, 10);
    batch.known_index.emplace_back("set", 31);
    ASSERT_TRUE(writer.push(std::move(batch)));
    ASSERT_TRUE(writer.flush(10s));
    EXPECT_EQ(lost, held ? 0 : 1) << ::testing::PrintToString(listed);
  }
}

TEST(TierWriteBehind, AnIndexOnlyBatchIsSent) {
  Writer w(50ms);
  WriteBatch batch = batch_of(0, 0);
  ASSERT_TRUE(w.writer->push(std::move(batch)));
  ASSERT_TRUE(w.writer->flush(10s));
  const std::vector<WriteBatch> writes = w.store->writes();
  ASSERT_EQ(writes.size(), 1u);
  EXPECT_EQ(writes[0].index.size(), 2u);
}

}  // namespace
}  // namespace kvsnap
