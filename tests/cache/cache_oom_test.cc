// Attention caches running out of memory one allocation at a time (oom_test: see
// support/failing_allocation.h): a script of writes (one row and two at once), snapshots,
// restores, splits, merges and scheduled captures over two sequences, each call armed. After a
// call that runs out, every sequence holds what the contract allows (cache.h: a failed update
// leaves each row as it was or, for a failure after the writes, written), the cache goes on
// serving the rest of the script, every snapshot still restores what it captured, and once all
// is dropped no block or array byte is left behind.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cache/state_snapshot.h"
#include "support/cache_support.h"
#include "support/failing_allocation.h"
#include "support/test_support.h"

namespace kvsnap::cache_oom_test {
namespace {

using testing::armed_call;
using testing::column_ids;
using testing::concat_ids;
using testing::id_range;
using testing::throws_error;
using testing::TokenKV;
using Ids = std::vector<int64_t>;

const TokenKV kv;

// The script's state: each sequence's ids, the snapshots and what each holds.
struct Script {
  Attention& cache;
  std::map<int32_t, Ids> held;
  std::map<std::string, std::pair<SnapshotPtr, Ids>> snapshots;  // name -> (snapshot, its ids)

  Ids ids_of(int32_t seq) const {
    if (cache.offset(seq) == 0) return {};
    return column_ids(cache.view(Batch::rows({{seq, cache.offset(seq), {}}})));
  }
  void check() const {
    for (const auto& [seq, ids] : held) EXPECT_EQ(ids_of(seq), ids) << "sequence " << seq;
  }

  // Writes `chunks[i]` to sequence seqs[i] in one update; a failed one leaves each row as it was
  // or written.
  void write(const std::vector<int32_t>& seqs, const std::vector<Ids>& chunks) {
    std::vector<Batch::Chunk> rows;
    for (size_t i = 0; i < seqs.size(); ++i) {
      rows.push_back({seqs[i], cache.offset(seqs[i]), std::vector<int32_t>(chunks[i].size(), 0)});
    }
    const Batch batch = Batch::rows(rows);
    const Array keys = kv.stacked(chunks, true), values = kv.stacked(chunks, false);
    const bool done = armed_call([&] { (void)cache.update(batch, keys, values); });
    for (size_t i = 0; i < seqs.size(); ++i) {
      Ids& ids = held[seqs[i]];
      const Ids written = concat_ids(ids, chunks[i]);
      if (done || ids_of(seqs[i]) == written) {
        ids = written;
      } else {
        EXPECT_EQ(ids_of(seqs[i]), ids)
            << "sequence " << seqs[i] << ": neither as it was nor written";
      }
    }
    check();
  }
  void snapshot(const std::string& name, int32_t seq, int64_t from) {
    if (static_cast<int64_t>(held[seq].size()) < from) return;  // an earlier write ran out
    SnapshotPtr s;
    if (armed_call([&] { s = cache.snapshot(seq, from); }) && s != nullptr) {
      const Ids& ids = held[seq];
      snapshots[name] = {std::move(s), Ids(ids.begin() + from, ids.end())};
    }
    check();
  }
  // Restores `name` (of [from, to)) into `seq` at `target`.
  void restore(int32_t seq, const std::string& name, int64_t target) {
    if (!snapshots.contains(name)) return;
    auto& [s, ids] = snapshots[name];
    const Ids before = held[seq];
    if (static_cast<int64_t>(before.size()) < s->from() || target > s->to()) return;
    Ids restored(before.begin(), before.begin() + s->from());
    restored.insert(restored.end(), ids.begin(), ids.begin() + (target - s->from()));
    bool fits = false;
    if (armed_call([&] { fits = cache.restore(seq, s.get(), target); })) {
      ASSERT_TRUE(fits);
      held[seq] = restored;
    } else {
      // Consistent: as it was, restored, or rewound to where the snapshot begins.
      const Ids now = ids_of(seq);
      const Ids rewound(before.begin(), before.begin() + s->from());
      EXPECT_TRUE(now == before || now == restored || now == rewound) << "sequence " << seq;
      held[seq] = now;
    }
    check();
  }
  // Splits `name` at `at` and merges the halves back: a failure consumes it.
  void split_and_merge(const std::string& name, int64_t at) {
    if (!snapshots.contains(name)) return;
    auto& [s, ids] = snapshots[name];
    if (at <= s->from() || at >= s->to()) return;
    if (!testing::split_and_merge_armed(cache, s, at)) snapshots.erase(name);
    check();
  }
  // Every snapshot restores what it captured, into a sequence of its own (one from
  // mid-sequence after a head of other tokens).
  void check_snapshots(int32_t spare) {
    for (auto& [name, entry] : snapshots) {
      auto& [s, ids] = entry;
      cache.reset(spare);
      const Ids head = id_range(500, s->from());
      if (!head.empty()) {
        const Array keys = kv.stacked({head}, true), values = kv.stacked({head}, false);
        (void)cache.update(Batch::rows({{spare, 0, std::vector<int32_t>(head.size(), 0)}}), keys,
                           values);
      }
      ASSERT_TRUE(cache.restore(spare, s.get(), s->to())) << name;
      EXPECT_EQ(ids_of(spare), concat_ids(head, ids)) << name;
    }
    cache.reset(spare);
  }
};

void run_script(Attention& cache) {
  Script script{cache, {{0, {}}, {1, {}}}, {}};
  script.write({0}, {id_range(0, 10)});
  script.write({1}, {id_range(100, 7)});
  script.snapshot("zero", 0, 0);
  script.snapshot("tail", 0, 3);
  script.write({0, 1}, {id_range(10, 2), id_range(107, 2)});  // both rows at once
  script.split_and_merge("zero", 6);
  script.restore(1, "zero", 8);
  script.write({1}, {id_range(200, 3)});
  // A capture scheduled inside a write.
  const int64_t at = cache.offset(0) + 1;
  if (SnapshotPtr s =
          testing::capture_inside(cache, 0, at, [&] { script.write({0}, {id_range(20, 3)}); })) {
    const Ids& ids = script.held[0];
    Ids captured(ids.begin() + s->from(), ids.begin() + at);
    script.snapshots["captured"] = {std::move(s), std::move(captured)};
  }
  script.check();
  testing::disarm();
  script.check_snapshots(7);
}

// A restore writes its snapshot part by part (here a lazy part and an owned one). Each part
// overwrites columns that other snapshots of the sequence name (two runs: `head` and `tail`,
// each copied out with storage of its own): all of that is copied out before the first part is
// written, so a copy that runs out leaves the sequence as it was, never the first part written
// over it and the rest old.
TEST(KVCacheOutOfMemory, ARestoreThatRunsOutWritesNoPart) {
  const int64_t runs = testing::sweep([] {
    KVCache cache;
    const auto write = [&](int32_t seq, const Ids& ids) {
      (void)cache.update(Batch::rows({{seq, cache.offset(seq), std::vector<int32_t>(ids.size())}}),
                         kv.stacked({ids}, true), kv.stacked({ids}, false));
    };
    write(0, id_range(0, 10));
    SnapshotPtr s = cache.snapshot(0, 0);
    ASSERT_TRUE(cache.restore(0, nullptr, 5));
    write(0, id_range(50, 5));  // s: [0, 5) lazy, [5, 10) its own now
    write(1, id_range(100, 5));
    const SnapshotPtr head = cache.snapshot(1, 0);
    write(1, id_range(105, 5));
    const SnapshotPtr tail = cache.snapshot(1, 5);
    const Ids before = id_range(100, 10);
    const Ids snapshot_ids = id_range(0, 10);  // [0, 5) lazy in sequence 0, [5, 10) owned
    const auto ids_of_one = [&] { return column_ids(cache.view(Batch::rows({{1, 10, {0}}}))); };
    const bool restored = armed_call([&] { ASSERT_TRUE(cache.restore(1, s.get(), 10)); });
    testing::disarm();
    // Returned: exactly the snapshot's tokens. Ran out: exactly the old ones, and the snapshot
    // still restores.
    EXPECT_EQ(ids_of_one(), restored ? snapshot_ids : before);
    EXPECT_EQ(cache.offset(1), 10);
    if (!restored) {
      ASSERT_TRUE(cache.restore(1, s.get(), 10));
      EXPECT_EQ(ids_of_one(), snapshot_ids);
    }
    EXPECT_EQ(column_ids(cache.view(Batch::rows({{0, 10, {0}}}))),
              concat_ids(id_range(0, 5), id_range(50, 5)));  // sequence 0 untouched
  });
  EXPECT_GT(runs, 2);
}

// A KV range whose capture ran out where its write reached it is made by the next write: until
// then take_snapshots says so (not "not reached"), and a zero-length update makes it. Each run on
// a fresh thread: its pools of snapshot objects empty, the capture allocates.
TEST(KVCacheOutOfMemory, ACaptureThatRanOutIsMadeByTheNextWrite) {
  int64_t lost = 0;
  const int64_t runs = testing::sweep([&] {
    std::thread([&] {
      KVCache cache;
      const std::vector<int64_t> at{4};
      cache.prepare_snapshots(0, at);
      const Ids ids = id_range(0, 6);
      const bool wrote = armed_call(
          [&] { (void)cache.update(Batch::uniform(1, 6, 0), kv.keys(ids), kv.values(ids)); });
      testing::disarm();
      if (wrote || cache.offset(0) != 6) return;  // wrote whole, or nothing
      ++lost;
      EXPECT_TRUE(throws_error([&] { (void)cache.take_snapshots(0); },
                               {"KVCache::take_snapshots", "offset 4 was reached (cache offset 6)",
                                "ran out of memory", "the next write makes it"}));
      (void)cache.update(Batch::uniform(1, 0, 6), kv.keys({}), kv.values({}));
      const std::vector<SnapshotPtr> taken = cache.take_snapshots(0);
      ASSERT_EQ(taken.size(), 1U);
      EXPECT_EQ(taken.front()->to(), 4);
    }).join();
  });
  EXPECT_GT(runs, 2);
  EXPECT_GE(lost, 1);
}

class CacheOutOfMemory : public ::testing::TestWithParam<bool> {};  // paged?

TEST_P(CacheOutOfMemory, EveryFailedAllocationLeavesTheSequencesAsTheContractSays) {
  const int64_t bytes = live_bytes();
  const int64_t runs = testing::sweep([&] {
    std::unique_ptr<Attention> cache;
    if (GetParam()) {
      cache = std::make_unique<PagedKVCache>(PagedKVCache::Options{.block_tokens = 4});
    } else {
      cache = std::make_unique<KVCache>();
    }
    run_script(*cache);
    if (::testing::Test::HasFailure()) return;
    if (auto* paged = dynamic_cast<PagedKVCache*>(cache.get())) {
      paged->reset(0);
      paged->reset(1);
      EXPECT_EQ(paged->pool_stats().blocks_in_use, 0);  // the script's snapshots are gone too
    }
    cache.reset();
    EXPECT_EQ(live_bytes(), bytes);  // no array outlives the cache and its snapshots
  });
  EXPECT_GE(runs, 20);  // the cache's own allocations (31 and 61 as written)
}

// A snapshot released on a thread that has never made or released one: that thread's free list
// of snapshot objects is made by the delete, which must cope without memory for it (before, its
// reserve threw inside a noexcept operator delete and ended the process).
TEST(PooledObjects, ReleasedOnAFreshThreadWithoutMemory) {
  KVCache cache;
  const Ids ids = id_range(0, 6);
  (void)cache.update(Batch::rows({{0, 0, std::vector<int32_t>(6, 0)}}), kv.keys(ids),
                     kv.values(ids));
  SnapshotPtr snapshot = cache.snapshot(0, 2);
  ASSERT_NE(snapshot, nullptr);
  testing::start_run(1);                // the first allocation fails
  detail::reuse_pooled_objects = true;  // start_run turns reuse off; this test is about it
  bool returned = false;
  std::thread([&] { returned = armed_call([&] { snapshot.reset(); }); }).join();
  detail::reuse_pooled_objects = false;
  testing::disarm();
  EXPECT_TRUE(returned);
  EXPECT_TRUE(testing::failed_in_run());  // the list's reserve ran out, and was coped with
  EXPECT_EQ(cache.offset(0), 6);
}

INSTANTIATE_TEST_SUITE_P(Kinds, CacheOutOfMemory, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Paged" : "KVCache"; });

}  // namespace
}  // namespace kvsnap::cache_oom_test
