// Caches that restore, merge and split each other's snapshots from several threads at once:
// each call takes its own lock and the lock of the snapshot's data together, so no two calls
// wait on each other. A deadlock fails the test by its watchdog instead of hanging the suite.
// Run under ThreadSanitizer by the tsan preset (the suite's name has "Threads").
#include <gtest/gtest.h>
#include <kvsnap/kv_cache.h>
#include <kvsnap/paged_kv_cache.h>
#include <kvsnap/persistence.h>
#include <kvsnap/recurrent_cache.h>
#include <kvsnap/rotating_kv_cache.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "persist/safetensors.h"
#include "support/cache_support.h"

namespace kvsnap::cache_threads_test {
namespace {

using testing::column_ids;
using testing::id_range;
using testing::TokenKV;
using testing::write;

const TokenKV kv;

// Runs each task `rounds` times on its own thread; exits the process if they have not all
// finished within a minute (a deadlock cannot be joined).
void run_together(const std::vector<std::function<void()>>& tasks, int rounds) {
  std::atomic<size_t> finished{0};
  std::vector<std::thread> threads;
  for (const auto& task : tasks) {
    threads.emplace_back([&task, &finished, rounds] {
      for (int i = 0; i < rounds; ++i) task();
      finished.fetch_add(1);
    });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (finished.load() < tasks.size()) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "deadlock: %zu of %zu threads finished within a minute\n",
                   finished.load(), tasks.size());
      std::_Exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (std::thread& thread : threads) thread.join();
}

TEST(CacheThreads, CachesRestoringEachOthersSnapshotsAtOnceNeverWaitOnEachOther) {
  KVCache a, b;
  PagedKVCache paged(PagedKVCache::Options{.block_tokens = 8});
  write(a, kv, id_range(0, 64));
  write(b, kv, id_range(100, 64));
  write(paged, kv, id_range(200, 64));
  // Lazy in their caches: a restore elsewhere reads them under their owner's lock.
  const SnapshotPtr of_a = a.snapshot(0, 0), of_b = b.snapshot(0, 0),
                    of_paged = paged.snapshot(0, 0);
  ASSERT_TRUE(of_a->is_lazy() && of_b->is_lazy());
  run_together({[&] { ASSERT_TRUE(b.restore(1, of_a.get(), 48)); },
                [&] { ASSERT_TRUE(a.restore(1, of_b.get(), 48)); },
                [&] { ASSERT_TRUE(paged.restore(1, of_a.get(), 40)); },
                [&] { ASSERT_TRUE(a.restore(2, of_paged.get(), 40)); }},
               2000);
  EXPECT_EQ(column_ids(b.view(Batch::uniform(1, 1, 0))), id_range(100, 64));
  Batch row = Batch::uniform(1, 1, 0);
  row.seq_ids = {1};
  EXPECT_EQ(column_ids(b.view(row)), id_range(0, 48));
  EXPECT_EQ(column_ids(paged.view(Batch::uniform(1, 1, 0))), id_range(200, 64));
  row.seq_ids = {2};
  EXPECT_EQ(column_ids(a.view(row)), id_range(200, 40));
}

// A cache destroyed while another thread uses its lazy snapshots copies them out under its
// lock, which the snapshots keep: the reader sees each one lazy or owned, never half-copied,
// and restores the same tokens either way.
TEST(CacheThreads, SnapshotsUsedWhileTheirCacheIsDestroyedStayWhole) {
  for (int round = 0; round < 200; ++round) {
    auto dying = std::make_unique<KVCache>();
    auto ring = std::make_unique<RotatingKVCache>(16);
    write(*dying, kv, id_range(0, 40));
    write(*ring, kv, id_range(0, 12));
    const SnapshotPtr range = dying->snapshot(0, 0), window = ring->snapshot(0, 0);
    ASSERT_TRUE(range->is_lazy() && window->is_lazy());
    std::atomic<bool> destroyed{false};
    std::thread reader([&] {
      KVCache into;
      RotatingKVCache into_ring(16);
      for (int i = 0; i < 4 || !destroyed.load(); ++i) {
        (void)range->size();
        ASSERT_TRUE(into.restore(range.get(), 40));
        ASSERT_EQ(column_ids(into.view(Batch::uniform(1, 1, 0))), id_range(0, 40));
        into.reset();
        ASSERT_TRUE(into_ring.restore(window.get(), 12));
        into_ring.reset();
      }
    });
    dying.reset();
    ring.reset();
    destroyed.store(true);
    reader.join();
    ASSERT_FALSE(range->is_lazy() || window->is_lazy());
    EXPECT_GT(range->size(), 0);
    KVCache after;
    ASSERT_TRUE(after.restore(range.get(), 40));
    EXPECT_EQ(column_ids(after.view(Batch::uniform(1, 1, 0))), id_range(0, 40));
  }
}

// The token ids (TokenKV's tags) tensor `name` of saved snapshots holds, per head, in column
// order.
std::vector<int64_t> saved_ids(const std::string& bytes, const std::string& name) {
  const Array values = detail::decode_safetensors(bytes, "saved").at(name, "saved");
  const std::vector<float> data = values.to_floats();
  std::vector<int64_t> ids;
  for (size_t i = 0; i < data.size(); i += static_cast<size_t>(values.dim(3))) {
    ids.push_back(static_cast<int64_t>(data[i]));
  }
  return ids;
}

// Snapshots saved on one thread while another writes the sequences they were taken from — a
// rewind and new tokens over a range's columns, decode steps shifting a window's ring over its
// columns: each write copies the snapshot's tokens out before overwriting them, and the save
// copies them under the cache's lock from wherever they lie then, so every save holds the
// snapshots' own tokens (and ThreadSanitizer sees the save's reads ordered with the writes).
TEST(CacheThreads, SnapshotsSavedWhileTheirSequencesAreWrittenHoldTheirTokens) {
  for (int round = 0; round < 100; ++round) {
    KVCache range;
    RotatingKVCache window(8);
    write(range, kv, id_range(0, 12));
    write(window, kv, id_range(0, 12));
    const SnapshotPtr keys = range.snapshot(0, 0), state = window.snapshot(0, 0);
    ASSERT_TRUE(keys->is_lazy() && state->is_lazy());
    std::thread writer([&] {
      ASSERT_TRUE(range.restore(nullptr, 6));
      write(range, kv, id_range(100, 6));
      for (int64_t id = 100; id < 106; ++id) write(window, kv, id_range(id, 1));
    });
    const std::vector<const Snapshot*> saved{keys.get(), state.get()};
    const std::string bytes = encode_snapshots(12, saved);
    writer.join();
    std::vector<int64_t> range_ids = id_range(0, 12), window_ids = id_range(5, 7);
    range_ids.insert(range_ids.end(), range_ids.begin(), range_ids.end());  // both heads
    window_ids.insert(window_ids.end(), window_ids.begin(), window_ids.end());
    ASSERT_EQ(saved_ids(bytes, "layer.0.values"), range_ids) << "round " << round;
    ASSERT_EQ(saved_ids(bytes, "layer.1.values"), window_ids) << "round " << round;
  }
}

// take_snapshots_into lets go of what `into` held before it takes its cache's lock: two threads
// each taking their captures into a vector that held the other cache's lazy snapshots (whose
// release takes that cache's lock) never wait on each other.
TEST(CacheThreads, TakingIntoVectorsThatHeldTheOtherCachesSnapshotsNeverWaits) {
  KVCache x, y;
  write(x, kv, id_range(0, 8));
  write(y, kv, id_range(0, 8));
  std::vector<SnapshotPtr> into_x, into_y;
  const auto round = [](KVCache& ours, KVCache& theirs, std::vector<SnapshotPtr>& into) {
    into.push_back(theirs.snapshot(0, 4));  // lazy in theirs: [4, 8)
    const std::vector<int64_t> at{9};
    ours.prepare_snapshots(0, at);
    write(ours, kv, id_range(100, 1));
    ours.take_snapshots_into(0, into);
    ASSERT_EQ(into.size(), 1U);
    ASSERT_TRUE(ours.restore(0, nullptr, 8));
  };
  run_together({[&] { round(x, y, into_x); }, [&] { round(y, x, into_y); }}, 2000);
  into_x.clear();
  into_y.clear();
  EXPECT_EQ(column_ids(x.view(Batch::uniform(1, 1, 0))), id_range(0, 8));
}

// The histories a cache hands back are made of parts it keeps for reuse (a paged sequence's
// columns, a batch's rows), which come back when their last holder lets them go. Histories let go
// in another thread, while the cache goes on making new ones, come back whole: the holder reads
// each as it was made (its rows' lengths and last tokens), and no part is reused while held.
TEST(CacheThreads, HistoriesLetGoInAnotherThreadStayAsTheyWereMade) {
  struct Made {
    KVHistory paged, contiguous;  // two rows each: sequences 0 and 1
    RecurrentHistory recurrent;
    int64_t length0 = 0, length1 = 0;
  };
  PagedKVCache paged({.block_tokens = 4});
  KVCache contiguous;
  RecurrentCache recurrent(2, 8, 1, 4, 4);
  std::mutex mutex;
  std::vector<Made> queue;
  std::atomic<bool> done{false};
  const auto produce = [&] {
    for (int64_t step = 0; step < 300; ++step) {
      Batch batch = Batch::uniform(2, 1, 0);
      batch.seq_ids = {0, 1};
      const int64_t second = (step + 1) / 2;  // sequence 1 writes every other step
      batch.seq_offsets = {static_cast<int32_t>(step), static_cast<int32_t>(second)};
      batch.seq_query_lens = {1, step % 2 == 0 ? 1 : 0};
      const std::vector<int64_t> ids{step};
      const Array keys = kv.keys(ids, 2), values = kv.values(ids, 2);
      Batch states = Batch::uniform(2, 1, 0);  // the recurrent sequences stay at 0 (no put)
      states.seq_ids = {0, 1};
      Made made{paged.update(batch, keys, values), contiguous.update(batch, keys, values),
                recurrent.get(states, DType::f32), step + 1, second + (step % 2 == 0 ? 1 : 0)};
      const std::lock_guard<std::mutex> hold(mutex);
      queue.push_back(std::move(made));
    }
    done = true;
  };
  const auto consume = [&] {
    int64_t seen = 0;
    while (true) {
      std::optional<Made> made;
      {
        const std::lock_guard<std::mutex> hold(mutex);
        if (!queue.empty()) {
          made = std::move(queue.front());
          queue.erase(queue.begin());
        }
      }
      if (!made) {
        if (done && seen == 300) return;
        std::this_thread::yield();
        continue;
      }
      ++seen;
      for (const KVHistory* history : {&made->paged, &made->contiguous}) {
        ASSERT_EQ(history->rows(), 2);
        const std::vector<int64_t> row0 = column_ids(history->row(0));
        ASSERT_EQ(static_cast<int64_t>(row0.size()), made->length0);
        EXPECT_EQ(row0.back(), made->length0 - 1);
        EXPECT_EQ(history->row(1).length(), made->length1);
      }
      EXPECT_EQ(made->recurrent.rows(), 2);
    }  // each history let go here, in this thread
  };
  run_together({produce, consume}, 1);
  EXPECT_TRUE(queue.empty());
}

}  // namespace
}  // namespace kvsnap::cache_threads_test
