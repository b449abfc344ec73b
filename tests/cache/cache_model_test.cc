// Randomized model-based tests: long random sequences of cache operations (updates of random
// chunk sizes, snapshots, scheduled captures, restores, merges, splits, resets, dropping
// snapshots in random order) checked after every step against a naive reference that keeps
// the full token history. Attention (or recurrent) outputs must equal recomputation, every
// snapshot must restore exactly what it captured, and no array bytes may leak.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <memory>
#include <random>

#include "support/cache_support.h"
#include "support/recurrent_support.h"
#include "support/test_support.h"

namespace kvsnap::cache_model_test {
namespace {

using testing::all_close;
using testing::id_range;
using testing::TokenKV;

using Ids = std::vector<int64_t>;
const TokenKV kv{.heads = 2, .depth = 4};
constexpr int64_t kWindow = 6;

Ids prefix(const Ids& ids, int64_t length) { return Ids(ids.begin(), ids.begin() + length); }

// What a snapshot in the pool should hold. KV kinds: the ids of [from, to). Whole-state kinds:
// the ids of [0, to) at capture time (the state they determine).
struct Expected {
  SnapshotPtr snapshot;
  int64_t from = 0, to = 0;
  Ids ids;
};

// One cache kind's behaviour and its reference.
class Model {
 public:
  virtual ~Model() = default;
  virtual Cache& cache() = 0;
  // Writes `chunk` and checks the outputs against recomputation over `ids` (already extended).
  virtual void write(const Ids& ids, const Ids& chunk, std::mt19937& rng) = 0;
  // Checks the live state against the reference ids.
  virtual void check_state(const Ids& ids) = 0;
  virtual bool kv_ranges() const = 0;  // KV snapshots span edges; others are whole states
  // Whether restore(snapshot-or-null, target) must succeed, and the ids after it.
  virtual bool reachable(const Expected* s, int64_t target, const Ids& ids) const = 0;
  // Checks that `s` holds exactly what it should by restoring it into a fresh cache.
  virtual void check_snapshot(const Expected& s) = 0;
  // Whether the kind keeps tokens in buffers that grow (long writes then test the growth).
  virtual bool grows() const { return true; }
  // Bytes `s` holds once wholly owned; -1 when the kind does not say (shared states).
  virtual int64_t full_bytes(const Expected&) const { return -1; }
};

// Keys and values of one token.
constexpr int64_t kTokenBytes = 2 * (2 * 4 * 4);

// Writes `chunk` (the end of `ids`) through an attention cache and checks the chunk's attention
// against recomputing it over every id with the `logical` mask.
void write_and_check(Attention& cache, const Ids& ids, const Ids& chunk, std::mt19937& rng,
                     const AttentionMask& logical) {
  const auto start = static_cast<int64_t>(ids.size() - chunk.size());
  const auto length = static_cast<int64_t>(chunk.size());
  const Batch batch = Batch::uniform(1, length, start);
  const Array q = testing::random_array({1, 2, length, kv.depth}, rng);
  const KVHistory history = cache.update(batch, kv.keys(chunk), kv.values(chunk));
  const KVHistory full(kv.keys(ids), kv.values(ids));
  ASSERT_TRUE(all_close(sdpa(batch, q, history, AttentionMask::causal(), 0.5f),
                        sdpa(batch, q, full, logical, 0.5f), 1e-5f));
}

class KVModel final : public Model {
 public:
  Cache& cache() override { return cache_; }
  void write(const Ids& ids, const Ids& chunk, std::mt19937& rng) override {
    write_and_check(cache_, ids, chunk, rng, AttentionMask::causal());
  }
  void check_state(const Ids& ids) override {
    ASSERT_EQ(testing::column_ids(cache_.view(Batch{})), ids);
  }
  bool kv_ranges() const override { return true; }
  bool reachable(const Expected* s, int64_t target, const Ids& ids) const override {
    const auto offset = static_cast<int64_t>(ids.size());
    if (s == nullptr) return target >= 0 && target <= offset;
    return target >= 0 && target <= s->to && offset >= s->from;
  }
  void check_snapshot(const Expected& s) override {
    KVCache fresh;
    const Ids filler = id_range(900000, s.from);
    if (s.from > 0) testing::write(fresh, kv, filler);
    ASSERT_TRUE(fresh.restore(s.snapshot.get(), s.to));
    Ids expected = filler;
    expected.insert(expected.end(), s.ids.begin(), s.ids.end());
    ASSERT_EQ(testing::column_ids(fresh.view(Batch{})), expected);
  }
  int64_t full_bytes(const Expected& s) const override { return (s.to - s.from) * kTokenBytes; }

 private:
  KVCache cache_;
};

// The paged kind against the same reference as KVCache; its snapshots are also checked by
// restoring them into a KVCache (a copy) and into a fresh paged cache.
class PagedModel final : public Model {
 public:
  Cache& cache() override { return cache_; }
  void write(const Ids& ids, const Ids& chunk, std::mt19937& rng) override {
    write_and_check(cache_, ids, chunk, rng, AttentionMask::causal());
  }
  void check_state(const Ids& ids) override {
    ASSERT_EQ(testing::column_ids(cache_.view(Batch{}).contiguous()), ids);
  }
  bool kv_ranges() const override { return true; }
  bool reachable(const Expected* s, int64_t target, const Ids& ids) const override {
    return kv_.reachable(s, target, ids);
  }
  void check_snapshot(const Expected& s) override {
    kv_.check_snapshot(s);
    PagedKVCache fresh({.block_tokens = 3});
    const Ids filler = id_range(900000, s.from);
    if (s.from > 0) testing::write(fresh, kv, filler);
    ASSERT_TRUE(fresh.restore(s.snapshot.get(), s.to));
    Ids expected = filler;
    expected.insert(expected.end(), s.ids.begin(), s.ids.end());
    ASSERT_EQ(testing::column_ids(fresh.view(Batch{}).contiguous()), expected);
  }

 private:
  PagedKVCache cache_{{.block_tokens = 3, .blocks_per_chunk = 4}};
  KVModel kv_;
};

// A window of `Window` tokens: a small one wraps often; one past RotatingKVCache's growth step
// (256) grows its ring while snapshots are outstanding.
template <int64_t Window>
class RotatingModelOf final : public Model {
 public:
  Cache& cache() override { return cache_; }
  void write(const Ids& ids, const Ids& chunk, std::mt19937& rng) override {
    write_and_check(cache_, ids, chunk, rng, AttentionMask::sliding_window(Window));
  }
  void check_state(const Ids& ids) override { check_window(cache_, ids); }
  static void check_window(const RotatingKVCache& cache, const Ids& ids) {
    // A contiguous run of positions ending at the offset, holding at least the window the next
    // token needs, each with the right token.
    const auto held = testing::position_ids(cache.view(Batch{}));
    const auto offset = static_cast<int64_t>(ids.size());
    ASSERT_GE(static_cast<int64_t>(held.size()), std::min(offset, Window - 1));
    for (size_t i = 0; i < held.size(); ++i) {
      const int64_t position = offset - static_cast<int64_t>(held.size()) + static_cast<int64_t>(i);
      ASSERT_EQ(held[i].first, position);
      ASSERT_EQ(held[i].second, ids[static_cast<size_t>(position)]);
    }
  }
  bool kv_ranges() const override { return false; }
  bool reachable(const Expected* s, int64_t target, const Ids& ids) const override {
    const auto offset = static_cast<int64_t>(ids.size());
    if (s == nullptr) return offset <= Window && target >= 0 && target <= offset;
    return target == s->to || (target >= 0 && target < s->to && s->to <= Window);
  }
  void check_snapshot(const Expected& s) override {
    RotatingKVCache fresh(Window);
    ASSERT_TRUE(fresh.restore(s.snapshot.get(), s.to));
    check_window(fresh, s.ids);
  }
  int64_t full_bytes(const Expected& s) const override {
    return (s.to <= Window ? s.to : Window - 1) * kTokenBytes;
  }

 private:
  RotatingKVCache cache_{Window};
};

using RotatingModel = RotatingModelOf<kWindow>;

class RecurrentModel final : public Model {
 public:
  Cache& cache() override { return cache_; }
  void write(const Ids& ids, const Ids& chunk, std::mt19937&) override {
    const auto start = static_cast<int64_t>(ids.size() - chunk.size());
    const auto out = layer_.forward(cache_, chunk);
    const auto expected = layer_.reference(ids);
    const auto end = static_cast<int64_t>(ids.size());
    ASSERT_TRUE(all_close(out.delta, expected.delta.slice(1, start, end), 1e-4f));
    ASSERT_TRUE(all_close(out.conv, expected.conv.slice(1, start, end), 1e-5f));
  }
  void check_state(const Ids& ids) override { check_recurrent(cache_, ids); }
  void check_recurrent(const RecurrentCache& cache, const Ids& ids) const {
    if (ids.empty()) return;
    std::pair<Array, Array> expected;
    layer_.reference(ids, &expected);
    ASSERT_FALSE(cache.state().empty());
    ASSERT_TRUE(all_close(cache.state()[0], expected.first, 1e-5f));
    ASSERT_TRUE(all_close(cache.state()[1], expected.second, 1e-4f));
  }
  bool kv_ranges() const override { return false; }
  bool grows() const override { return false; }  // fixed-size states
  bool reachable(const Expected* s, int64_t target, const Ids& ids) const override {
    if (s == nullptr) return target == static_cast<int64_t>(ids.size());
    return target == s->to;
  }
  void check_snapshot(const Expected& s) override {
    RecurrentCache fresh = layer_.make_cache();
    ASSERT_TRUE(fresh.restore(s.snapshot.get(), s.to));
    check_recurrent(fresh, s.ids);
  }

 private:
  testing::RecurrentLayer layer_;
  RecurrentCache cache_ = layer_.make_cache();
};

// How often the interesting paths ran, so the test cannot pass by never reaching them.
struct Coverage {
  int64_t restores = 0, snapshot_restores = 0, failed_restores = 0, merges = 0, splits = 0,
          materialized = 0;
  Coverage& operator+=(const Coverage& c) {
    restores += c.restores;
    snapshot_restores += c.snapshot_restores;
    failed_restores += c.failed_restores;
    merges += c.merges;
    splits += c.splits;
    materialized += c.materialized;
    return *this;
  }
};

class Driver {
 public:
  Driver(Model& model, uint32_t seed) : model_(model), rng_(seed) {}

  void run(int steps) {
    for (int step = 0; step < steps; ++step) {
      const int action = static_cast<int>(rng_() % 16);
      if (action < 5) {
        write_random();
      } else if (action < 7) {
        take_snapshot();
      } else if (action < 9) {
        scheduled_captures();
      } else if (action < 12) {
        restore();
      } else if (action == 12) {
        merge();
      } else if (action == 13) {
        split();
      } else if (action == 14) {
        drop();
      } else if (rng_() % 4 == 0) {
        model_.cache().reset();
        ids_.clear();
      }
      if (::testing::Test::HasFatalFailure()) return;
      model_.check_state(ids_);
      ASSERT_EQ(model_.cache().offset(), static_cast<int64_t>(ids_.size()));
      // A snapshot holds at most its tokens' bytes (exactly them once nothing is lazy); the
      // parts still lazy are copied out only as writes overwrite them.
      for (const Expected& e : pool_) {
        const int64_t full = model_.full_bytes(e);
        if (e.snapshot == nullptr || full < 0) continue;
        ASSERT_LE(e.snapshot->size(), full);
        if (!e.snapshot->is_lazy()) {
          ASSERT_EQ(e.snapshot->size(), full);
        }
      }
      if (::testing::Test::HasFatalFailure()) return;
    }
    for (const Expected& e : pool_) {
      model_.check_snapshot(e);
      if (e.snapshot->size() > 0 && model_.full_bytes(e) > 0) ++coverage_.materialized;
    }
  }

  const Coverage& coverage() const { return coverage_; }

 private:
  int64_t offset() const { return static_cast<int64_t>(ids_.size()); }
  int64_t random(int64_t below) { return below <= 0 ? 0 : static_cast<int64_t>(rng_() % below); }

  void write(int64_t length) {
    Ids chunk;
    for (int64_t i = 0; i < length; ++i) chunk.push_back(next_id_++);
    ids_.insert(ids_.end(), chunk.begin(), chunk.end());
    model_.write(ids_, chunk, rng_);
  }
  // Mostly short writes; now and then a long one, so that buffers grow past their first
  // capacity (256 tokens) with snapshots outstanding.
  void write_random() {
    const bool long_one = model_.grows() && rng_() % 40 == 0;
    write(long_one ? 100 + random(200) : rng_() % 3 == 0 ? 1 : 1 + random(12));
  }

  void remember(SnapshotPtr snapshot, int64_t from, int64_t to) {
    if (snapshot == nullptr) return;  // nothing held
    Ids ids = model_.kv_ranges() ? Ids(ids_.begin() + from, ids_.begin() + to) : prefix(ids_, to);
    pool_.push_back({std::move(snapshot), from, to, std::move(ids)});
  }

  void take_snapshot() {
    const int64_t from = random(offset() + 1);
    SnapshotPtr s = model_.cache().snapshot(from);
    if (model_.kv_ranges()) {
      ASSERT_EQ(s == nullptr, from == offset());
      remember(std::move(s), from, offset());
    } else {
      ASSERT_EQ(s == nullptr, offset() == 0);
      remember(std::move(s), offset(), offset());
    }
  }

  void scheduled_captures() {
    std::vector<int64_t> offsets;
    int64_t next = offset() + random(3);
    const int64_t count = 1 + random(4);
    for (int64_t i = 0; i < count; ++i) {
      offsets.push_back(next);
      next += 1 + random(6);
    }
    const int64_t start = offset();
    model_.cache().prepare_snapshots(offsets);
    while (offset() < offsets.back()) write(1 + random(offsets.back() - offset() + 2));
    std::vector<SnapshotPtr> captures = model_.cache().take_snapshots();
    ASSERT_EQ(captures.size(), offsets.size());
    // Remember them with the ids they were captured at: `ids_` may run past the last offset.
    int64_t edge = start;
    for (size_t i = 0; i < captures.size(); ++i) {
      const int64_t at = offsets[i];
      if (model_.kv_ranges()) {
        ASSERT_EQ(captures[i] == nullptr, at == edge);
        if (captures[i] != nullptr) {
          ASSERT_EQ(captures[i]->from(), edge);
          ASSERT_EQ(captures[i]->to(), at);
        }
        remember(std::move(captures[i]), edge, at);
      } else {
        ASSERT_EQ(captures[i] == nullptr, at == 0);
        if (captures[i] != nullptr) {
          ASSERT_EQ(captures[i]->to(), at);
        }
        remember(std::move(captures[i]), at, at);
      }
      edge = at;
    }
  }

  void restore() {
    Expected* s = pool_.empty() || rng_() % 4 == 0 ? nullptr : &pool_[random(pool_.size())];
    const int64_t end = s != nullptr ? s->to : offset();
    int64_t target;
    switch (rng_() % 4) {
      case 0:
        target = end;
        break;
      case 1:
        target = end - 1;
        break;
      case 2:
        target = end + 1;
        break;
      default:
        target = random(end + 1);
        break;
    }
    const bool expected = model_.reachable(s, target, ids_);
    const Ids before = ids_;
    const bool got = model_.cache().restore(s != nullptr ? s->snapshot.get() : nullptr, target);
    ASSERT_EQ(got, expected) << "target " << target << " end " << end;
    ++(got ? coverage_.restores : coverage_.failed_restores);
    if (!got) return;
    if (s != nullptr) ++coverage_.snapshot_restores;
    if (s == nullptr) {
      ids_.resize(static_cast<size_t>(target));
    } else if (model_.kv_ranges()) {
      if (target > s->from) {
        ids_.resize(static_cast<size_t>(s->from));
        ids_.insert(ids_.end(), s->ids.begin(), s->ids.begin() + (target - s->from));
      } else {
        ids_.resize(static_cast<size_t>(target));
      }
    } else {
      ids_ = prefix(s->ids, target);
    }
  }

  void merge() {
    if (pool_.size() < 2) return;
    size_t parent_index = random(pool_.size()), child_index = random(pool_.size());
    if (model_.kv_ranges()) {  // prefer an adjacent pair when there is one
      for (size_t i = 0; i < pool_.size(); ++i)
        for (size_t j = 0; j < pool_.size(); ++j)
          if (i != j && pool_[i].to == pool_[j].from && rng_() % 2 == 0) {
            parent_index = i;
            child_index = j;
          }
    }
    if (parent_index == child_index) return;
    Expected parent = std::move(pool_[parent_index]);
    Expected child = std::move(pool_[child_index]);
    pool_.erase(pool_.begin() + static_cast<std::ptrdiff_t>(std::max(parent_index, child_index)));
    pool_.erase(pool_.begin() + static_cast<std::ptrdiff_t>(std::min(parent_index, child_index)));
    if (model_.kv_ranges() && parent.to != child.from) {
      EXPECT_THROW(
          (void)model_.cache().merge(std::move(parent.snapshot), std::move(child.snapshot)), Error);
      return;
    }
    SnapshotPtr merged =
        model_.cache().merge(std::move(parent.snapshot), std::move(child.snapshot));
    ASSERT_NE(merged, nullptr);
    ++coverage_.merges;
    if (model_.kv_ranges()) {
      Ids joined = parent.ids;
      joined.insert(joined.end(), child.ids.begin(), child.ids.end());
      ASSERT_EQ(merged->from(), parent.from);
      ASSERT_EQ(merged->to(), child.to);
      pool_.push_back({std::move(merged), parent.from, child.to, std::move(joined)});
    } else {
      pool_.push_back({std::move(merged), child.from, child.to, std::move(child.ids)});
    }
  }

  void split() {
    if (pool_.empty()) return;
    Expected whole = take(random(pool_.size()));
    const int64_t at = whole.from - 1 + random(whole.to - whole.from + 3);
    if (model_.kv_ranges() && (at < whole.from || at > whole.to)) {  // refused (and consumed)
      EXPECT_THROW((void)model_.cache().split(std::move(whole.snapshot), at), Error);
      return;
    }
    auto [before, after] = model_.cache().split(std::move(whole.snapshot), at);
    if (!model_.kv_ranges()) {
      ASSERT_EQ(before, nullptr);
      pool_.push_back({std::move(after), whole.from, whole.to, std::move(whole.ids)});
      return;
    }
    if (at <= whole.from) {
      ASSERT_EQ(before, nullptr);
      pool_.push_back({std::move(after), whole.from, whole.to, std::move(whole.ids)});
    } else if (at >= whole.to) {
      ASSERT_EQ(after, nullptr);
      pool_.push_back({std::move(before), whole.from, whole.to, std::move(whole.ids)});
    } else {
      ++coverage_.splits;
      const auto cut = static_cast<size_t>(at - whole.from);
      ASSERT_EQ(before->to(), at);
      ASSERT_EQ(after->from(), at);
      pool_.push_back(
          {std::move(before), whole.from, at, Ids(whole.ids.begin(), whole.ids.begin() + cut)});
      pool_.push_back(
          {std::move(after), at, whole.to, Ids(whole.ids.begin() + cut, whole.ids.end())});
    }
  }

  void drop() {
    if (!pool_.empty()) take(random(pool_.size()));
  }

  Expected take(size_t index) {
    Expected e = std::move(pool_[index]);
    pool_.erase(pool_.begin() + static_cast<std::ptrdiff_t>(index));
    return e;
  }

  Model& model_;
  std::mt19937 rng_;
  Ids ids_;
  int64_t next_id_ = 1;
  std::vector<Expected> pool_;
  Coverage coverage_;
};

template <class M>
Coverage run_many(int sequences, int steps) {
  Coverage total;
  sequences = testing::for_each_seed(sequences, [&](uint32_t seed) {
    M model;
    Driver driver(model, seed);
    driver.run(steps);
    total += driver.coverage();
  });
  EXPECT_GT(total.restores, sequences);
  EXPECT_GT(total.snapshot_restores, sequences / 2);  // not only rewinds
  EXPECT_GT(total.failed_restores, sequences / 4);
  EXPECT_GT(total.merges, sequences / 4);
  return total;
}

TEST(CacheModel, KVCacheMatchesTheReference) {
  const Coverage c = run_many<KVModel>(1000, 40);
  EXPECT_GT(c.splits, 100);        // interior splits of KV ranges
  EXPECT_GT(c.materialized, 100);  // lazy snapshots that were copied out along the way
}
TEST(CacheModel, PagedKVCacheMatchesTheReference) {
  const Coverage c = run_many<PagedModel>(600, 40);
  EXPECT_GT(c.splits, 50);
}
TEST(CacheModel, RotatingKVCacheMatchesTheReference) {
  const Coverage c = run_many<RotatingModel>(1000, 40);
  EXPECT_GT(c.materialized, 100);
}
TEST(CacheModel, RotatingKVCacheOfALargeWindowMatchesTheReference) {
  run_many<RotatingModelOf<300>>(300, 40);
}
TEST(CacheModel, RecurrentCacheMatchesTheReference) { run_many<RecurrentModel>(1000, 40); }

}  // namespace
}  // namespace kvsnap::cache_model_test
