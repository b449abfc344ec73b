// Running out of memory inside every PrefixCache call, one allocation at a time: for each n, the
// n-th allocation the calls make fails (std::bad_alloc), the run goes on, and the trie must stay
// consistent and restore only state that equals recomputation; a load that fails must leave the
// trie it would have replaced as it was. (Its own binary: the failing
// operator new replaces the global one.)
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "prefix/trie.h"
#include "prefix/trie_file.h"
#include "support/conversation.h"
#include "support/failing_allocation.h"

namespace kvsnap::prefix_oom_test {
namespace {

using testing::armed_call;
using testing::failed_in_run;
using testing::HybridStack;
using testing::run_turn;
using testing::start_run;
using testing::Tokens;
using testing::tokens;
using testing::operator+;

// Prompts that share a system prompt and diverge inside each other's edges (splits), with a
// budget small enough that serving them evicts leaves and joins nodes (merges).
const Tokens kSystem = tokens(100, 12);
const std::vector<Tokens> kPrompts = {
    kSystem + tokens(200, 6),
    kSystem + tokens(200, 3) + tokens(300, 4),  // splits the first one's edge
    tokens(100, 7) + tokens(400, 5),            // splits the system prompt
    kSystem + tokens(200, 6) + tokens(500, 4),  // continues the first
    tokens(600, 9),
};
const Tokens kReply = tokens(900, 3);

// One request with each PrefixCache call armed; the forwards (the test's reference model) are
// not. A begin, prefill_done or close that runs out ends the request (a session is closed when
// its handle goes); an append_output that does is called again.
void serve(PrefixCache& cache, HybridStack& stack, const Tokens& prompt) {
  std::optional<PrefixCache::Session> session;
  if (!armed_call([&] { session.emplace(cache.begin(prompt)); })) return;
  // A restore point near the prompt's end; one that runs out leaves the session's schedule as
  // it was, and the request goes on.
  const std::vector<int64_t> mark{static_cast<int64_t>(prompt.size()) - 3};
  if (mark.front() > session->cached()) {
    (void)armed_call([&] { session->schedule_snapshots(mark); });
  }
  ASSERT_TRUE(stack.forward_and_check(session->remaining(), prompt));
  if (!armed_call([&] { session->prefill_done(); })) return;
  Tokens sequence = prompt;
  for (size_t i = 0; i < kReply.size(); ++i) {
    // One that runs out recorded nothing: the server calls it again.
    if (!armed_call([&] { session->append_output(kReply[i]); })) session->append_output(kReply[i]);
    sequence.push_back(kReply[i]);
    if (i + 1 < kReply.size()) {
      ASSERT_TRUE(stack.forward_and_check(std::span(&kReply[i], 1), sequence));
    }
  }
  (void)armed_call([&] { session->close(); });
}

// Whatever allocation fails, in whichever call, the trie stays consistent within its budget, what
// it saves loads, and every later request restores state equal to recomputation (run_turn checks
// every output). A split or merge that runs out leaves a node without a KV range: restores stop
// there.
class PrefixCacheOutOfMemory : public ::testing::TestWithParam<bool> {};  // paged attention?

TEST_P(PrefixCacheOutOfMemory, EveryFailedAllocationLeavesATrieThatRestoresRightly) {
  const testing::StackOptions options{.paged = GetParam()};
  const int64_t runs = testing::sweep([&] {
    HybridStack stack(options);
    PrefixCache cache(stack.layers(), {.max_paged_out_bytes = 6000});
    for (const Tokens& prompt : kPrompts) {
      serve(cache, stack, prompt);
      ASSERT_EQ(cache.check_invariants(), "") << cache.debug_string();
      ASSERT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
    }
    testing::disarm();
    // What it saves loads (a gap, and what lies below it, is left out of the file).
    {
      const auto dir = std::filesystem::temp_directory_path() /
                       ("kvsnap_oom_sweep_" + std::to_string(::getpid()));
      cache.save(dir.string());
      HybridStack other(options);
      PrefixCache loaded(other.layers());
      loaded.load(dir.string());
      std::filesystem::remove_all(dir);
      ASSERT_EQ(loaded.check_invariants(), "");
      run_turn(loaded, other, kPrompts.front(), kReply);
    }
    for (const Tokens& prompt : kPrompts) {
      // The prompt, then over what the run paged out (the prompt and its reply), restored at
      // least as far as the prompt: any gap on its path was filled again.
      run_turn(cache, stack, prompt, kReply);
      EXPECT_GE(run_turn(cache, stack, prompt + kReply + tokens(950, 2), kReply).cached,
                static_cast<int64_t>(prompt.size()) - 1);
      if (::testing::Test::HasFailure()) return;
    }
  });
  EXPECT_GT(runs, 100);
}

// Two requests at once on two slots, each call armed: a call that runs out ends its own request,
// and the other slot's goes on — its caches are not the failed call's to touch.
void serve_pair(PrefixCache& cache, HybridStack& stack, const Tokens& first, const Tokens& second) {
  std::optional<PrefixCache::Session> sessions[2];
  Tokens sequences[2] = {first, second};
  const auto each = [&](const std::function<void(SeqId)>& step) {
    for (SeqId slot = 0; slot < 2; ++slot) {
      if (sessions[slot].has_value()) step(slot);
    }
  };
  for (SeqId slot = 0; slot < 2; ++slot) {
    if (!armed_call([&] { sessions[slot].emplace(cache.begin(slot, sequences[slot])); })) {
      sessions[slot].reset();
    }
  }
  each([&](SeqId slot) {
    ASSERT_TRUE(stack.forward_and_check(sessions[slot]->remaining(), sequences[slot], slot));
  });
  each([&](SeqId slot) {
    if (!armed_call([&] { sessions[slot]->prefill_done(); })) sessions[slot].reset();
  });
  for (size_t i = 0; i < kReply.size(); ++i) {
    each([&](SeqId slot) {
      if (!armed_call([&] { sessions[slot]->append_output(kReply[i]); })) {
        sessions[slot].reset();
        return;
      }
      sequences[slot].push_back(kReply[i]);
      if (i + 1 < kReply.size()) {
        ASSERT_TRUE(stack.forward_and_check(std::span(&kReply[i], 1), sequences[slot], slot));
      }
    });
  }
  each([&](SeqId slot) { (void)armed_call([&] { sessions[slot]->close(); }); });
}

TEST_P(PrefixCacheOutOfMemory, TwoSlotsAtOnceKeepTheirStateWhenTheOtherRunsOut) {
  const testing::StackOptions options{.paged = GetParam()};
  const int64_t runs = testing::sweep([&] {
    HybridStack stack(options);
    PrefixCache cache(stack.layers(), {.max_paged_out_bytes = 6000, .slots = 2});
    for (size_t i = 0; i + 1 < kPrompts.size(); ++i) {  // each prompt beside the next
      serve_pair(cache, stack, kPrompts[i], kPrompts[i + 1]);
      ASSERT_EQ(cache.check_invariants(), "") << cache.debug_string();
      ASSERT_EQ(cache.paged_out_bytes(), cache.recount_paged_out_bytes());
    }
    testing::disarm();
    for (const Tokens& prompt : kPrompts) {
      run_turn(cache, stack, prompt, kReply);
      if (::testing::Test::HasFailure()) return;
    }
  });
  EXPECT_GT(runs, 100);
}

INSTANTIATE_TEST_SUITE_P(Attention, PrefixCacheOutOfMemory, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Paged" : "Contiguous"; });

// The layers of `stack` as a trie describes them.
std::vector<detail::LayerInfo> layer_infos(HybridStack& stack) {
  std::vector<detail::LayerInfo> out;
  for (Cache* cache : stack.layers()) {
    out.push_back({cache, cache == nullptr ? RestoreRule{} : cache->restore_rule()});
  }
  return out;
}

void serve_all(PrefixCache& cache, HybridStack& stack) {
  for (const Tokens& prompt : kPrompts) run_turn(cache, stack, prompt, kReply);
}

// A load that runs out of memory once the file is decoded — building the loaded trie (the nodes
// a budget smaller than the file's trie keeps), taking its nodes, resetting the live caches,
// evicting — leaves the trie as it was, or (out in the eviction, after the nodes are taken)
// holds the loaded one, which the next call's eviction brings within the budget. The sweep fails
// each of the load's last B allocations, B being those of building the trie alone. Decoding
// comes before them and is not swept: nlohmann::json's destructors allocate, and a failure inside
// one terminates the process (decoding changes nothing either way).
TEST(PrefixCacheLoadOutOfMemory, ALoadThatRunsOutLeavesTheTrieAsItWas) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("kvsnap_oom_load_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  int64_t saved_nodes = 0;
  {
    HybridStack stack;
    PrefixCache cache(stack.layers());
    testing::warm_up(cache, stack);
    cache.save(dir.string());
    saved_nodes = cache.node_count();
  }
  const auto load = [&](PrefixCache& cache) { cache.load(dir.string()); };
  const PrefixCache::Options small{.max_paged_out_bytes = 3000};
  // The allocations of a load that does not run out, into a cache that has served kPrompts: the
  // same every time once the first has set up what the process keeps (statics, scratch).
  int64_t total = -1, building = 0;
  for (int64_t last = -2; total != last;) {
    last = total;
    HybridStack stack;
    PrefixCache cache(stack.layers(), small);
    serve_all(cache, stack);
    start_run(std::numeric_limits<int64_t>::max());
    ASSERT_TRUE(armed_call([&] { load(cache); }));
    total = testing::counted_allocations();
  }
  {
    HybridStack stack;
    const std::vector<detail::LayerInfo> layers = layer_infos(stack);
    std::ifstream in(dir / "prefix_cache.safetensors", std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    detail::LoadedTrie loaded = detail::read_trie(
        [&](const detail::TensorFilter& keep) { return detail::read_sealed(bytes, "test", keep); },
        "test", layers, "", {}, small.max_paged_out_bytes);
    start_run(std::numeric_limits<int64_t>::max());
    ASSERT_TRUE(armed_call([&] { (void)detail::build_trie(layers, std::move(loaded)); }));
    building = testing::counted_allocations();
  }
  ASSERT_GT(building, 30);
  ASSERT_GT(total, building);
  int64_t refused = 0;
  for (int64_t k = 0; k < building; ++k) {
    SCOPED_TRACE("allocation " + std::to_string(total - k) + " of " + std::to_string(total) +
                 " fails");
    HybridStack stack;
    PrefixCache cache(stack.layers(), small);
    serve_all(cache, stack);
    const std::string before = cache.debug_string();
    start_run(total - k);
    const bool loaded = armed_call([&] { load(cache); });
    ASSERT_TRUE(failed_in_run());  // the load made the allocations measured above
    ASSERT_EQ(cache.check_invariants(), "");
    if (loaded) {  // the eviction ran out: the loaded trie, perhaps still over the budget
      ASSERT_LE(cache.node_count(), saved_nodes);
      ASSERT_GT(cache.node_count(), 0);
    } else {
      ++refused;
      ASSERT_EQ(cache.debug_string(), before);
    }
    // Either way the cache serves, within its budget from its next call on.
    run_turn(cache, stack, kSystem + tokens(200, 6), tokens(300, 4));
    EXPECT_LE(cache.paged_out_bytes(), small.max_paged_out_bytes);
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GT(refused, building / 2);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvsnap::prefix_oom_test
