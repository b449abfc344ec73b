// Randomized model-based tests of one cache serving several sequences: long random runs of
// heterogeneous batched writes (rows of different sequences, offsets and lengths in one update),
// snapshots of one sequence restored into another, captures scheduled inside batched writes,
// merges of snapshots taken from different sequences, splits, resets of one sequence and drops,
// checked after every step against a naive reference — each sequence's full token history.
// Every row's attention must equal recomputation over its own sequence alone, every sequence
// must hold exactly its tokens (a write into a block or buffer another sequence or a snapshot
// shares must not show there), every snapshot must restore exactly what it captured, and no
// array bytes may leak.
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <memory>
#include <random>

#include "support/cache_support.h"
#include "support/test_support.h"

namespace kvsnap::sequences_model_test {
namespace {

using testing::all_close;
using testing::id_range;
using testing::TokenKV;

using Ids = std::vector<int64_t>;
const TokenKV kv{.heads = 2, .depth = 4};
constexpr int64_t kWindow = 6;
constexpr SeqId kSequences = 3;

Ids prefix(const Ids& ids, int64_t length) { return Ids(ids.begin(), ids.begin() + length); }

// What a snapshot in the pool should hold. KV kinds: the ids of [from, to). Windows: the ids of
// [0, to) of the sequence it was taken from (the state they determine).
struct Expected {
  SnapshotPtr snapshot;
  int64_t from = 0, to = 0;
  Ids ids;
  SeqId origin = -1;  // the sequence it was taken from; -1: parts of several
};

// A single-row batch viewing sequence `seq`.
Batch view_of(SeqId seq) {
  Batch batch = Batch::uniform(1, 1, 0);
  batch.seq_ids = {seq};
  return batch;
}

// One attention cache kind over several sequences, and the rules of its reference.
class Model {
 public:
  virtual ~Model() = default;
  virtual Attention& cache() = 0;
  virtual AttentionMask logical() const = 0;  // the mask recomputation applies
  virtual bool kv_ranges() const = 0;         // KV snapshots span edges; windows are whole
  virtual bool reachable(const Expected* s, int64_t target, const Ids& ids) const = 0;
  virtual std::unique_ptr<Attention> fresh() const = 0;  // a new cache of the kind
  virtual int64_t blocks_copied() const { return 0; }    // paged: shared blocks copied
  // Paged: the bytes of the blocks only snapshots hold, which they pay for once between them
  // (the sum of their sizes); -1 elsewhere.
  virtual int64_t snapshot_only_bytes() const { return -1; }

  // Checks sequence `seq` of `cache` against its reference ids.
  void check_sequence(const Attention& cache, SeqId seq, const Ids& ids) const {
    const KVHistory history = cache.view(view_of(seq));
    if (kv_ranges()) {
      ASSERT_EQ(testing::column_ids(history), ids) << "sequence " << seq;
      return;
    }
    // A window: a contiguous run of positions ending at the offset, holding at least what the
    // next token needs, each with the right token.
    const auto held = testing::position_ids(history);
    const auto offset = static_cast<int64_t>(ids.size());
    ASSERT_GE(static_cast<int64_t>(held.size()), std::min(offset, kWindow - 1)) << seq;
    for (size_t i = 0; i < held.size(); ++i) {
      const int64_t position = offset - static_cast<int64_t>(held.size()) + static_cast<int64_t>(i);
      ASSERT_EQ(held[i].first, position) << "sequence " << seq;
      ASSERT_EQ(held[i].second, ids[static_cast<size_t>(position)]) << "sequence " << seq;
    }
  }
};

// The KV kinds' rules: causal attention over every token; a snapshot of [from, to) restores
// any target up to `to` into a sequence holding at least `from` tokens.
class KVRangesModel : public Model {
 public:
  AttentionMask logical() const override { return AttentionMask::causal(); }
  bool kv_ranges() const override { return true; }
  bool reachable(const Expected* s, int64_t target, const Ids& ids) const override {
    const auto offset = static_cast<int64_t>(ids.size());
    if (s == nullptr) return target >= 0 && target <= offset;
    return target >= 0 && target <= s->to && offset >= s->from;
  }
};

class KVModel final : public KVRangesModel {
 public:
  Attention& cache() override { return cache_; }
  std::unique_ptr<Attention> fresh() const override { return std::make_unique<KVCache>(); }

 private:
  KVCache cache_;
};

class PagedModel final : public KVRangesModel {
 public:
  Attention& cache() override { return cache_; }
  std::unique_ptr<Attention> fresh() const override {
    return std::make_unique<PagedKVCache>(PagedKVCache::Options{.block_tokens = 3});
  }
  int64_t blocks_copied() const override { return cache_.pool_stats().blocks_copied; }
  int64_t snapshot_only_bytes() const override {
    const PagedKVCache::PoolStats stats = cache_.pool_stats();
    return stats.bytes_in_use - stats.live_bytes;
  }

 private:
  PagedKVCache cache_{{.block_tokens = 3, .blocks_per_chunk = 4}};
};

class RotatingModel final : public Model {
 public:
  Attention& cache() override { return cache_; }
  AttentionMask logical() const override { return AttentionMask::sliding_window(kWindow); }
  bool kv_ranges() const override { return false; }
  bool reachable(const Expected* s, int64_t target, const Ids& ids) const override {
    const auto offset = static_cast<int64_t>(ids.size());
    if (s == nullptr) return offset <= kWindow && target >= 0 && target <= offset;
    return target == s->to || (target >= 0 && target < s->to && s->to <= kWindow);
  }
  std::unique_ptr<Attention> fresh() const override {
    return std::make_unique<RotatingKVCache>(kWindow);
  }

 private:
  RotatingKVCache cache_{kWindow};
};

// How often the interesting paths ran, so the test cannot pass by never reaching them.
struct Coverage {
  int64_t mixed_batches = 0;     // updates with rows of different lengths or offsets
  int64_t crossed_restores = 0;  // a snapshot of one sequence restored into another
  int64_t crossed_merges = 0;    // snapshots of two sequences merged
  int64_t batched_captures = 0;  // scheduled captures reached inside a batched write
  int64_t failed_restores = 0, splits = 0, blocks_copied = 0;
  Coverage& operator+=(const Coverage& c) {
    mixed_batches += c.mixed_batches;
    crossed_restores += c.crossed_restores;
    crossed_merges += c.crossed_merges;
    batched_captures += c.batched_captures;
    failed_restores += c.failed_restores;
    splits += c.splits;
    blocks_copied += c.blocks_copied;
    return *this;
  }
};

class Driver {
 public:
  Driver(Model& model, uint32_t seed) : model_(model), rng_(seed), ids_(kSequences) {}

  void run(int steps) {
    for (int step = 0; step < steps && !::testing::Test::HasFatalFailure(); ++step) {
      const int action = static_cast<int>(rng_() % 16);
      if (action < 6) {
        batched_write({});
      } else if (action < 8) {
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
      } else {
        const auto seq = static_cast<SeqId>(random(kSequences));
        model_.cache().reset(seq);
        ids_[static_cast<size_t>(seq)].clear();
      }
      check_all();
    }
    for (const Expected& e : pool_) {
      if (::testing::Test::HasFatalFailure()) return;
      check_snapshot(e);
    }
  }

  const Coverage& coverage() const { return coverage_; }

 private:
  int64_t offset(SeqId seq) const { return static_cast<int64_t>(ids(seq).size()); }
  Ids& ids(SeqId seq) { return ids_[static_cast<size_t>(seq)]; }
  const Ids& ids(SeqId seq) const { return ids_[static_cast<size_t>(seq)]; }
  int64_t random(int64_t below) { return below <= 0 ? 0 : static_cast<int64_t>(rng_() % below); }

  void check_all() {
    for (SeqId seq = 0; seq < kSequences && !::testing::Test::HasFatalFailure(); ++seq) {
      model_.check_sequence(model_.cache(), seq, ids(seq));
      ASSERT_EQ(model_.cache().offset(seq), offset(seq)) << "sequence " << seq;
    }
    if (const int64_t owed = model_.snapshot_only_bytes(); owed >= 0) {
      int64_t paid = 0;
      for (const Expected& e : pool_) paid += e.snapshot->size();
      ASSERT_EQ(paid, owed) << "the snapshots' sizes against the blocks only they hold";
    }
  }

  // One update over a random set of sequences, each row its own length; `rows` may name a first
  // row (a scheduled capture's sequence and its length). Checks every row's attention against
  // recomputation over its sequence alone.
  void batched_write(std::vector<std::pair<SeqId, int64_t>> rows) {
    for (SeqId seq = 0; seq < kSequences; ++seq) {
      const bool fixed = !rows.empty() && rows.front().first == seq;
      if (!fixed && rng_() % 2 == 0) {
        rows.emplace_back(seq, rng_() % 3 == 0 ? 1 : 1 + random(8));
      }
    }
    if (rows.empty()) rows.emplace_back(static_cast<SeqId>(random(kSequences)), 1);
    std::vector<Batch::Chunk> chunks;
    std::vector<Ids> written;
    int64_t longest = 0;
    for (const auto& [seq, length] : rows) {
      Ids chunk = id_range(next_id_, length);
      next_id_ += length;
      chunks.push_back({seq, offset(seq), std::vector<int32_t>(chunk.begin(), chunk.end())});
      written.push_back(chunk);
      longest = std::max(longest, length);
    }
    for (Ids& chunk : written) chunk.resize(static_cast<size_t>(longest), 0);  // padding
    const Batch batch = Batch::rows(chunks);
    for (size_t r = 1; r < rows.size(); ++r) {
      if (batch.seq_query_lens[r] != batch.seq_query_lens[0] ||
          batch.seq_offsets[r] != batch.seq_offsets[0]) {
        ++coverage_.mixed_batches;
        break;
      }
    }
    const auto b = static_cast<int64_t>(rows.size());
    const Array q = testing::random_array({b, 2, longest, kv.depth}, rng_);
    const KVHistory history =
        model_.cache().update(batch, kv.stacked(written, true), kv.stacked(written, false));
    for (size_t r = 0; r < rows.size(); ++r) {
      Ids& held = ids(rows[r].first);
      held.insert(held.end(), chunks[r].tokens.begin(), chunks[r].tokens.end());
    }
    const Array got = sdpa(batch, q, history, AttentionMask::causal(), 0.5f);
    for (int64_t r = 0; r < b; ++r) {
      const Ids& full = ids(rows[static_cast<size_t>(r)].first);
      const KVHistory alone(kv.keys(full), kv.values(full));
      const int64_t real = rows[static_cast<size_t>(r)].second;
      const Array expected =
          sdpa(batch.row(r), q.slice(0, r, r + 1), alone, model_.logical(), 0.5f);
      ASSERT_TRUE(all_close(got.slice(0, r, r + 1).slice(2, 0, real).contiguous(),
                            expected.slice(2, 0, real).contiguous(), 1e-5f))
          << "row " << r << " of " << b << ", sequence " << rows[static_cast<size_t>(r)].first;
    }
  }

  void remember(SnapshotPtr snapshot, SeqId seq, int64_t from, int64_t to) {
    if (snapshot == nullptr) return;
    const Ids& source = ids(seq);
    Ids held =
        model_.kv_ranges() ? Ids(source.begin() + from, source.begin() + to) : prefix(source, to);
    pool_.push_back({std::move(snapshot), from, to, std::move(held), seq});
  }

  void take_snapshot() {
    const auto seq = static_cast<SeqId>(random(kSequences));
    const int64_t from = random(offset(seq) + 1);
    SnapshotPtr s = model_.cache().snapshot(seq, from);
    if (model_.kv_ranges()) {
      ASSERT_EQ(s == nullptr, from == offset(seq));
      remember(std::move(s), seq, from, offset(seq));
    } else {
      ASSERT_EQ(s == nullptr, offset(seq) == 0);
      remember(std::move(s), seq, offset(seq), offset(seq));
    }
  }

  // Captures scheduled on one sequence, reached inside batched writes of several.
  void scheduled_captures() {
    const auto seq = static_cast<SeqId>(random(kSequences));
    std::vector<int64_t> offsets;
    int64_t next = offset(seq) + random(3);
    for (int64_t i = 0, count = 1 + random(3); i < count; ++i) {
      offsets.push_back(next);
      next += 1 + random(6);
    }
    const int64_t start = offset(seq);
    model_.cache().prepare_snapshots(seq, offsets);
    while (offset(seq) < offsets.back()) {
      batched_write({{seq, 1 + random(offsets.back() - offset(seq) + 2)}});
      if (::testing::Test::HasFatalFailure()) return;
    }
    std::vector<SnapshotPtr> captures = model_.cache().take_snapshots(seq);
    ASSERT_EQ(captures.size(), offsets.size());
    int64_t edge = start;
    for (size_t i = 0; i < captures.size(); ++i) {
      const int64_t at = offsets[i];
      if (captures[i] != nullptr && at > start && at < offset(seq)) ++coverage_.batched_captures;
      if (model_.kv_ranges()) {
        ASSERT_EQ(captures[i] == nullptr, at == edge);
        remember(std::move(captures[i]), seq, edge, at);
      } else {
        ASSERT_EQ(captures[i] == nullptr, at == 0);
        remember(std::move(captures[i]), seq, at, at);
      }
      edge = at;
    }
  }

  void restore() {
    const auto seq = static_cast<SeqId>(random(kSequences));
    Expected* s = pool_.empty() || rng_() % 4 == 0 ? nullptr : &pool_[random(pool_.size())];
    const int64_t end = s != nullptr ? s->to : offset(seq);
    // The end, one short of it, one past it, or anywhere before it.
    const int64_t choice = random(4);
    const int64_t target = choice < 3 ? end - 1 + choice : random(end + 1);
    const bool expected = model_.reachable(s, target, ids(seq));
    const bool got =
        model_.cache().restore(seq, s != nullptr ? s->snapshot.get() : nullptr, target);
    ASSERT_EQ(got, expected) << "sequence " << seq << " target " << target << " end " << end;
    if (!got) {
      ++coverage_.failed_restores;
      return;
    }
    Ids& held = ids(seq);
    if (s == nullptr) {
      held.resize(static_cast<size_t>(target));
      return;
    }
    if (model_.kv_ranges()) {
      if (target > s->from) {
        held.resize(static_cast<size_t>(s->from));
        held.insert(held.end(), s->ids.begin(), s->ids.begin() + (target - s->from));
      } else {
        held.resize(static_cast<size_t>(target));
      }
    } else {
      held = prefix(s->ids, target);
    }
    if (s->origin != seq) ++coverage_.crossed_restores;
  }

  void merge() {
    if (pool_.size() < 2) return;
    size_t parent_index = random(pool_.size()), child_index = random(pool_.size());
    for (size_t i = 0; model_.kv_ranges() && i < pool_.size(); ++i) {
      for (size_t j = 0; j < pool_.size(); ++j) {
        if (i != j && pool_[i].to == pool_[j].from && rng_() % 2 == 0) {
          parent_index = i;
          child_index = j;
        }
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
    const SeqId origin = parent.origin == child.origin ? parent.origin : -1;
    SnapshotPtr merged =
        model_.cache().merge(std::move(parent.snapshot), std::move(child.snapshot));
    ASSERT_NE(merged, nullptr);
    if (model_.kv_ranges()) {
      if (origin == -1) ++coverage_.crossed_merges;
      Ids joined = parent.ids;
      joined.insert(joined.end(), child.ids.begin(), child.ids.end());
      pool_.push_back({std::move(merged), parent.from, child.to, std::move(joined), origin});
    } else {
      pool_.push_back(
          {std::move(merged), child.from, child.to, std::move(child.ids), child.origin});
    }
  }

  void split() {
    if (pool_.empty()) return;
    Expected whole = take(random(pool_.size()));
    const int64_t at = whole.from + random(whole.to - whole.from + 1);
    auto [before, after] = model_.cache().split(std::move(whole.snapshot), at);
    if (!model_.kv_ranges() || at == whole.from || at == whole.to) {
      SnapshotPtr& kept = after != nullptr ? after : before;
      ASSERT_NE(kept, nullptr);
      pool_.push_back({std::move(kept), whole.from, whole.to, std::move(whole.ids), whole.origin});
      return;
    }
    ++coverage_.splits;
    const auto cut = static_cast<size_t>(at - whole.from);
    pool_.push_back({std::move(before), whole.from, at,
                     Ids(whole.ids.begin(), whole.ids.begin() + cut), whole.origin});
    pool_.push_back({std::move(after), at, whole.to, Ids(whole.ids.begin() + cut, whole.ids.end()),
                     whole.origin});
  }

  void drop() {
    if (!pool_.empty()) take(random(pool_.size()));
  }

  Expected take(size_t index) {
    Expected e = std::move(pool_[index]);
    pool_.erase(pool_.begin() + static_cast<std::ptrdiff_t>(index));
    return e;
  }

  // Restores `s` into a fresh cache of the kind, into its second sequence, and checks it holds
  // exactly what `s` captured.
  void check_snapshot(const Expected& s) {
    const std::unique_ptr<Attention> fresh = model_.fresh();
    constexpr SeqId kInto = 1;
    const Ids filler = id_range(900000, model_.kv_ranges() ? s.from : 0);
    if (!filler.empty()) {
      Batch batch = Batch::uniform(1, static_cast<int64_t>(filler.size()), 0);
      batch.seq_ids = {kInto};
      (void)fresh->update(batch, kv.keys(filler), kv.values(filler));
    }
    ASSERT_TRUE(fresh->restore(kInto, s.snapshot.get(), s.to));
    Ids expected = model_.kv_ranges() ? testing::concat_ids(filler, s.ids) : s.ids;
    model_.check_sequence(*fresh, kInto, expected);
  }

  Model& model_;
  std::mt19937 rng_;
  std::vector<Ids> ids_;  // each sequence's tokens
  int64_t next_id_ = 1;
  std::vector<Expected> pool_;
  Coverage coverage_;
};

template <class M>
Coverage run_many(int runs, int steps) {
  Coverage total;
  runs = testing::for_each_seed(runs, [&](uint32_t seed) {
    M model;
    Driver driver(model, seed);
    driver.run(steps);
    total += driver.coverage();
    total.blocks_copied += model.blocks_copied();
  });
  EXPECT_GT(total.mixed_batches, runs * 5);
  EXPECT_GT(total.crossed_restores, runs);
  EXPECT_GT(total.batched_captures, runs / 4);
  EXPECT_GT(total.failed_restores, runs / 4);
  return total;
}

TEST(SequencesModel, KVCacheServesSequencesAsTheReference) {
  const Coverage c = run_many<KVModel>(300, 40);
  EXPECT_GT(c.crossed_merges, 30);
  EXPECT_GT(c.splits, 30);
}

TEST(SequencesModel, PagedKVCacheServesSequencesAsTheReference) {
  const Coverage c = run_many<PagedModel>(300, 40);
  EXPECT_GT(c.crossed_merges, 30);
  EXPECT_GT(c.splits, 30);
  EXPECT_GT(c.blocks_copied, 300);  // writes into blocks other sequences or snapshots share
}

TEST(SequencesModel, RotatingKVCacheServesSequencesAsTheReference) {
  run_many<RotatingModel>(300, 40);
}

}  // namespace
}  // namespace kvsnap::sequences_model_test
