// Sessions on several slots from several threads at once: begin, forwards, prefill_done,
// decode and close race freely (the PrefixCache and the caches lock themselves). Every output
// equals recomputation and the trie stays consistent. Run under ThreadSanitizer in CI (the
// `tsan` preset).
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <random>
#include <thread>

#include "support/conversation.h"
#include "support/test_support.h"
#include "support/tier_support.h"

namespace kvsnap {
namespace {

using testing::HybridStack;
using testing::run_turn;
using testing::StackOptions;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

// One thread's requests on its slot: conversations on shared system prompts, continued and
// branched, each checked against recomputation.
void serve(PrefixCache& cache, HybridStack& stack, SeqId slot, uint32_t seed, int requests,
           std::atomic<int64_t>& failures, std::atomic<int64_t>& reused) {
  std::mt19937 rng(seed);
  const Tokens systems[] = {tokens(100, 30), tokens(200, 17)};
  Tokens conversation;
  for (int r = 0; r < requests; ++r) {
    Tokens prompt = conversation.empty() || rng() % 3 == 0 ? systems[rng() % 2] : conversation;
    if (rng() % 4 == 0 && prompt.size() > 2) prompt.resize(1 + rng() % (prompt.size() - 1));
    for (uint32_t i = 0, n = 1 + rng() % 8; i < n; ++i) {
      prompt.push_back(1000 + slot * 100000 + r * 100 + static_cast<int32_t>(i));
    }
    PrefixCache::Session session = cache.begin(slot, prompt);
    reused += session.cached();
    const std::vector<int64_t> end_of_system{static_cast<int64_t>(systems[0].size())};
    if (session.cached() <= end_of_system[0] && prompt.size() > systems[0].size()) {
      session.schedule_snapshots(end_of_system);
    }
    if (!stack.forward_and_check(session.remaining(), prompt, slot)) ++failures;
    session.prefill_done();
    Tokens sequence = prompt;
    for (int32_t t = 0, n = 1 + static_cast<int32_t>(rng() % 4); t < n; ++t) {
      const int32_t token = 5000 + slot * 1000 + t;
      session.append_output(token);
      sequence.push_back(token);
      if (t + 1 < n && !stack.forward_and_check(std::span(&token, 1), sequence, slot)) {
        ++failures;
      }
    }
    session.close();
    conversation = Tokens(sequence.begin(), sequence.end() - 1);
  }
}

// The tests' tier options, logging nowhere (its trusted-store warning, once per tier).
TierOptions quiet_tier_options() {
  TierOptions options = testing::tier_options();
  options.log = [](const std::string&) {};
  options.write_queue = 1000;  // every session's batch, however far the writer lags
  return options;
}

// `tier_address`: a tier the prefix cache stores to and looks up in, when not empty.
void race(bool paged, const std::string& tier_address = "") {
  constexpr SeqId kThreads = 4;
  HybridStack stack(StackOptions{.paged = paged, .check_copies = false});
  const std::shared_ptr<Tier> tier =
      tier_address.empty() ? nullptr
                           : Tier::open(tier_address, stack.layers(), quiet_tier_options());
  PrefixCache cache(stack.layers(),
                    {.max_paged_out_bytes = 20000, .slots = kThreads, .tier = tier});
  std::atomic<int64_t> failures{0}, reused{0};
  std::vector<std::thread> threads;
  for (SeqId slot = 0; slot < kThreads; ++slot) {
    threads.emplace_back(serve, std::ref(cache), std::ref(stack), slot, 7u + slot, 25,
                         std::ref(failures), std::ref(reused));
  }
  for (std::thread& t : threads) t.join();
  if (tier) {
    EXPECT_TRUE(tier->flush(std::chrono::minutes(2)));  // all written, however slowly
  }
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(reused.load(), 500);
  EXPECT_EQ(cache.check_invariants(), "") << cache.debug_string();
  EXPECT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
  EXPECT_EQ(cache.stats().lookups, kThreads * 25);
}

// A few rounds each: a race that shows once in tens of runs still shows in CI.
TEST(PrefixCacheThreads, ConcurrentSessionsOnContiguousCaches) {
  for (int round = 0; round < 4; ++round) race(false);
}
TEST(PrefixCacheThreads, ConcurrentSessionsOnPagedCaches) {
  for (int round = 0; round < 4; ++round) race(true);
}

// With a tier: every begin looks the tier up (the lookups of four threads share one connection,
// taken in turn) and every close stores its restore points; another process then restores from
// what they stored, its outputs equal to recomputation.
TEST(PrefixCacheThreads, ConcurrentSessionsWithATier) {
  const testing::FolderStore store("threads");
  for (int round = 0; round < 2; ++round) race(round == 1, store.address());
  testing::TierProcess other(store.address());
  EXPECT_EQ(other.turn(tokens(100, 30) + tokens(9000, 3), tokens(9100, 2)).cached, 30);
  EXPECT_EQ(other.tier->stats().rejected, 0);
}

// A slot's close stores the restore points on its path, among them one another slot made whose
// window snapshot may still name columns of that slot's ring while that slot's decode steps
// shift the ring over them (copying them out first). Every stored point restores in another
// process to outputs equal to recomputation, and ThreadSanitizer sees no race. (The store's
// record of such a snapshot and its copy into the object are microseconds apart, so this run
// rarely lands a write in between; TierObject.LiveSnapshotsAreEncodedFromWhereTheirTokensLieThen
// does so every time.)
TEST(PrefixCacheThreads, TierStoresWhileAnotherSlotDecodesHoldConsistentState) {
  constexpr int64_t kWindow = 32;
  constexpr int32_t kRounds = 6;
  const StackOptions options{.window = kWindow, .check_copies = false};
  const testing::FolderStore store("decoding");
  HybridStack stack(options);
  const std::shared_ptr<Tier> tier =
      Tier::open(store.address(), stack.layers(), quiet_tier_options());
  PrefixCache cache(stack.layers(), {.slots = 2, .tier = tier});
  const auto prompt = [](int32_t round) { return tokens(10000 * (round + 1), 40); };
  const Tokens reply = tokens(400, 4);
  for (int32_t round = 0; round < kRounds; ++round) {
    // Slot 0's first turn: its close leaves a restore point at 43 whose window is lazy in slot
    // 0's ring.
    const Tokens conversation = prompt(round) + Tokens(reply.begin(), reply.end() - 1);
    (void)run_turn(cache, stack, prompt(round), reply);
    std::atomic<bool> decoding{false};
    std::thread decoder([&] {  // slot 0's next turn, decoding one token a step
      Tokens sequence = conversation + Tokens{reply.back()};
      PrefixCache::Session session = cache.begin(0, sequence);
      EXPECT_TRUE(stack.forward_and_check(session.remaining(), sequence, 0));
      session.prefill_done();
      decoding = true;
      for (int32_t t = 0; t < kWindow + 4; ++t) {
        const int32_t token = 500 + t;
        session.append_output(token);
        sequence.push_back(token);
        EXPECT_TRUE(stack.forward_and_check(std::span(&token, 1), sequence, 0));
      }
      session.close();
    });
    while (!decoding) std::this_thread::yield();
    const Tokens next = conversation + tokens(700, 4);
    PrefixCache::Session second = cache.begin(1, next);
    EXPECT_EQ(second.cached(), 43);
    EXPECT_TRUE(stack.forward_and_check(second.remaining(), next, 1));
    second.prefill_done();
    second.close();  // stores point 43 while slot 0 decodes
    decoder.join();
  }
  ASSERT_TRUE(tier->flush());
  HybridStack fresh(options);
  PrefixCache other(fresh.layers(),
                    {.tier = Tier::open(store.address(), fresh.layers(), quiet_tier_options())});
  for (int32_t round = 0; round < kRounds; ++round) {
    const Tokens request = prompt(round) + Tokens(reply.begin(), reply.end() - 1) + tokens(900, 3);
    PrefixCache::Session session = other.begin(request);
    EXPECT_EQ(session.cached(), 43);
    EXPECT_TRUE(fresh.forward_and_check(session.remaining(), request)) << "round " << round;
    session.close();
  }
}

// A folder for saved caches: in /dev/shm when there is one (a save's fsync costs nothing there,
// so saves come back to back).
std::string save_folder(const std::string& name) {
  const std::filesystem::path shm("/dev/shm");
  const std::filesystem::path base =
      std::filesystem::is_directory(shm) ? shm : std::filesystem::temp_directory_path();
  const auto dir = base / ("kvsnap_threads_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

// PrefixCache::save while a slot's forward runs on another thread (each slot's forward may run
// on its own thread): the trie's lazy snapshots name columns of the live caches (here the
// window's ring) that a forward overwrites — after copying them out — so a save copies them
// under the caches' locks. Each turn below is saved while its decode step shifts the ring; every
// saved file then restores to outputs equal to recomputation.
TEST(PrefixCacheThreads, SavesWhileASlotForwardsHoldConsistentState) {
  constexpr int32_t kTurns = 8;
  HybridStack stack(StackOptions{.check_copies = false});
  PrefixCache cache(stack.layers());
  Tokens conversation = tokens(1, 6);
  run_turn(cache, stack, conversation, tokens(50, 2));  // the root's first child: saved first
  conversation = conversation + tokens(50, 2);
  // Other requests, saved after the conversation's nodes: a save reads them while the forward
  // runs.
  for (int32_t f = 0; f < 24; ++f) run_turn(cache, stack, tokens(10000 + 100 * f, 20), {7, 8});
  std::atomic<int32_t> begun{0}, saving{0};  // turns begun; saves started
  std::thread forwards([&] {
    for (int32_t turn = 0; turn < kTurns; ++turn) {
      const Tokens prompt = conversation + tokens(1000 + 10 * turn, 3);
      PrefixCache::Session session = cache.begin(prompt);
      EXPECT_TRUE(stack.forward_and_check(session.remaining(), prompt));
      session.prefill_done();  // captures in the window's ring: lazy nodes
      const Tokens sequence = prompt + Tokens{2000 + turn};
      session.append_output(2000 + turn);
      begun = turn + 1;
      while (saving.load() <= turn) std::this_thread::yield();
      // The save has read the conversation's nodes by now and reads the others' while this
      // decode step shifts the window's ring over the columns those nodes name.
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      EXPECT_TRUE(stack.forward_and_check(Tokens{2000 + turn}, sequence));
      session.append_output(3000 + turn);  // not evaluated: the next prompt's first token
      session.close();
      conversation = sequence + Tokens{3000 + turn};
    }
  });
  std::vector<std::string> saved;
  for (int32_t turn = 0; turn < kTurns; ++turn) {
    while (begun.load() <= turn) std::this_thread::yield();
    saved.push_back(save_folder(std::to_string(turn)));
    saving = turn + 1;
    cache.save(saved.back(), "m");
  }
  forwards.join();
  // In each file, the restore points at the end (turns', captures') are those a forward may have
  // overwritten while it was saved: each restores to outputs equal to recomputation.
  for (const std::string& dir : saved) {
    HybridStack fresh(StackOptions{.check_copies = false});
    PrefixCache loaded(fresh.layers());
    loaded.load(dir, "m");
    const int64_t deepest = loaded.match(conversation);
    for (int64_t end = deepest; end > std::max<int64_t>(0, deepest - 12); --end) {
      const Tokens prompt(conversation.begin(), conversation.begin() + end + 1);
      PrefixCache::Session session = loaded.begin(prompt);
      if (session.cached() != end) continue;  // not a restore point
      EXPECT_TRUE(fresh.forward_and_check(session.remaining(), prompt))
          << "restored " << end << " tokens (of " << deepest << ") from " << dir;
    }
    std::filesystem::remove_all(dir);
  }
}

// One session's calls from two threads, one at a time (the Python binding allows it): a close on
// one thread while the other asks for cached() — the session's owner is read under the lock.
TEST(PrefixCacheThreads, ASessionClosedWhileAnotherThreadCallsIt) {
  HybridStack stack;
  PrefixCache cache(stack.layers());
  for (int32_t round = 0; round < 100; ++round) {
    PrefixCache::Session session = cache.begin(tokens(100 + round, 3));
    std::atomic<bool> started{false};
    std::thread other([&] {
      started = true;
      for (;;) {
        try {
          (void)session.cached();
        } catch (const Error&) {
          return;  // closed
        }
      }
    });
    while (!started) std::this_thread::yield();
    session.close();
    other.join();
  }
}

}  // namespace
}  // namespace kvsnap
