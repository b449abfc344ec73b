// Promises of cache.h and kv_cache.h that no other test checks: a new materialize hook replaces
// the old one and none runs for a snapshot that owns everything; KVCache::reserve never shrinks
// and holds for sequences written later; Cache's default per-sequence calls serve sequence 0 of a
// single-sequence cache and refuse any other; a reset sequence stays listed, at offset 0.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "support/any_cache.h"
#include "support/cache_support.h"
#include "support/delegating_cache.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap::cache_contract_gaps_test {
namespace {

using testing::id_range;
using testing::throws_error;
using testing::TokenKV;
using testing::write_to;

const TokenKV kv;

// Each lazy kind, by name.
std::unique_ptr<Attention> make_lazy(const std::string& kind) {
  if (kind == "KVCache") return std::make_unique<KVCache>();
  if (kind == "RotatingKVCache") return std::make_unique<RotatingKVCache>(8);
  return std::make_unique<PagedKVCache>(PagedKVCache::Options{.block_tokens = 4});
}
const char* const kLazyKinds[] = {"KVCache", "RotatingKVCache", "PagedKVCache"};

std::unique_ptr<RecurrentCache> make_recurrent() {
  const testing::RecurrentLayer layer;
  return std::make_unique<RecurrentCache>(layer.conv_tail, layer.conv_dim, layer.value_heads,
                                          layer.value_depth, layer.key_depth);
}

// A lazy snapshot given hook `first`, then `second` (or an empty function): when the cache's
// reset makes it own its bytes, only the last hook set runs, with what it now owns.
TEST(MaterializeHook, ANewHookReplacesTheOldOne) {
  for (const char* kind : kLazyKinds) {
    for (const bool empty_second : {false, true}) {
      SCOPED_TRACE(std::string(kind) + (empty_second ? ", then no hook" : ", then another"));
      const std::unique_ptr<Attention> cache = make_lazy(kind);
      (void)testing::write(*cache, kv, id_range(0, 6));
      const SnapshotPtr s = cache->snapshot(0);
      ASSERT_NE(s, nullptr);
      ASSERT_TRUE(s->is_lazy());
      ASSERT_EQ(s->size(), 0);
      int first = 0, second = 0;
      int64_t delta = 0;
      s->set_materialize_hook([&](int64_t) { ++first; });
      if (empty_second) {
        s->set_materialize_hook({});
      } else {
        s->set_materialize_hook([&](int64_t d) {
          ++second;
          delta += d;
        });
      }
      cache->reset();
      ASSERT_GT(s->size(), 0);  // it owns its bytes now: a hook had cause to run
      EXPECT_EQ(first, 0);
      if (empty_second) {
        EXPECT_EQ(second, 0);
      } else {
        EXPECT_GE(second, 1);  // at once or in parts (a paged snapshot: block by block)
      }
      if (!empty_second) {
        EXPECT_EQ(delta, s->size());
      }
    }
  }
}

// A snapshot of 6 tokens that owns everything: taken lazy, then its cache reset. Null (with a
// failure) when it does not come out so.
SnapshotPtr owned_snapshot(Attention& cache) {
  (void)testing::write(cache, kv, id_range(0, 6));
  SnapshotPtr s = cache.snapshot(0);
  cache.reset();
  if (s == nullptr || s->is_lazy() || s->size() <= 0) {
    ADD_FAILURE() << "the snapshot does not own its 6 tokens";
    return nullptr;
  }
  return s;
}

// A snapshot that already owns everything (a lazy one after its cache's reset, a recurrent one
// from the start) gets a hook that never runs: not on writes, snapshots, resets or the
// destruction of its cache.
TEST(MaterializeHook, NeverRunsForASnapshotThatOwnsEverything) {
  for (const char* kind : kLazyKinds) {
    SCOPED_TRACE(kind);
    std::unique_ptr<Attention> cache = make_lazy(kind);
    const SnapshotPtr s = owned_snapshot(*cache);
    ASSERT_NE(s, nullptr);
    const int64_t owned = s->size();
    int fired = 0;
    s->set_materialize_hook([&](int64_t) { ++fired; });
    (void)testing::write(*cache, kv, id_range(50, 6));
    const SnapshotPtr other = cache->snapshot(0);
    ASSERT_TRUE(cache->restore(nullptr, 2));
    (void)testing::write(*cache, kv, id_range(60, 6));
    cache->reset();
    (void)testing::write(*cache, kv, id_range(70, 3));
    cache.reset();  // destroyed: its other snapshots are copied out
    EXPECT_EQ(fired, 0);
    EXPECT_EQ(s->size(), owned);
  }
  const testing::RecurrentLayer layer;
  auto recurrent = make_recurrent();
  (void)layer.forward(*recurrent, id_range(0, 4));
  const SnapshotPtr s = recurrent->snapshot(0);
  ASSERT_NE(s, nullptr);
  ASSERT_FALSE(s->is_lazy());
  int fired = 0;
  s->set_materialize_hook([&](int64_t) { ++fired; });
  (void)layer.forward(*recurrent, id_range(4, 3));
  ASSERT_TRUE(recurrent->restore(s.get(), 4));
  (void)layer.forward(*recurrent, id_range(9, 2));
  recurrent->reset();
  recurrent.reset();
  EXPECT_EQ(fired, 0);
}

// Restoring a snapshot that owns everything into a cache (and writing over what it restored)
// runs no hook either.
void restore_owned(const char* kind) {
  const std::unique_ptr<Attention> cache = make_lazy(kind);
  const SnapshotPtr s = owned_snapshot(*cache);
  ASSERT_NE(s, nullptr);
  int fired = 0;
  s->set_materialize_hook([&](int64_t) { ++fired; });
  ASSERT_TRUE(cache->restore(s.get(), 6));
  ASSERT_TRUE(cache->restore(nullptr, 3));
  (void)testing::write(*cache, kv, id_range(80, 4));
  cache->reset();
  EXPECT_EQ(fired, 0);
}

TEST(MaterializeHook, NeverRunsForAnOwnedSnapshotRestoredIntoACache) {
  for (const char* kind : {"KVCache", "RotatingKVCache"}) {
    SCOPED_TRACE(kind);
    restore_owned(kind);
  }
}

// The exception cache.h names: a PagedKVCache restore shares the snapshot's blocks with the
// sequence again, so the snapshot stops owning them (its hook says so, size() falls by them) and
// owns them again once the sequence lets them go; the hook's deltas follow size() throughout.
TEST(MaterializeHook, AnOwnedPagedSnapshotRestoredIntoASequenceReportsTheBlocksItShares) {
  const std::unique_ptr<Attention> cache = make_lazy("PagedKVCache");
  const SnapshotPtr s = owned_snapshot(*cache);
  ASSERT_NE(s, nullptr);
  const int64_t owned = s->size();
  int64_t reported = 0;
  s->set_materialize_hook([&](int64_t delta) { reported += delta; });
  ASSERT_TRUE(cache->restore(s.get(), 6));
  EXPECT_LT(s->size(), owned);
  EXPECT_EQ(owned + reported, s->size());
  ASSERT_TRUE(cache->restore(nullptr, 3));
  (void)testing::write(*cache, kv, id_range(80, 4));
  EXPECT_EQ(owned + reported, s->size());
  cache->reset();
  EXPECT_EQ(s->size(), owned);
  EXPECT_EQ(reported, 0);
}

// The reservation holds at once for sequence 0 (written before it) and for sequences written
// after it, whose first write gets the room: they then grow to it without a growth copy, their
// buffer staying where it is. A smaller reservation later lowers nothing.
TEST(KVCacheReserve, NeverShrinksAndSequencesWrittenLaterGetTheReservedRoom) {
  KVCache cache;
  (void)testing::write(cache, kv, id_range(0, 3));
  ASSERT_EQ(cache.capacity(), KVCache::kStep);
  cache.reserve(1000);
  const int64_t reserved = cache.capacity();
  EXPECT_GE(reserved, 1000);
  const int64_t grown = cache.copy_stats().growth_bytes;  // sequence 0's 3 tokens, moved at once
  cache.reserve(10);                                      // never shrinks
  cache.reserve(0);
  EXPECT_EQ(cache.capacity(), reserved);
  // Sequences made after the reservation (and after the smaller ones): written to 1000 tokens
  // without growing.
  for (const SeqId seq : {SeqId{1}, SeqId{5}}) {
    const std::vector<int64_t> first = id_range(0, 2);
    const KVHistory start =
        cache.update(Batch::rows({{seq, 0, {1, 1}}}), kv.keys(first), kv.values(first));
    const float* buffer = start.keys().data<float>();
    for (int64_t at = 2; at < 1000; at += 166) {
      const int64_t length = std::min<int64_t>(166, 1000 - at);
      const std::vector<int64_t> ids = id_range(at, length);
      const KVHistory history = cache.update(
          Batch::rows({{seq, at, std::vector<int32_t>(static_cast<size_t>(length), 1)}}),
          kv.keys(ids), kv.values(ids));
      EXPECT_EQ(history.keys().data<float>(), buffer) << "sequence " << seq << " grew at " << at;
    }
    EXPECT_EQ(cache.offset(seq), 1000);
  }
  EXPECT_EQ(cache.copy_stats().growth_bytes, grown);
  // Sequence 0 reset, then written again: its first write after the reset has the room too.
  cache.reset(0);
  (void)testing::write(cache, kv, id_range(0, 1));
  EXPECT_GE(cache.capacity(), 1000);
}

// A custom kind that implements only the single-sequence interface (DelegatingCache over a
// KVCache, forwarding those calls alone).
class SingleSequence final : public testing::DelegatingCache {
 public:
  using DelegatingCache::DelegatingCache;
};

// Sequence 0 is the cache: every per-sequence call with 0 does what the call without one does.
TEST(DefaultPerSequenceCalls, ServeSequenceZeroOfASingleSequenceCache) {
  KVCache inner;
  SingleSequence custom(inner);
  Cache& cache = custom;  // the per-sequence calls: Cache's defaults
  (void)testing::write(inner, kv, id_range(0, 4));
  EXPECT_EQ(cache.sequences(), std::vector<SeqId>{0});
  EXPECT_EQ(cache.offset(0), 4);
  ASSERT_EQ(cache.state(0).size(), 2U);
  EXPECT_EQ(cache.state(0)[0].to_floats(), inner.state()[0].to_floats());
  const SnapshotPtr s = cache.snapshot(0, 1);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->from(), 1);
  EXPECT_EQ(s->to(), 4);
  const std::vector<int64_t> offsets{5, 6};
  cache.prepare_snapshots(0, offsets);
  EXPECT_TRUE(inner.schedule_state(0).pending);
  (void)testing::write(inner, kv, id_range(4, 1));
  EXPECT_EQ(cache.take_reached_snapshots(0).size(), 1U);  // 5 reached; the schedule is dropped
  EXPECT_FALSE(inner.schedule_state(0).pending);
  cache.prepare_snapshots(0, offsets);
  cache.cancel_snapshots(0);
  EXPECT_FALSE(inner.schedule_state(0).pending);
  cache.prepare_snapshots(0, offsets);
  (void)testing::write(inner, kv, id_range(5, 1));
  EXPECT_EQ(cache.take_snapshots(0).size(), 2U);
  cache.prepare_snapshots(0, std::vector<int64_t>{6});
  std::vector<SnapshotPtr> into;
  cache.take_snapshots_into(0, into);
  EXPECT_EQ(into.size(), 1U);
  EXPECT_TRUE(cache.restore(0, s.get(), 3));
  EXPECT_EQ(inner.offset(), 3);
  cache.reset(0);
  EXPECT_EQ(inner.offset(), 0);
}

// Any other sequence: each call throws kvsnap::Error naming it (and the sequence), changing
// nothing; take_snapshots_into clears `into` first.
TEST(DefaultPerSequenceCalls, ThrowForAnyOtherSequenceNamingTheCall) {
  KVCache inner;
  SingleSequence custom(inner);
  Cache& cache = custom;  // the per-sequence calls: Cache's defaults
  (void)testing::write(inner, kv, id_range(0, 4));
  SnapshotPtr s = inner.snapshot(0);
  const std::vector<int64_t> offsets{6};
  for (const SeqId seq : {SeqId{1}, SeqId{7}}) {
    const std::string named = "sequence " + std::to_string(seq);
    const auto refused = [&](const char* call, auto&& run) {
      return throws_error(run, {call, named.c_str()});
    };
    EXPECT_TRUE(refused("Cache::state", [&] { (void)cache.state(seq); }));
    EXPECT_TRUE(refused("Cache::reset", [&] { cache.reset(seq); }));
    EXPECT_TRUE(refused("Cache::offset", [&] { (void)cache.offset(seq); }));
    EXPECT_TRUE(refused("Cache::snapshot", [&] { (void)cache.snapshot(seq, 0); }));
    EXPECT_TRUE(
        refused("Cache::prepare_snapshots", [&] { cache.prepare_snapshots(seq, offsets); }));
    EXPECT_TRUE(refused("Cache::cancel_snapshots", [&] { cache.cancel_snapshots(seq); }));
    EXPECT_TRUE(refused("Cache::take_snapshots", [&] { (void)cache.take_snapshots(seq); }));
    EXPECT_TRUE(
        refused("Cache::take_reached_snapshots", [&] { (void)cache.take_reached_snapshots(seq); }));
    std::vector<SnapshotPtr> into;
    into.push_back(inner.snapshot(2));
    EXPECT_TRUE(refused("take_snapshots", [&] { cache.take_snapshots_into(seq, into); }));
    EXPECT_TRUE(into.empty());
    EXPECT_TRUE(refused("Cache::restore", [&] { (void)cache.restore(seq, s.get(), 4); }));
  }
  EXPECT_EQ(inner.offset(), 4);
  EXPECT_FALSE(inner.schedule_state(0).pending);
  EXPECT_EQ(inner.sequences(), std::vector<SeqId>{0});
}

// cache.h says of the per-sequence calls as a whole that the defaults refuse any sequence but 0;
// the defaults of exposed_bytes, exposed_bytes_after_rewind and schedule_state answer instead.
// The queries cache.h excepts answer for every sequence by their own defaults: nothing exposed,
// no schedule known.
TEST(DefaultPerSequenceCalls, TheQueriesAnswerForEverySequence) {
  KVCache inner;
  (void)testing::write(inner, kv, id_range(0, 3));
  SingleSequence custom(inner);
  Cache& cache = custom;  // the per-sequence calls: Cache's defaults
  for (const SeqId seq : {SeqId{0}, SeqId{1}}) {
    EXPECT_EQ(cache.exposed_bytes(seq), 0);
    EXPECT_EQ(cache.exposed_bytes_after_rewind(seq, 0), 0);
    EXPECT_FALSE(cache.schedule_state(seq).known);
  }
}

// Every built-in kind: sequence 1 reset (holding a lazy snapshot's tokens and a schedule) stays
// in sequences(), at offset 0, beside the others as they were; it is written again from 0.
TEST(SequencesList, AResetSequenceStaysListedAtOffsetZero) {
  for (const std::string kind : {"KVCache", "RotatingKVCache", "PagedKVCache", "RecurrentCache"}) {
    SCOPED_TRACE(kind);
    const std::unique_ptr<Cache> cache =
        kind == "RecurrentCache" ? std::unique_ptr<Cache>(make_recurrent()) : make_lazy(kind);
    write_to(*cache, 0, id_range(0, 3));
    write_to(*cache, 1, id_range(10, 5));
    write_to(*cache, 4, id_range(20, 2));
    const SnapshotPtr s = cache->snapshot(1, 0);
    cache->prepare_snapshots(1, std::vector<int64_t>{7});
    cache->reset(1);
    EXPECT_EQ(cache->sequences(), (std::vector<SeqId>{0, 1, 4}));
    EXPECT_EQ(cache->offset(1), 0);
    EXPECT_FALSE(cache->schedule_state(1).pending);
    EXPECT_EQ(cache->offset(0), 3);
    EXPECT_EQ(cache->offset(4), 2);
    cache->reset(1);  // again: still listed
    EXPECT_EQ(cache->sequences(), (std::vector<SeqId>{0, 1, 4}));
    write_to(*cache, 1, id_range(30, 2));
    EXPECT_EQ(cache->offset(1), 2);
  }
}

}  // namespace
}  // namespace kvsnap::cache_contract_gaps_test
