// The Cache contract shared by every kind, run as typed tests over all three.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <memory>
#include <random>
#include <string>
#include <type_traits>

#include "cache/snapshot_record.h"
#include "support/cache_support.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap::cache_contract_test {
namespace {

using testing::id_range;
using testing::throws_error;

const testing::TokenKV kv;
const testing::RecurrentLayer layer;

struct KVKind {
  using Type = KVCache;
  static std::unique_ptr<KVCache> make() { return std::make_unique<KVCache>(); }
  static void write(KVCache& cache, int64_t n) {
    testing::write(cache, kv, id_range(cache.offset(), n));
  }
};
struct PagedKind {
  using Type = PagedKVCache;
  static std::unique_ptr<PagedKVCache> make() {
    return std::make_unique<PagedKVCache>(PagedKVCache::Options{.block_tokens = 2});
  }
  static void write(PagedKVCache& cache, int64_t n) {
    testing::write(cache, kv, id_range(cache.offset(), n));
  }
};
struct RotatingKind {
  using Type = RotatingKVCache;
  static std::unique_ptr<RotatingKVCache> make() { return std::make_unique<RotatingKVCache>(5); }
  static void write(RotatingKVCache& cache, int64_t n) {
    testing::write(cache, kv, id_range(cache.offset(), n));
  }
};
struct RecurrentKind {
  using Type = RecurrentCache;
  static std::unique_ptr<RecurrentCache> make() {
    return std::make_unique<RecurrentCache>(layer.conv_tail, layer.conv_dim, layer.value_heads,
                                            layer.value_depth, layer.key_depth);
  }
  static void write(RecurrentCache& cache, int64_t n) {
    layer.forward(cache, id_range(cache.offset(), n));
  }
};

// The values of every array of `cache`'s state, in order: what restoring a snapshot must give
// back exactly.
std::vector<std::vector<float>> contents(const Cache& cache) {
  std::vector<std::vector<float>> out;
  for (const Array& array : cache.state()) out.push_back(array.to_floats());
  return out;
}

template <class Kind>
class CacheContract : public ::testing::Test {
 protected:
  std::unique_ptr<typename Kind::Type> cache = Kind::make();
  void write(int64_t n) { Kind::write(*cache, n); }
};

using Kinds = ::testing::Types<KVKind, PagedKind, RotatingKind, RecurrentKind>;
TYPED_TEST_SUITE(CacheContract, Kinds);

TYPED_TEST(CacheContract, StartsEmptyAtOffsetZero) {
  EXPECT_EQ(this->cache->offset(), 0);
  EXPECT_TRUE(this->cache->state().empty());
  EXPECT_EQ(this->cache->snapshot(0), nullptr);
}

// A write of no tokens changes nothing, not even the layout that a fresh KV cache takes from its
// first write: a later write of another head count and depth is the first, and fixes its own.
template <class Kind>
class KVContract : public CacheContract<Kind> {};
using KVKinds = ::testing::Types<KVKind, PagedKind, RotatingKind>;
TYPED_TEST_SUITE(KVContract, KVKinds);

TYPED_TEST(KVContract, AWriteOfNoTokensTakesNoLayout) {
  (void)testing::write(*this->cache, kv, {});
  EXPECT_EQ(this->cache->offset(), 0);
  EXPECT_EQ(this->cache->snapshot(0), nullptr);
  const testing::TokenKV other{.heads = 1, .depth = 2};
  (void)testing::write(*this->cache, other, id_range(0, 3));
  EXPECT_EQ(this->cache->offset(), 3);
  const std::vector<Array> state = this->cache->state();
  ASSERT_FALSE(state.empty());
  EXPECT_EQ(state[0].dim(1), 1);
  EXPECT_EQ(state[0].dim(3), 2);
  EXPECT_TRUE(
      throws_error([&] { (void)testing::write(*this->cache, kv, id_range(3, 1)); }, {"update"}));
  EXPECT_EQ(this->cache->offset(), 3);
}

// Nor after a reset, which lets the sequence's layout go: a write of no tokens in another layout
// takes none, and the first layout's tokens, and snapshots, still go in. (A PagedKVCache's pool
// keeps its layout while a snapshot holds its blocks: paged_kv_cache.h.)
TYPED_TEST(KVContract, AWriteOfNoTokensAfterAResetTakesNoLayout) {
  const testing::TokenKV other{.heads = 1, .depth = 2};
  (void)testing::write(*this->cache, kv, id_range(0, 3));
  this->cache->reset();
  (void)testing::write(*this->cache, other, {});
  EXPECT_NO_THROW((void)testing::write(*this->cache, kv, id_range(0, 2)));
  EXPECT_EQ(this->cache->offset(), 2);
  if (dynamic_cast<PagedKVCache*>(this->cache.get()) != nullptr) return;
  const SnapshotPtr first = this->cache->snapshot(0);
  ASSERT_NE(first, nullptr);
  this->cache->reset();
  (void)testing::write(*this->cache, other, {});
  EXPECT_EQ(this->cache->offset(), 0);
  EXPECT_TRUE(this->cache->restore(first.get(), 2));
  EXPECT_EQ(this->cache->offset(), 2);
}

TYPED_TEST(CacheContract, WritesAdvanceTheOffset) {
  this->write(3);
  this->write(1);
  EXPECT_EQ(this->cache->offset(), 4);
  EXPECT_FALSE(this->cache->state().empty());
}

TYPED_TEST(CacheContract, SnapshotRestoresTheCurrentOffset) {
  this->write(4);
  const auto captured = contents(*this->cache);
  SnapshotPtr s = this->cache->snapshot(0);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->to(), 4);
  this->write(2);
  ASSERT_NE(contents(*this->cache), captured);
  ASSERT_TRUE(this->cache->restore(s.get(), 4));
  EXPECT_EQ(this->cache->offset(), 4);
  EXPECT_EQ(contents(*this->cache), captured);  // the state itself, not just the offset
}

TYPED_TEST(CacheContract, TakeReachedSnapshotsKeepsThePassedCapturesOfACutForward) {
  const std::vector<int64_t> offsets{2, 4, 9};
  this->cache->prepare_snapshots(offsets);
  this->write(5);  // passes 2 and 4, not 9
  std::vector<SnapshotPtr> reached = this->cache->take_reached_snapshots();
  ASSERT_EQ(reached.size(), 2u);
  EXPECT_EQ(reached[0]->to(), 2);
  EXPECT_EQ(reached[1]->to(), 4);
  // The schedule is gone: a new one may be prepared, and the captures restore.
  this->cache->prepare_snapshots(std::vector<int64_t>{6});
  this->cache->cancel_snapshots();
  EXPECT_TRUE(this->cache->take_reached_snapshots().empty());
  ASSERT_TRUE(this->cache->restore(reached[1].get(), 4));
  EXPECT_EQ(this->cache->offset(), 4);
}

TYPED_TEST(CacheContract, ResetDropsStateAndSchedule) {
  this->write(3);
  const std::vector<int64_t> offsets{5};
  this->cache->prepare_snapshots(offsets);
  this->cache->reset();
  EXPECT_EQ(this->cache->offset(), 0);
  EXPECT_TRUE(this->cache->state().empty());
  EXPECT_TRUE(this->cache->take_snapshots().empty());
  this->cache->prepare_snapshots(offsets);  // a fresh schedule is accepted
}

TYPED_TEST(CacheContract, CapturesComeBackOnePerOffsetInOrder) {
  this->write(2);
  const std::vector<int64_t> offsets{3, 4, 7};
  this->cache->prepare_snapshots(offsets);
  this->write(5);
  auto captures = this->cache->take_snapshots();
  ASSERT_EQ(captures.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_NE(captures[i], nullptr);
    EXPECT_EQ(captures[i]->to(), offsets[i]);
  }
  EXPECT_TRUE(this->cache->take_snapshots().empty());
}

TYPED_TEST(CacheContract, TakeWithoutAScheduleIsEmpty) {
  this->write(2);
  EXPECT_TRUE(this->cache->take_snapshots().empty());
}

TYPED_TEST(CacheContract, BadSchedulesThrowAndKeepTheCache) {
  this->write(4);
  const auto before = this->cache->offset();
  const std::vector<int64_t> unsorted{6, 5}, duplicate{5, 5}, passed{3};
  EXPECT_TRUE(throws_error([&] { this->cache->prepare_snapshots(unsorted); },
                           {"prepare_snapshots", "ascending"}));
  EXPECT_TRUE(throws_error([&] { this->cache->prepare_snapshots(duplicate); }, {"unique"}));
  EXPECT_TRUE(throws_error([&] { this->cache->prepare_snapshots(passed); }, {"already passed"}));
  const std::vector<int64_t> later{6};
  this->cache->prepare_snapshots(later);
  EXPECT_TRUE(throws_error([&] { this->cache->prepare_snapshots(later); }, {"not taken"}));
  EXPECT_TRUE(throws_error([&] { (void)this->cache->take_snapshots(); }, {"not reached"}));
  EXPECT_TRUE(
      throws_error([&] { (void)this->cache->restore(nullptr, before); }, {"restore", "scheduled"}));
  EXPECT_EQ(this->cache->offset(), before);
  this->write(2);
  EXPECT_EQ(this->cache->take_snapshots().size(), 1u);
}

TYPED_TEST(CacheContract, CancelDropsTheScheduleAndItsCaptures) {
  this->write(3);
  const std::vector<int64_t> offsets{3, 5};
  this->cache->prepare_snapshots(offsets);  // 3 is captured at once
  this->cache->cancel_snapshots();
  EXPECT_TRUE(this->cache->take_snapshots().empty());
  EXPECT_TRUE(this->cache->restore(nullptr, 3));  // no longer blocked by a schedule
  this->cache->prepare_snapshots(offsets);
  this->write(2);
  EXPECT_EQ(this->cache->take_snapshots().size(), 2u);
}

TYPED_TEST(CacheContract, SnapshotOutOfRangeThrows) {
  this->write(2);
  EXPECT_TRUE(throws_error([&] { (void)this->cache->snapshot(3); }, {"snapshot", "from_offset 3"}));
  EXPECT_TRUE(throws_error([&] { (void)this->cache->snapshot(-1); }, {"from_offset -1"}));
}

TYPED_TEST(CacheContract, SnapshotsOfAnotherKindAreRejected) {
  this->write(3);
  std::unique_ptr<Cache> other;
  // KV ranges restore into either KV kind (KVCache and PagedKVCache): a window is foreign to
  // both.
  if (this->cache->restore_rule().kind == RestoreRule::Kind::ranges) {
    auto rotating = std::make_unique<RotatingKVCache>(4);
    testing::write(*rotating, kv, id_range(0, 3));
    other = std::move(rotating);
  } else {
    auto plain = std::make_unique<KVCache>();
    testing::write(*plain, kv, id_range(0, 3));
    other = std::move(plain);
  }
  SnapshotPtr foreign = other->snapshot(0);
  EXPECT_TRUE(throws_error([&] { (void)this->cache->restore(foreign.get(), 3); }, {"not a"}));
  EXPECT_EQ(this->cache->offset(), 3);
}

TYPED_TEST(CacheContract, NullSnapshotsMergeAndSplitToNull) {
  EXPECT_EQ(this->cache->merge(nullptr, nullptr), nullptr);
  auto [a, b] = this->cache->split(nullptr, 3);
  EXPECT_EQ(a, nullptr);
  EXPECT_EQ(b, nullptr);
}

TYPED_TEST(CacheContract, SnapshotsOutliveTheCache) {
  this->write(4);
  const auto captured = contents(*this->cache);
  SnapshotPtr s = this->cache->snapshot(0);
  this->cache.reset();  // destroys the cache
  auto fresh = TypeParam::make();
  EXPECT_TRUE(fresh->restore(s.get(), 4));
  EXPECT_EQ(fresh->offset(), 4);
  EXPECT_EQ(contents(*fresh), captured);
}

// exposed_bytes bounds what writes add to the snapshots taken: over random writes, rewinds,
// restores, schedules and snapshots taken and dropped, a write never adds more bytes to the
// snapshots held than the exposure before it, and (making no capture) lowers the exposure by at
// least what it added. Recurrent snapshots own their state from the start: nothing is exposed.
TYPED_TEST(CacheContract, ExposedBytesBoundWhatWritesAddToSnapshots) {
  EXPECT_EQ(this->cache->exposed_bytes(0), 0);
  std::mt19937 rng(7);
  std::vector<SnapshotPtr> held;
  const auto held_bytes = [&] {
    int64_t total = 0;
    for (const SnapshotPtr& s : held) total += s == nullptr ? 0 : s->size();
    return total;
  };
  int64_t grew = 0, exposed = 0, rewinds_exposed = 0;
  this->write(3);
  for (int round = 0; round < 400; ++round) {
    const int64_t offset = this->cache->offset();
    const auto n = static_cast<int64_t>(1 + rng() % 4);
    bool capturing = false;
    switch (rng() % 6) {
      case 0:
        if (held.size() < 12) held.push_back(this->cache->snapshot(offset - rng() % (offset + 1)));
        break;
      case 1:
        if (!held.empty()) held.erase(held.begin() + rng() % held.size());
        break;
      case 2: {  // a live rewind where the kind allows one
        // exposed_bytes_after_rewind, read before, bounds what the rewind gives the snapshots
        // and what the writes after it may.
        const int64_t to = offset - rng() % 6 % (offset + 1);
        const int64_t reserved = this->cache->exposed_bytes_after_rewind(0, to);
        const int64_t before = held_bytes(), exposure = this->cache->exposed_bytes(0);
        if (this->cache->restore(nullptr, to)) {
          ASSERT_LE(held_bytes() - before + this->cache->exposed_bytes(0), reserved)
              << "round " << round;
          if (reserved > exposure) ++rewinds_exposed;
        }
        break;
      }
      case 3:  // back to a snapshot held
        if (!held.empty() && held.back() != nullptr) {
          (void)this->cache->restore(held.back().get(), held.back()->to());
        }
        break;
      case 4:  // captures inside the next write
        this->cache->prepare_snapshots(
            std::vector<int64_t>{offset + static_cast<int64_t>(rng() % (n + 1))});
        capturing = true;
        break;
      default:
        break;
    }
    const int64_t before = held_bytes(), exposure = this->cache->exposed_bytes(0);
    this->write(n);
    const int64_t added = held_bytes() - before;
    ASSERT_LE(added, exposure) << "round " << round;
    if (!capturing) {
      ASSERT_LE(added + this->cache->exposed_bytes(0), exposure) << "round " << round;
    }
    for (SnapshotPtr& capture : this->cache->take_snapshots()) held.push_back(std::move(capture));
    if (added > 0) ++grew;
    if (exposure > 0) ++exposed;
    if (held.size() > 8) held.erase(held.begin());
  }
  if (std::is_same_v<TypeParam, RecurrentKind>) {
    EXPECT_EQ(grew + exposed, 0);
  } else {
    EXPECT_GT(grew, 10);  // writes did copy into snapshots, within what was exposed
    EXPECT_GT(exposed, 20);
  }
  if (std::is_same_v<TypeParam, KVKind> || std::is_same_v<TypeParam, PagedKind>) {
    EXPECT_GT(rewinds_exposed, 5);  // rewinds that exposed more than the offset before them
  }
}

// Calls that fail, return false or change nothing leave no sequence behind: sequences() lists
// the sequences that hold state, and "changes nothing" includes the sequence table.
TYPED_TEST(CacheContract, CallsThatFailOrChangeNothingCreateNoSequence) {
  this->write(2);
  Cache& cache = *this->cache;
  const std::vector<SeqId> only_zero{0};
  EXPECT_FALSE(cache.restore(7, nullptr, 5));  // unreachable
  EXPECT_TRUE(cache.restore(8, nullptr, 0));   // already there: nothing to do
  EXPECT_TRUE(throws_error([&] { (void)cache.snapshot(9, 3); }, {"snapshot", "from_offset 3"}));
  EXPECT_EQ(cache.snapshot(9, 0), nullptr);
  const std::vector<int64_t> descending{3, 2};
  EXPECT_TRUE(throws_error([&] { cache.prepare_snapshots(11, descending); },
                           {"prepare_snapshots", "ascending"}));
  EXPECT_TRUE(cache.take_snapshots(12).empty());
  EXPECT_TRUE(cache.take_reached_snapshots(12).empty());
  std::vector<SnapshotPtr> into;
  cache.take_snapshots_into(12, into);
  EXPECT_TRUE(into.empty());
  cache.cancel_snapshots(13);
  cache.reset(13);
  // The largest id: no sequence (and no table of a million entries grown for it).
  EXPECT_FALSE(cache.restore((SeqId(1) << 20) - 1, nullptr, 1));
  EXPECT_EQ(cache.sequences(), only_zero);
  EXPECT_EQ(cache.offset(7), 0);
  // Ids out of range are still refused.
  EXPECT_TRUE(throws_error([&] { (void)cache.restore(SeqId(1) << 20, nullptr, 0); },
                           {"sequence id 1048576", "outside"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.take_snapshots(-1); }, {"sequence id -1"}));
  // A restore that gives a fresh sequence a state does create it.
  SnapshotPtr s = cache.snapshot(0);
  ASSERT_TRUE(cache.restore(3, s.get(), 2));
  EXPECT_EQ(cache.sequences(), (std::vector<SeqId>{0, 3}));
  EXPECT_EQ(cache.offset(3), 2);
  // So does a schedule prepared for one (it holds the schedule).
  const std::vector<int64_t> ahead{4};
  cache.prepare_snapshots(4, ahead);
  EXPECT_EQ(cache.sequences(), (std::vector<SeqId>{0, 3, 4}));
  cache.cancel_snapshots(4);
  if constexpr (std::is_base_of_v<Attention, typename TypeParam::Type>) {
    // An update's row of no tokens for a sequence not made: alone, and beside a row that writes.
    const std::vector<int64_t> none, next = id_range(2, 1);
    Attention& attention = *this->cache;
    (void)attention.update(Batch::rows({{.seq = 14, .offset = 0, .tokens = {}}}), kv.keys(none),
                           kv.values(none));
    const Batch mixed = Batch::rows(
        {{.seq = 0, .offset = 2, .tokens = {2}}, {.seq = 15, .offset = 0, .tokens = {}}});
    (void)attention.update(mixed, kv.keys(next, 2), kv.values(next, 2));
    EXPECT_EQ(cache.offset(0), 3);
    EXPECT_EQ(cache.sequences(), (std::vector<SeqId>{0, 3, 4}));
  }
}

// An empty schedule schedules nothing: it makes no sequence, leaves nothing to take and does
// not hold the cache still (while a schedule is pending it is refused like any other).
TYPED_TEST(CacheContract, AnEmptyScheduleSchedulesNothing) {
  this->write(2);
  Cache& cache = *this->cache;
  const std::vector<int64_t> none, ahead{3};
  cache.prepare_snapshots(none);
  cache.prepare_snapshots(5, none);
  EXPECT_EQ(cache.sequences(), std::vector<SeqId>{0});
  EXPECT_TRUE(cache.restore(nullptr, 2));  // not refused as "captures are scheduled"
  EXPECT_TRUE(cache.take_snapshots().empty());
  cache.prepare_snapshots(ahead);  // no earlier schedule waits to be taken
  EXPECT_TRUE(throws_error([&] { cache.prepare_snapshots(none); }, {"not taken"}));
  this->write(1);
  EXPECT_EQ(cache.take_snapshots().size(), 1u);
}

// Every call naming a sequence refuses an id outside [0, 2^20) with the same message, the calls
// that only read or would change nothing included.
TYPED_TEST(CacheContract, EveryCallNamingASequenceRefusesAnIdOutOfRange) {
  this->write(2);
  Cache& cache = *this->cache;
  const std::vector<int64_t> none;
  std::vector<SnapshotPtr> into;
  for (const SeqId id : {SeqId(-1), SeqId(1) << 20}) {
    const std::string rule = "sequence id " + std::to_string(id) + " outside [0, 1048576)";
    const auto refused = [&](auto&& call) { return throws_error(call, {rule.c_str()}); };
    EXPECT_TRUE(refused([&] { (void)cache.offset(id); }));
    EXPECT_TRUE(refused([&] { (void)cache.state(id); }));
    EXPECT_TRUE(refused([&] { (void)cache.exposed_bytes(id); }));
    EXPECT_TRUE(refused([&] { cache.reset(id); }));
    EXPECT_TRUE(refused([&] { (void)cache.snapshot(id, 0); }));
    EXPECT_TRUE(refused([&] { cache.prepare_snapshots(id, none); }));
    EXPECT_TRUE(refused([&] { cache.cancel_snapshots(id); }));
    EXPECT_TRUE(refused([&] { (void)cache.take_snapshots(id); }));
    EXPECT_TRUE(refused([&] { (void)cache.take_reached_snapshots(id); }));
    EXPECT_TRUE(refused([&] { cache.take_snapshots_into(id, into); }));
    EXPECT_TRUE(refused([&] { (void)cache.restore(id, nullptr, 0); }));
    EXPECT_TRUE(refused([&] { (void)cache.schedule_state(id); }));
    if constexpr (std::is_same_v<typename TypeParam::Type, KVCache>) {
      EXPECT_TRUE(refused([&] { (void)this->cache->lazy_bytes(id, 0, 2); }));
    }
    if constexpr (std::is_same_v<typename TypeParam::Type, RecurrentCache>) {
      EXPECT_TRUE(refused([&] { (void)this->cache->snapshot_splits(id, 2); }));
    }
  }
  EXPECT_EQ(cache.sequences(), std::vector<SeqId>{0});
  EXPECT_EQ(cache.offset(), 2);
}

// A batch whose second row is misplaced: the refusal names that row and its sequence, and the
// first row's new sequence is not created.
TYPED_TEST(CacheContract, RefusedBatchNamesTheRowAndCreatesNoSequence) {
  this->write(2);
  const std::vector<SeqId> only_zero{0};
  const Batch batch = Batch::rows({{5, 0, {1, 1}}, {0, 7, {1, 1}}});
  if constexpr (std::is_base_of_v<Attention, typename TypeParam::Type>) {
    Attention& cache = *this->cache;
    const std::vector<int64_t> ids = id_range(20, 2);
    EXPECT_TRUE(throws_error([&] { (void)cache.update(batch, kv.keys(ids, 2), kv.values(ids, 2)); },
                             {"::update", "row 1 starts at 7", "its sequence 0 is at offset 2"}));
  } else {
    RecurrentCache& cache = *this->cache;
    EXPECT_TRUE(throws_error([&] { (void)cache.get(batch, DType::f32); },
                             {"RecurrentCache::get", "row 1 starts at 7", "sequence 0"}));
    // Both rows placed, but row 1's sequence holds f32 state: refused before row 0's sequence
    // gets one.
    const Batch placed = Batch::rows({{5, 0, {1, 1}}, {0, 2, {1, 1}}});
    EXPECT_TRUE(throws_error([&] { (void)cache.get(placed, DType::f16); },
                             {"RecurrentCache::get", "activation dtype f16", "sequence 0"}));
  }
  EXPECT_EQ(this->cache->sequences(), only_zero);
  EXPECT_EQ(this->cache->offset(), 2);
}

// A view checks its batch as update does: a row count the ids do not match, or a sequence twice,
// is refused naming the call (not read past the ids' end); a batch without rows views sequence 0.
TYPED_TEST(CacheContract, ViewRefusesABatchUpdateWouldRefuse) {
  if constexpr (std::is_base_of_v<Attention, typename TypeParam::Type>) {
    this->write(2);
    const Attention& cache = *this->cache;
    Batch short_ids = Batch::uniform(3, 1, 0);
    short_ids.seq_ids = {2};
    EXPECT_TRUE(
        throws_error([&] { (void)cache.view(short_ids); }, {"::view", "1 seq_ids for 3 rows"}));
    const Batch twice = Batch::rows({{1, 0, {1}}, {1, 0, {1}}});
    EXPECT_TRUE(throws_error([&] { (void)cache.view(twice); }, {"::view", "both sequence 1"}));
    EXPECT_EQ(cache.view(Batch{}).length(), 2);
    EXPECT_EQ(this->cache->sequences(), std::vector<SeqId>{0});
  }
}

// A sequence is one batch row. A file or a store can hold a KV record of more; a restore of one
// is refused, naming the call and the rows, and changes nothing (a fresh sequence takes no
// layout from it).
TEST(CacheContractRows, ARestoreOfASnapshotOfTwoRowsIsRefused) {
  const testing::TokenKV kv;
  const std::vector<int64_t> ids = id_range(0, 3);
  const Array keys = kv.keys(ids, 2), values = kv.values(ids, 2);
  struct Case {
    std::unique_ptr<Attention> cache;
    SnapshotPtr snapshot;
    const char* call;
  };
  Case cases[3];
  cases[0] = {std::make_unique<KVCache>(), detail::make_kv_snapshot(keys, values, 0),
              "KVCache::restore"};
  cases[1] = {std::make_unique<PagedKVCache>(PagedKVCache::Options{}),
              detail::make_kv_snapshot(keys, values, 0), "PagedKVCache::restore"};
  cases[2] = {std::make_unique<RotatingKVCache>(8),
              detail::make_rotating_snapshot(keys, values, 3, 8), "RotatingKVCache::restore"};
  for (Case& c : cases) {
    EXPECT_TRUE(throws_error([&] { (void)c.cache->restore(0, c.snapshot.get(), 3); },
                             {c.call, "the snapshot holds 2 batch rows", "one row (B=1)"}));
    EXPECT_EQ(c.cache->offset(0), 0);
    (void)testing::write(*c.cache, testing::TokenKV{.heads = 4}, ids);  // takes any layout
    EXPECT_EQ(c.cache->offset(0), 3) << c.call;
  }
}

}  // namespace
}  // namespace kvsnap::cache_contract_test
