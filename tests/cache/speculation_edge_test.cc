// Speculation rounds at the edges of what the caches do: windows smaller than the verify chunk,
// rounds from offset 0, a verify forward written in several pieces, several sequences verified
// in one batch (each with its own Speculation), paged blocks shared between sequences, and
// random interleavings of all of these. After every round each layer must hold exactly the
// accepted sequence: the next forwards equal recomputation from scratch.
#include <gtest/gtest.h>
#include <kvsnap/speculation.h>

#include <memory>
#include <random>

#include "support/cache_support.h"
#include "support/hybrid_stack.h"

namespace kvsnap {
namespace {

using testing::HybridStack;
using testing::StackOptions;
using Tokens = std::vector<int32_t>;

using testing::concat;
using testing::range;
Tokens head(const Tokens& tokens, int64_t count) {
  return Tokens(tokens.begin(), tokens.begin() + count);
}

// One round of k drafts accepting `accepted`, then a decode step and a chunk; `sequence` grows
// by what the layers should hold.
::testing::AssertionResult round_then_more(HybridStack& stack, Speculation& round, Tokens& sequence,
                                           int64_t k, int64_t accepted, int32_t first) {
  round.begin(k);
  const Tokens verify = range(first, static_cast<int32_t>(k + 1));
  if (auto r = stack.forward_and_check(verify, concat(sequence, verify)); !r) return r;
  round.accept(accepted);
  sequence = concat(sequence, head(verify, accepted + 1));
  for (Cache* layer : stack.layers()) {
    if (layer != nullptr && layer->offset() != static_cast<int64_t>(sequence.size())) {
      return ::testing::AssertionFailure() << "a layer stands at " << layer->offset();
    }
  }
  for (const Tokens& more : {Tokens{7}, Tokens{8, 9, 10, 11, 12, 13, 14}}) {
    sequence = concat(sequence, more);
    if (auto r = stack.forward_and_check(more, sequence); !r) return r;
  }
  return ::testing::AssertionSuccess();
}

// Windows of 1..3 tokens, smaller than the k + 1 tokens a round verifies, from offset 0 on.
TEST(SpeculationEdges, WindowSmallerThanTheChunk) {
  for (int64_t window : {1, 2, 3}) {
    for (bool paged : {false, true}) {
      for (int32_t prompt : {0, 1, 4}) {
        for (int64_t k : {1, 4, 9}) {
          for (int64_t accepted = 0; accepted <= k; ++accepted) {
            SCOPED_TRACE(::testing::Message()
                         << "window " << window << " paged " << paged << " prompt " << prompt
                         << " k " << k << " accepted " << accepted);
            HybridStack stack(StackOptions{.window = window, .paged = paged});
            Tokens sequence = range(1, prompt);
            if (prompt > 0) {
              ASSERT_TRUE(stack.forward_and_check(sequence, sequence));
            }
            Speculation round(stack.layers());
            ASSERT_TRUE(round_then_more(stack, round, sequence, k, accepted, 100));
            ASSERT_TRUE(round_then_more(stack, round, sequence, k, k - accepted, 200));
          }
        }
      }
    }
  }
}

// The verify forward as single-token steps (ring writes) or as two chunks.
TEST(SpeculationEdges, VerifyForwardInSeveralWrites) {
  for (bool steps : {true, false}) {
    for (int64_t window : {2, 3, 6, 30}) {
      for (bool paged : {false, true}) {
        for (int64_t accepted = 0; accepted <= 5; ++accepted) {
          SCOPED_TRACE(::testing::Message() << "steps " << steps << " window " << window
                                            << " paged " << paged << " accepted " << accepted);
          HybridStack stack(StackOptions{.window = window, .paged = paged});
          Tokens sequence = range(1, 9);
          ASSERT_TRUE(stack.forward_and_check(sequence, sequence));
          Speculation round(stack.layers());
          round.begin(5);
          const Tokens verify = range(100, 6);
          Tokens written = sequence;
          const std::vector<Tokens> pieces =
              steps
                  ? std::vector<Tokens>{{100}, {101}, {102}, {103}, {104}, {105}}
                  : std::vector<Tokens>{head(verify, 2), Tokens(verify.begin() + 2, verify.end())};
          for (const Tokens& piece : pieces) {
            written = concat(written, piece);
            ASSERT_TRUE(stack.forward_and_check(piece, written));
          }
          round.accept(accepted);
          sequence = concat(sequence, head(verify, accepted + 1));
          for (const Tokens& more : {Tokens{7}, Tokens{8, 9, 10}}) {
            sequence = concat(sequence, more);
            ASSERT_TRUE(stack.forward_and_check(more, sequence));
          }
        }
      }
    }
  }
}

// A verify forward of single-token steps over a wrapped ring leaves captures that are views of
// the ring's columns, partly copied out as later steps overwrote them. accept releases the
// captures it does not return to before restoring: the restore then copies out nothing but the
// one it returns to (it rewrites the ring), and the window holds exactly the accepted tokens.
TEST(SpeculationEdges, AcceptOverAWrappedRingCopiesOutOnlyTheCaptureItReturnsTo) {
  const testing::TokenKV kv;
  constexpr int64_t kWindow = 4, kTokenBytes = 2 * 2 * 4 * 4;  // keys and values, f32
  for (int64_t accepted = 0; accepted <= 3; ++accepted) {
    SCOPED_TRACE(::testing::Message() << "accepted " << accepted);
    RotatingKVCache window(kWindow);
    std::vector<int64_t> written;
    const auto step = [&](int64_t id) {
      (void)testing::write(window, kv, std::vector<int64_t>{id});
      written.push_back(id);
    };
    for (int64_t id = 0; id < 10; ++id) step(id);  // single steps: the ring wraps
    Speculation round({&window});
    round.begin(3);
    ASSERT_EQ(round.capturing_layers(), 1);
    for (int64_t id = 100; id < 104; ++id)
      (void)testing::write(window, kv, std::vector<int64_t>{id});
    const CopyStats before = window.copy_stats();
    round.accept(accepted);
    EXPECT_LE(window.copy_stats().materialized_bytes - before.materialized_bytes,
              (kWindow - 1) * kTokenBytes);
    for (int64_t i = 0; i <= accepted; ++i) written.push_back(100 + i);
    // The window's positions are the newest ones written, each holding its token.
    const auto expect_window = [&] {
      const auto held = testing::position_ids(window.view(Batch::uniform(1, 0, window.offset())));
      const auto n = static_cast<int64_t>(written.size());
      ASSERT_GE(static_cast<int64_t>(held.size()), kWindow - 1);
      for (size_t i = 0; i < held.size(); ++i) {
        EXPECT_EQ(held[i].first, n - static_cast<int64_t>(held.size() - i));
        EXPECT_EQ(held[i].second, written[static_cast<size_t>(held[i].first)]);
      }
    };
    EXPECT_EQ(window.offset(), static_cast<int64_t>(written.size()));
    expect_window();
    for (int64_t id = 200; id < 206; ++id) {  // the ring goes on from the restored one
      step(id);
      expect_window();
    }
  }
}

// Two sequences verified in one batch, each rolled back by its own Speculation.
TEST(SpeculationEdges, SequencesVerifiedInOneBatch) {
  for (int64_t window : {2, 3, 6, 30}) {
    for (bool paged : {false, true}) {
      for (int64_t a0 = 0; a0 <= 3; ++a0) {
        for (int64_t a1 = 0; a1 <= 2; ++a1) {
          SCOPED_TRACE(::testing::Message() << "window " << window << " paged " << paged
                                            << " accepted " << a0 << ", " << a1);
          HybridStack stack(StackOptions{.window = window, .paged = paged});
          Tokens s0 = range(1, 7), s1 = range(50, 11);
          ASSERT_TRUE(stack.forward_rows_and_check({{0, s0, s0}, {1, s1, s1}}));
          Speculation r0(stack.layers(), 0), r1(stack.layers(), 1);
          r0.begin(3);
          r1.begin(2);
          const Tokens v0 = range(100, 4), v1 = range(120, 3);
          ASSERT_TRUE(
              stack.forward_rows_and_check({{0, v0, concat(s0, v0)}, {1, v1, concat(s1, v1)}}));
          r0.accept(a0);
          r1.accept(a1);
          s0 = concat(concat(s0, head(v0, a0 + 1)), {5, 6});
          s1 = concat(concat(s1, head(v1, a1 + 1)), {9});
          ASSERT_TRUE(stack.forward_rows_and_check({{0, {5, 6}, s0}, {1, {9}, s1}}));
        }
      }
    }
  }
}

// A paged attention layer whose blocks another sequence shares (forked by a restore).
TEST(SpeculationEdges, PagedBlocksSharedWithAnotherSequence) {
  for (int64_t window : {3, 30}) {
    for (int64_t accepted = 0; accepted <= 4; ++accepted) {
      SCOPED_TRACE(::testing::Message() << "window " << window << " accepted " << accepted);
      HybridStack stack(StackOptions{.window = window, .paged = true, .block_tokens = 4});
      Tokens s0 = range(1, 10);
      ASSERT_TRUE(stack.forward_and_check(s0, s0));
      std::vector<SnapshotPtr> forks;
      for (Cache* layer : stack.layers()) {
        if (layer == nullptr) continue;
        forks.push_back(layer->snapshot(0, 0));
        ASSERT_TRUE(layer->restore(1, forks.back().get(), 10));
      }
      Tokens s1 = s0;
      Speculation r0(stack.layers(), 0), r1(stack.layers(), 1);
      r0.begin(4);
      const Tokens v0 = range(100, 5);
      ASSERT_TRUE(stack.forward_and_check(v0, concat(s0, v0)));
      r0.accept(accepted);
      s0 = concat(concat(s0, head(v0, accepted + 1)), {5, 6, 7});
      s1 = concat(s1, {9, 8});
      ASSERT_TRUE(stack.forward_rows_and_check({{0, {5, 6, 7}, s0}, {1, {9, 8}, s1}}));
      r1.begin(3);  // now the other sequence, after this one wrote
      const Tokens v1 = range(300, 4);
      ASSERT_TRUE(stack.forward_and_check(v1, concat(s1, v1), 1));
      r1.accept(accepted % 4);
      s0 = concat(s0, {4});
      s1 = concat(concat(s1, head(v1, accepted % 4 + 1)), {2, 3});
      ASSERT_TRUE(stack.forward_rows_and_check({{0, {4}, s0}, {1, {2, 3}, s1}}));
      forks.clear();
      s0 = concat(s0, {11});
      s1 = concat(s1, {12});
      ASSERT_TRUE(stack.forward_rows_and_check({{0, {11}, s0}, {1, {12}, s1}}));
    }
  }
}

// Random steps over 1-3 sequences: each sequence either writes a chunk or runs a round, the
// rows verified in one batch or each alone, a row's forward sometimes split in two; now and
// then one sequence is forked into another (every layer's state restored from a snapshot of
// it, which stays held a while), so rounds run over blocks other sequences and snapshots share.
class RandomSteps {
 public:
  explicit RandomSteps(uint32_t seed) : rng_(seed) {}

  void run(int steps) {
    const int64_t window = uniform(1, 12);
    const int sequences = static_cast<int>(uniform(1, 3));
    SCOPED_TRACE(::testing::Message() << "window " << window << " sequences " << sequences);
    HybridStack stack(
        StackOptions{.window = window, .paged = uniform(0, 1) == 1, .block_tokens = uniform(1, 5)});
    std::vector<Tokens> seqs(static_cast<size_t>(sequences));
    std::vector<std::unique_ptr<Speculation>> rounds;
    for (int s = 0; s < sequences; ++s) {
      rounds.push_back(std::make_unique<Speculation>(stack.layers(), s));
    }
    std::vector<SnapshotPtr> held;  // the forks' snapshots
    for (int step = 0; step < steps && !::testing::Test::HasFatalFailure(); ++step) {
      if (sequences > 1 && uniform(0, 3) == 0) {
        ASSERT_NO_FATAL_FAILURE(fork(stack, seqs, held));
      }
      if (uniform(0, 3) == 0) held.clear();
      std::vector<HybridStack::Row> rows;
      std::vector<int64_t> drafts(seqs.size(), -1);
      for (int s = 0; s < sequences; ++s) {
        Tokens tokens;
        if (uniform(0, 2) == 0) {  // a chunk, now and then a long one
          tokens = fresh(uniform(0, 3) == 0 ? uniform(20, 120) : uniform(1, 7));
        } else {
          drafts[s] = uniform(0, 8);
          rounds[s]->begin(drafts[s]);
          tokens = fresh(drafts[s] + 1);
        }
        rows.push_back({s, tokens, concat(seqs[s], tokens)});
      }
      ASSERT_NO_FATAL_FAILURE(forward(stack, rows));
      for (int s = 0; s < sequences; ++s) {
        const Tokens& tokens = rows[static_cast<size_t>(s)].tokens;
        const int64_t kept =
            drafts[s] < 0 ? static_cast<int64_t>(tokens.size()) : 1 + uniform(0, drafts[s]);
        if (drafts[s] >= 0) rounds[s]->accept(kept - 1);
        seqs[s] = concat(seqs[s], head(tokens, kept));
        for (Cache* layer : stack.layers()) {
          if (layer != nullptr) {
            ASSERT_EQ(layer->offset(s), static_cast<int64_t>(seqs[s].size()));
          }
        }
      }
    }
  }

 private:
  int64_t uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  // Sequence `to` becomes a copy of sequence `from` (blocks shared where the layer pages).
  void fork(HybridStack& stack, std::vector<Tokens>& seqs, std::vector<SnapshotPtr>& held) {
    const auto from = static_cast<SeqId>(uniform(0, static_cast<int64_t>(seqs.size()) - 1));
    const auto to = static_cast<SeqId>((from + uniform(1, static_cast<int64_t>(seqs.size()) - 1)) %
                                       static_cast<int64_t>(seqs.size()));
    const auto offset = static_cast<int64_t>(seqs[static_cast<size_t>(from)].size());
    if (offset == 0) return;
    for (Cache* layer : stack.layers()) {
      if (layer == nullptr) continue;
      SnapshotPtr snapshot = layer->snapshot(from, 0);
      ASSERT_NE(snapshot, nullptr);
      ASSERT_TRUE(layer->restore(to, snapshot.get(), offset));
      held.push_back(std::move(snapshot));
    }
    seqs[static_cast<size_t>(to)] = seqs[static_cast<size_t>(from)];
    ++forks_;
  }
  Tokens fresh(int64_t count) {
    Tokens out;
    for (int64_t i = 0; i < count; ++i) out.push_back(next_++ % 97);
    return out;
  }
  void forward(HybridStack& stack, const std::vector<HybridStack::Row>& rows) {
    if (uniform(0, 1) == 1) {
      ASSERT_TRUE(stack.forward_rows_and_check(rows));
      return;
    }
    for (const HybridStack::Row& row : rows) {
      const auto n = static_cast<int64_t>(row.tokens.size());
      const int64_t cut = n > 1 && uniform(0, 1) == 1 ? uniform(1, n - 1) : n;
      const Tokens first = head(row.tokens, cut),
                   second(row.tokens.begin() + cut, row.tokens.end());
      ASSERT_TRUE(stack.forward_and_check(
          first, head(row.sequence, row.sequence.size() - (n - cut)), row.slot));
      if (!second.empty()) {
        ASSERT_TRUE(stack.forward_and_check(second, row.sequence, row.slot));
      }
    }
  }

  std::mt19937 rng_;
  int32_t next_ = 1;

 public:
  int64_t forks_ = 0;
};

TEST(SpeculationEdges, RandomStepsEqualRecomputation) {
  int64_t forks = 0;
  for (uint32_t seed = 1; seed <= 60 && !HasFatalFailure(); ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    RandomSteps steps(seed);
    steps.run(20);
    forks += steps.forks_;
  }
  EXPECT_GT(forks, 60);
}

}  // namespace
}  // namespace kvsnap
