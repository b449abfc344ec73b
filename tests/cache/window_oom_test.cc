// RotatingKVCache running out of memory one allocation at a time (oom_test: see
// support/failing_allocation.h): a script over two sequences of a window of 5 — ring writes past
// the window, chunks that linearize it, two rows at once, snapshots (lazy and copied), restores,
// splits, merges and captures scheduled inside a chunk — each call armed. After a call that runs
// out, every sequence holds a window consistent with its tokens (rotating_kv_cache.h: the last
// max_size-1 of them at least, each at its position), as it was or as the call leaves it; the
// cache serves the rest of the script; every snapshot restores its window; and once everything
// is dropped no array byte is left behind.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "support/cache_support.h"
#include "support/failing_allocation.h"

namespace kvsnap::window_oom_test {
namespace {

using testing::armed_call;
using testing::concat_ids;
using testing::id_range;
using testing::position_ids;
using testing::TokenKV;
using Ids = std::vector<int64_t>;

constexpr int64_t kWindow = 5;
const TokenKV kv;

// Whether `seq` is at offset ids.size() with a window of those tokens: every column the token at
// its position, and at least the last max_size-1 positions there (what the next query needs).
bool holds(RotatingKVCache& cache, int32_t seq, const Ids& ids) {
  const auto length = static_cast<int64_t>(ids.size());
  if (cache.offset(seq) != length) return false;
  if (length == 0) return true;
  const auto columns = position_ids(cache.view(Batch::rows({{seq, length, {}}})));
  for (const auto& [position, id] : columns) {
    if (position < 0 || position >= length || ids[static_cast<size_t>(position)] != id) {
      return false;
    }
  }
  const int64_t needed = std::min(length, kWindow - 1);
  int64_t seen = 0;
  for (const auto& [position, id] : columns) seen += position >= length - needed ? 1 : 0;
  return seen == needed;
}

// The script's state: each sequence's tokens and the snapshots (with the tokens up to their end).
struct Script {
  RotatingKVCache& cache;
  std::map<int32_t, Ids> held;
  std::map<std::string, std::pair<SnapshotPtr, Ids>> snapshots;

  void check() {
    for (const auto& [seq, ids] : held) EXPECT_TRUE(holds(cache, seq, ids)) << "sequence " << seq;
  }

  // Writes `chunks[i]` to seqs[i] in one update: a failed one leaves each row as it was or
  // written.
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
      if (done || holds(cache, seqs[i], written)) {
        ids = written;
      } else {
        EXPECT_TRUE(holds(cache, seqs[i], ids))
            << "sequence " << seqs[i] << ": neither as it was nor written";
      }
    }
    check();
  }
  void snapshot(const std::string& name, int32_t seq) {
    SnapshotPtr s;
    if (armed_call([&] { s = cache.snapshot(seq, 0); }) && s != nullptr) {
      EXPECT_EQ(s->to(), static_cast<int64_t>(held[seq].size()));
      snapshots[name] = {std::move(s), held[seq]};
    }
    check();
  }
  // Restores `name` into `seq` at `target` (its end when -1, or earlier while nothing was
  // evicted): a failed restore leaves the sequence as it was or restored.
  void restore(int32_t seq, const std::string& name, int64_t target = -1) {
    if (!snapshots.contains(name)) return;
    auto& [s, ids] = snapshots[name];
    if (target == -1) target = s->to();
    if (target > s->to() || (target < s->to() && s->to() > kWindow)) return;  // an earlier failure
    const Ids restored(ids.begin(), ids.begin() + target);
    bool fits = false;
    if (armed_call([&] { fits = cache.restore(seq, s.get(), target); })) {
      ASSERT_TRUE(fits) << name << " at " << target;
      held[seq] = restored;
    } else if (holds(cache, seq, restored)) {
      held[seq] = restored;
    } else {
      EXPECT_TRUE(holds(cache, seq, held[seq])) << "sequence " << seq << ": neither";
    }
    check();
  }
  // Splits `name` at `at` and merges the halves back: a failure consumes it.
  void split_and_merge(const std::string& name, int64_t at) {
    if (!snapshots.contains(name)) return;
    auto& [s, ids] = snapshots[name];
    if (!testing::split_and_merge_armed(cache, s, at)) snapshots.erase(name);
    check();
  }
  // Every snapshot restores its window into a sequence of its own.
  void check_snapshots(int32_t spare) {
    for (auto& [name, entry] : snapshots) {
      auto& [s, ids] = entry;
      cache.reset(spare);
      ASSERT_TRUE(cache.restore(spare, s.get(), s->to())) << name;
      EXPECT_TRUE(holds(cache, spare, ids)) << name;
    }
    cache.reset(spare);
  }
};

void run_script(RotatingKVCache& cache) {
  Script script{cache, {{0, {}}, {1, {}}}, {}};
  script.write({0}, {id_range(0, 3)});
  script.snapshot("short", 0);                               // lazy: nothing evicted yet
  for (int64_t i = 3; i < 8; ++i) script.write({0}, {{i}});  // past the window: the ring wraps
  script.snapshot("wrapped", 0);                             // copied at capture
  script.write({1}, {id_range(100, 7)});                     // a chunk: linear
  script.snapshot("linear", 1);                              // lazy
  script.write({0, 1}, {{8}, {107}});                        // both rows at once
  script.write({1}, {id_range(108, 3)});                     // a chunk over the lazy window
  script.restore(1, "short", 2);                             // earlier than its end: unevicted
  script.write({1}, {id_range(200, 2)});
  script.split_and_merge("linear", 3);
  script.restore(0, "linear");
  script.write({0}, {{300}});
  script.restore(1, "wrapped");
  script.write({1}, {id_range(400, 4)});
  // A capture scheduled inside a chunk.
  const int64_t at = cache.offset(0) + 2;
  if (SnapshotPtr s =
          testing::capture_inside(cache, 0, at, [&] { script.write({0}, {id_range(500, 3)}); })) {
    const Ids& ids = script.held[0];
    script.snapshots["captured"] = {std::move(s), Ids(ids.begin(), ids.begin() + at)};
  }
  script.check();
  // A chunk with no room after the window moves the kept tokens to column 0 and writes after
  // them, over columns a lazy window names (copied out first, which may run out).
  script.held[2] = {};
  script.write({2}, {id_range(600, 12)});   // a fresh 256-column buffer
  script.snapshot("moved over", 2);         // lazy: columns 8 to 11
  script.write({2}, {id_range(700, 238)});  // in place: the window begins at column 8
  script.write({2}, {id_range(1000, 10)});  // no room: the kept 4 move to column 0
  // Two captures inside a chunk, then ring writes: one that runs out while capturing loses the
  // rest of the schedule (the ring writes evict what its window held: one captured later would
  // be a later one); the reached ones come.
  const std::vector<int64_t> marks{cache.offset(2) + 2, cache.offset(2) + 4};
  if (armed_call([&] { cache.prepare_snapshots(2, marks); })) {
    script.write({2}, {id_range(1100, 6)});  // reaches both, inside the chunk
    for (int64_t i = 0; i < 2; ++i) script.write({2}, {{1200 + i}});
    testing::keep_reached(cache, 2, marks, script.held[2], script.snapshots);
  }
  script.check();
  testing::disarm();
  script.check_snapshots(7);
}

TEST(WindowOutOfMemory, EveryFailedAllocationLeavesTheWindowsAsTheContractSays) {
  const int64_t bytes = live_bytes();
  const int64_t runs = testing::sweep([&] {
    auto cache = std::make_unique<RotatingKVCache>(kWindow);
    run_script(*cache);
    cache.reset();
    EXPECT_EQ(live_bytes(), bytes);  // no array outlives the cache and its snapshots
  });
  EXPECT_GE(runs, 50);  // 61 as written
}

// A sequence without state (reset) takes the layout of its first write: a first write that runs
// out of memory takes none, so a write of other heads is taken next (on either kind whose
// sequences are one store of columns).
TEST(WindowOutOfMemory, AFirstWriteThatRunsOutTakesNoLayout) {
  const TokenKV two_heads, four_heads{.heads = 4};
  for (const bool window : {true, false}) {
    const int64_t runs = testing::sweep([&] {
      std::unique_ptr<Attention> cache;
      if (window) {
        cache = std::make_unique<RotatingKVCache>(kWindow);
      } else {
        cache = std::make_unique<KVCache>();
      }
      (void)testing::write(*cache, four_heads, id_range(0, 3));
      cache->reset(0);
      const Ids ids = id_range(10, 3);
      if (!armed_call([&] {
            (void)cache->update(Batch::uniform(1, 3, 0), two_heads.keys(ids),
                                two_heads.values(ids));
          })) {
        EXPECT_EQ(cache->offset(0), 0);
        (void)testing::write(*cache, four_heads, ids);  // throws if the two heads' layout stayed
        EXPECT_EQ(cache->offset(0), 3);
      }
    });
    EXPECT_GE(runs, 2) << (window ? "RotatingKVCache" : "KVCache");
  }
}

// So does a restore into a reset sequence: one that runs out takes no layout (a window's
// snapshot into a window; a KVCache's, or a PagedKVCache's blocks, into a KVCache).
TEST(WindowOutOfMemory, ARestoreThatRunsOutTakesNoLayout) {
  const TokenKV two_heads, four_heads{.heads = 4};
  for (const std::string from : {"window", "kv", "paged"}) {
    std::unique_ptr<Attention> source;
    if (from == "window") source = std::make_unique<RotatingKVCache>(kWindow);
    if (from == "kv") source = std::make_unique<KVCache>();
    if (from == "paged") source = std::make_unique<PagedKVCache>(PagedKVCache::Options{});
    (void)testing::write(*source, two_heads, id_range(10, 3));
    const SnapshotPtr snapshot = source->snapshot(0, 0);
    const int64_t runs = testing::sweep([&] {
      std::unique_ptr<Attention> cache;
      if (from == "window") {
        cache = std::make_unique<RotatingKVCache>(kWindow);
      } else {
        cache = std::make_unique<KVCache>();
      }
      (void)testing::write(*cache, four_heads, id_range(0, 3));
      cache->reset(0);
      if (!armed_call([&] { (void)cache->restore(0, snapshot.get(), 3); })) {
        EXPECT_EQ(cache->offset(0), 0);
        (void)testing::write(*cache, four_heads, id_range(20, 3));  // throws if a layout stayed
        EXPECT_EQ(cache->offset(0), 3);
      }
    });
    EXPECT_GE(runs, 2) << from;
  }
}

}  // namespace
}  // namespace kvsnap::window_oom_test
