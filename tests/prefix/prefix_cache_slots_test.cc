// A PrefixCache serving several sequences (slots) at once over one trie: sessions on different
// slots interleave, restore what other slots left in the trie (paged blocks shared, not copied),
// and every output equals recomputation.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>
#include <kvsnap/speculation.h>

#include <filesystem>
#include <random>

#include "support/conversation.h"
#include "support/private_support.h"
#include "support/test_support.h"

namespace kvsnap::prefix_cache_slots_test {
namespace {

using testing::HybridStack;
using testing::StackOptions;
using testing::throws_error;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

// One request on `slot`: begin, evaluate remaining(), prefill_done, decode `reply` (all but its
// last token evaluated), close; outputs checked against recomputation.
int64_t request(PrefixCache& cache, HybridStack& stack, SeqId slot, const Tokens& prompt,
                const Tokens& reply, const std::vector<int64_t>& restore_points = {}) {
  PrefixCache::Session session = cache.begin(slot, prompt);
  EXPECT_EQ(session.slot(), slot);
  std::vector<int64_t> points;
  for (int64_t p : restore_points) {
    if (p >= session.cached()) points.push_back(p);
  }
  session.schedule_snapshots(points);
  const int64_t cached = session.cached();
  EXPECT_TRUE(stack.forward_and_check(session.remaining(), prompt, slot));
  session.prefill_done();
  Tokens sequence = prompt;
  for (size_t i = 0; i < reply.size(); ++i) {
    session.append_output(reply[i]);
    sequence.push_back(reply[i]);
    if (i + 1 < reply.size()) {
      EXPECT_TRUE(stack.forward_and_check(std::span(&reply[i], 1), sequence, slot));
    }
  }
  session.close();
  EXPECT_EQ(cache.check_invariants(), "") << cache.debug_string();
  EXPECT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
  return cached;
}

const Tokens kSystem = tokens(100, 40);

TEST(PrefixCacheSlots, ASecondSlotReusesThePrefixTheFirstLeft) {
  HybridStack stack(StackOptions{.paged = true});
  PrefixCache cache(stack.layers(), {.slots = 2});
  EXPECT_EQ(cache.slots(), 2);
  request(cache, stack, 0, kSystem + tokens(200, 6), tokens(300, 3), {40});
  // Slot 1 has never run: it restores the system prompt from the trie, whose attention blocks
  // are still slot 0's (shared, not copied).
  const auto& paged = dynamic_cast<const PagedKVCache&>(stack.attention());
  const int64_t copied = paged.pool_stats().blocks_copied;
  EXPECT_EQ(request(cache, stack, 1, kSystem + tokens(400, 5), tokens(500, 2), {40}), 40);
  EXPECT_LE(paged.pool_stats().blocks_copied - copied, 2);  // joined at begin, written after
}

TEST(PrefixCacheSlots, BeginOverACachedPrefixCopiesAtMostOneBlockWhateverItsLength) {
  for (int32_t length : {40, 400}) {
    HybridStack stack(StackOptions{.paged = true, .block_tokens = 4});
    PrefixCache cache(stack.layers(), {.slots = 2});
    const Tokens prefix = tokens(1000, length);
    const std::vector<int64_t> end_of_prefix{length + 1};
    request(cache, stack, 0, prefix + Tokens{7} + tokens(200, 3), tokens(300, 2), end_of_prefix);
    const auto& paged = dynamic_cast<const PagedKVCache&>(stack.attention());
    const CopyStats before = paged.copy_stats();
    const int64_t blocks_before = paged.pool_stats().blocks_copied;
    const CopyStats window_before = stack.window.copy_stats();
    PrefixCache::Session session = cache.begin(1, prefix + Tokens{7} + tokens(600, 4));
    EXPECT_EQ(session.cached(), length + 1);
    // Attention: at most the one block where the restore ends mid-block.
    EXPECT_LE(paged.pool_stats().blocks_copied - blocks_before, 1) << length;
    EXPECT_LE(paged.copy_stats().restored_bytes - before.restored_bytes, 4 * stack.token_bytes())
        << length;
    // The window layer copies at most its window; the recurrent state is shared.
    EXPECT_LE(stack.window.copy_stats().restored_bytes - window_before.restored_bytes,
              HybridStack::kWindow * stack.token_bytes())
        << length;
    EXPECT_EQ(stack.recurrent.copy_stats().restored_bytes, 0);
    ASSERT_TRUE(
        stack.forward_and_check(session.remaining(), prefix + Tokens{7} + tokens(600, 4), 1));
  }
}

// A path whose parts three slots wrote, each diverging mid-block from the one before: the
// blocks where they meet began as copies of each other, so begin joins none of them.
TEST(PrefixCacheSlots, BeginOverAPathOfPartsFromSeveralSlotsCopiesAtMostOneBlock) {
  HybridStack stack(StackOptions{.paged = true, .block_tokens = 4});
  PrefixCache cache(stack.layers(), {.slots = 4});
  const Tokens a = tokens(1000, 6), b = tokens(1100, 4), c = tokens(1200, 3);
  request(cache, stack, 0, a + tokens(2000, 3), tokens(300, 2), {6});
  EXPECT_EQ(request(cache, stack, 1, a + b + tokens(2100, 3), tokens(310, 2), {10}), 6);
  EXPECT_EQ(request(cache, stack, 2, a + b + c + tokens(2200, 3), tokens(320, 2), {13}), 10);
  const auto& paged = dynamic_cast<const PagedKVCache&>(stack.attention());
  const int64_t blocks_before = paged.pool_stats().blocks_copied;
  const Tokens prompt = a + b + c + tokens(2300, 4);
  PrefixCache::Session session = cache.begin(3, prompt);
  EXPECT_EQ(session.cached(), 13);
  EXPECT_LE(paged.pool_stats().blocks_copied - blocks_before, 1);
  ASSERT_TRUE(stack.forward_and_check(session.remaining(), prompt, 3));
}

TEST(PrefixCacheSlots, MatchTellsWhatBeginWouldRestoreAndChangesNothing) {
  HybridStack stack;
  PrefixCache cache(stack.layers(), {.slots = 3});
  request(cache, stack, 0, kSystem + tokens(200, 6), tokens(300, 3), {40});
  const Tokens next = kSystem + tokens(700, 3);
  const std::string before = cache.debug_string();
  const PrefixCache::Stats stats = cache.stats();
  EXPECT_EQ(cache.match(next), 40);
  EXPECT_EQ(cache.match(2, next), 40);
  EXPECT_EQ(cache.debug_string(), before);
  EXPECT_EQ(cache.stats().lookups, stats.lookups);
  EXPECT_EQ(request(cache, stack, 2, next, tokens(800, 2)), 40);
}

TEST(PrefixCacheSlots, SessionsOnDifferentSlotsInterleave) {
  HybridStack stack(StackOptions{.paged = true});
  PrefixCache cache(stack.layers(), {.slots = 2});
  const Tokens a = kSystem + tokens(200, 5), b = kSystem + tokens(300, 7);
  PrefixCache::Session first = cache.begin(0, a);
  PrefixCache::Session second = cache.begin(1, b);
  EXPECT_TRUE(throws_error([&] { (void)cache.begin(1, b); }, {"slot 1", "already open"}));
  EXPECT_TRUE(throws_error([&] { (void)cache.begin(2, b); }, {"slot 2 outside [0, 2)"}));
  ASSERT_TRUE(stack.forward_and_check(first.remaining(), a, 0));
  ASSERT_TRUE(stack.forward_and_check(second.remaining(), b, 1));
  second.prefill_done();
  first.prefill_done();
  first.close();
  second.close();
  EXPECT_EQ(cache.check_invariants(), "");
  // Both branches are in the trie now, on the shared system prompt.
  EXPECT_EQ(cache.match(a + Tokens{1}), static_cast<int64_t>(a.size()));
  EXPECT_EQ(request(cache, stack, 0, b + Tokens{9}, tokens(900, 2)),
            static_cast<int64_t>(b.size()));
}

TEST(PrefixCacheSlots, LoadingWithASessionOpenOnAnySlotIsAnError) {
  HybridStack stack;
  PrefixCache cache(stack.layers(), {.slots = 2});
  PrefixCache::Session open = cache.begin(1, kSystem);
  EXPECT_TRUE(
      throws_error([&] { cache.load("/nonexistent"); }, {"session is open on slot 1", "close it"}));
  EXPECT_TRUE(throws_error(
      [] {
        HybridStack s;
        PrefixCache c(s.layers(), {.slots = 0});
      },
      {"slots 0"}));
}

// A load resets every slot's layers: an idle slot's open Speculation round (captures no session
// made) makes it refuse, changing nothing, as begin on that slot does.
TEST(PrefixCacheSlots, LoadingWhileAnIdleSlotHasASpeculationRoundOpenIsAnError) {
  HybridStack stack;
  PrefixCache cache(stack.layers(), {.slots = 2});
  request(cache, stack, 0, kSystem, tokens(900, 2));
  const int64_t nodes = cache.node_count();
  const std::string dir = testing::private_scratch("load_round").string();
  cache.save(dir, "m");
  Speculation round(stack.layers(), 1);
  round.begin(2);
  EXPECT_TRUE(throws_error([&] { cache.load(dir, "m"); },
                           {"PrefixCache::load: layer", "scheduled for slot 1",
                            "a Speculation round still open?", "accept or cancel it first"}));
  EXPECT_TRUE(stack.recurrent.schedule_state(1).pending);  // the round's captures are kept
  EXPECT_EQ(cache.node_count(), nodes);
  round.cancel();
  cache.load(dir, "m");
  EXPECT_EQ(cache.node_count(), nodes);
  std::filesystem::remove_all(dir);
}

// The constructor's refusals: a budget below 0, and a Cache listed twice (its second schedule
// would replace the first, losing every capture); null entries (stateless layers) may repeat.
TEST(PrefixCacheSlots, ABadBudgetOrACacheListedTwiceIsRefused) {
  HybridStack s;
  EXPECT_TRUE(throws_error([&] { PrefixCache c(s.layers(), {.max_paged_out_bytes = -1}); },
                           {"PrefixCache: max_paged_out_bytes -1 must be >= 0"}));
  std::vector<Cache*> twice = s.layers();
  ASSERT_GE(twice.size(), 2u);
  twice.push_back(nullptr);
  twice.push_back(nullptr);
  PrefixCache nulls(twice);  // stateless layers may repeat
  twice.push_back(twice[1]);
  EXPECT_TRUE(throws_error(
      [&] { PrefixCache c(twice); },
      {fmt::format("PrefixCache: layers 1 and {} are the same Cache object", twice.size() - 1)
           .c_str(),
       "list a cache that several model layers share once"}));
}

// Random requests on random slots, interleaved: new conversations, continuations and branches
// over shared prefixes, under a small budget. Each step advances a random set of slots; those
// that evaluate tokens (prefill chunks, decode tokens) do so together in one heterogeneous
// batch, every row checked against recomputing its own sequence.
class Interleaving {
 public:
  Interleaving(uint32_t seed, SeqId slots, bool paged, int64_t budget)
      : rng_(seed),
        stack_(StackOptions{.paged = paged, .block_tokens = 3}),
        cache_(stack_.layers(), {.max_paged_out_bytes = budget, .slots = slots}),
        budget_(budget),
        slots_(static_cast<size_t>(slots)) {}

  void run(int steps) {
    for (int step = 0; step < steps && !::testing::Test::HasFailure(); ++step) {
      rows_.clear();
      finishing_.clear();
      const size_t surely = rng_() % slots_.size();
      for (size_t i = 0; i < slots_.size(); ++i) {
        if (i != surely && rng_() % 2 == 0) continue;
        advance(slots_[i], static_cast<SeqId>(i));
        if (::testing::Test::HasFailure()) return;
      }
      if (!rows_.empty()) {
        ASSERT_TRUE(stack_.forward_rows_and_check(rows_));
        check_budget(/*strict=*/true);
      }
      if (rows_.size() > 1) ++batched_steps_;
      for (Slot* slot : finishing_) finish_prefill(*slot);
      ASSERT_EQ(cache_.check_invariants(), "") << cache_.debug_string();
    }
  }
  PrefixCache::Stats stats() const { return cache_.stats(); }
  int64_t batched_steps() const { return batched_steps_; }  // steps of two rows or more

 private:
  struct Slot {
    std::optional<PrefixCache::Session> session;
    Tokens sequence;  // the prompt, then the outputs
    bool prefilled = false;
    int64_t decode_left = 0;
  };

  // The trie stays within its budget after every PrefixCache call and every forward: each call
  // reserved what the slots' writes could copy out before the next. And at every instant in
  // between (the peak since the last check): strictly through forwards, decode steps and
  // prefill_done (which makes room for its captures before inserting them); begin and close by
  // one snapshot at most — a whole state close takes, or what a restore into the window's ring
  // copies past the window layer's exposure (a few tokens). Before begin reserved its restore,
  // it copied the slot's whole old path into the trie first (tens of tokens here).
  void check_budget(bool strict) {
    ASSERT_LE(cache_.paged_out_bytes(), budget_);
    ASSERT_LE(cache_.peak_paged_out_bytes(), budget_ + (strict ? 0 : 12 * stack_.token_bytes()));
    cache_.reset_peak_paged_out_bytes();
  }

  Tokens next_prompt() {
    Tokens prompt = done_.empty() || rng_() % 3 == 0 ? tokens(100, 10 + rng_() % 10)
                                                     : done_[rng_() % done_.size()];
    if (!prompt.empty() && rng_() % 2 == 0) prompt.resize(1 + rng_() % prompt.size());
    for (uint32_t i = 0, n = 1 + rng_() % 6; i < n; ++i) prompt.push_back(next_++);
    return prompt;
  }

  // The slot's next action; tokens it evaluates join this step's rows (a row that ends its
  // prefill is finished after the step).
  void advance(Slot& slot, SeqId id) {
    if (!slot.session) {  // a new request
      const Tokens prompt = next_prompt();
      slot.session.emplace(cache_.begin(id, prompt));
      check_budget(/*strict=*/false);
      slot.sequence = prompt;
      const auto remaining = slot.session->remaining();
      // A chunked prefill: the first chunk now, the rest as one more step.
      const size_t first = 1 + rng_() % remaining.size();
      rows_.push_back({id, Tokens(remaining.begin(), remaining.begin() + first),
                       Tokens(prompt.begin(), prompt.end() - static_cast<std::ptrdiff_t>(
                                                                 remaining.size() - first))});
      if (first == remaining.size()) finishing_.push_back(&slot);
      return;
    }
    if (!slot.prefilled) {
      const int64_t offset = stack_.offset(id);
      if (rng_() % 8 == 0) {  // cancelled mid-prefill
        close(slot);
        return;
      }
      rows_.push_back(
          {id, Tokens(slot.sequence.begin() + offset, slot.sequence.end()), slot.sequence});
      finishing_.push_back(&slot);
      return;
    }
    if (slot.decode_left == 0) {
      close(slot);
      return;
    }
    const int32_t token = next_++;
    slot.session->append_output(token);
    check_budget(/*strict=*/true);
    slot.sequence.push_back(token);
    --slot.decode_left;
    if (slot.decode_left > 0) rows_.push_back({id, Tokens{token}, slot.sequence});
  }

  void finish_prefill(Slot& slot) {
    slot.session->prefill_done();
    check_budget(/*strict=*/true);
    slot.prefilled = true;
    slot.decode_left = 1 + static_cast<int64_t>(rng_() % 4);
  }

  void close(Slot& slot) {
    slot.session->close();
    check_budget(/*strict=*/false);
    slot.session.reset();
    done_.push_back(slot.sequence);
    slot.prefilled = false;
    slot.decode_left = 0;
  }

  std::mt19937 rng_;
  HybridStack stack_;
  PrefixCache cache_;
  int64_t budget_;
  std::vector<Slot> slots_;
  std::vector<HybridStack::Row> rows_;  // this step's
  std::vector<Slot*> finishing_;        // slots whose prefill this step's rows end
  std::vector<Tokens> done_;
  int32_t next_ = 1000;
  int64_t batched_steps_ = 0;
};

TEST(PrefixCacheSlots, RandomInterleavedSessionsEqualRecomputation) {
  const char* soak = std::getenv("KVSNAP_SOAK_SEEDS");
  const uint32_t seeds = soak != nullptr ? static_cast<uint32_t>(std::atoi(soak)) : 60;
  const int64_t baseline = live_bytes();
  int64_t reused = 0, evicted = 0, batched = 0;
  for (uint32_t seed = 1; seed <= seeds; ++seed) {
    {
      Interleaving run(seed, 1 + static_cast<SeqId>(seed % 4), seed % 2 == 0,
                       3000 + 2000 * static_cast<int64_t>(seed % 5));
      run.run(150);
      reused += run.stats().reused_tokens;
      evicted += run.stats().evicted_nodes;
      batched += run.batched_steps();
    }
    ASSERT_FALSE(::testing::Test::HasFailure()) << "seed " << seed;
    ASSERT_EQ(live_bytes(), baseline) << "seed " << seed << " leaked array bytes";
  }
  EXPECT_GT(reused, 500);
  EXPECT_GT(evicted, 20);
  EXPECT_GT(batched, 2000);  // over a third of the steps of the runs with several slots
}

}  // namespace
}  // namespace kvsnap::prefix_cache_slots_test
