// PrefixCache::load over a layer whose reset throws (a custom kind): the trie is loaded, and the
// load throws an Error saying so and naming the slot whose layers must be reset (prefix_cache.h).
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>
#include <unistd.h>

#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/cache_support.h"
#include "support/delegating_cache.h"
#include "support/test_support.h"

namespace kvsnap::prefix_contract_gaps_test {
namespace {

using testing::throws_error;

const testing::TokenKV kv;

std::string scratch(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("kvsnap_contract_gaps_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  return dir.string();
}

// A custom attention kind over a KVCache: every call forwarded, every sequence served, but
// reset(seq) of sequence `failing` throws while `fail` is set (a kind whose reset can fail).
class ResetFails final : public testing::DelegatingCache {
 public:
  explicit ResetFails(KVCache& inner) : DelegatingCache(inner), kv_(inner) {}
  bool fail = false;
  SeqId failing = 0;

  void reset(SeqId seq) override {
    if (fail && seq == failing) throw std::runtime_error("ResetFails: no reset today");
    kv_.reset(seq);
  }
  void reset() override { reset(0); }
  std::vector<Array> state(SeqId seq) const override { return kv_.state(seq); }
  int64_t offset(SeqId seq) const override { return kv_.offset(seq); }
  SnapshotPtr snapshot(SeqId seq, int64_t from) override { return kv_.snapshot(seq, from); }
  void prepare_snapshots(SeqId seq, std::span<const int64_t> o) override {
    kv_.prepare_snapshots(seq, o);
  }
  void cancel_snapshots(SeqId seq) override { kv_.cancel_snapshots(seq); }
  std::vector<SnapshotPtr> take_snapshots(SeqId seq) override { return kv_.take_snapshots(seq); }
  std::vector<SnapshotPtr> take_reached_snapshots(SeqId seq) override {
    return kv_.take_reached_snapshots(seq);
  }
  void take_snapshots_into(SeqId seq, std::vector<SnapshotPtr>& into) override {
    kv_.take_snapshots_into(seq, into);
  }
  bool restore(SeqId seq, Snapshot* s, int64_t target) override {
    return kv_.restore(seq, s, target);
  }
  std::vector<SeqId> sequences() const override { return kv_.sequences(); }
  int64_t exposed_bytes(SeqId seq) const override { return kv_.exposed_bytes(seq); }
  int64_t exposed_bytes_after_rewind(SeqId seq, int64_t to) const override {
    return kv_.exposed_bytes_after_rewind(seq, to);
  }
  ScheduleState schedule_state(SeqId seq) const override { return kv_.schedule_state(seq); }

 private:
  KVCache& kv_;
};

const std::vector<int32_t> kPrompt = {5, 6, 7, 8, 9, 10, 11, 12};

// One request for kPrompt on `slot`: the model's forward writes the remaining tokens to `inner`.
int64_t request(PrefixCache& prefix, KVCache& inner, SeqId slot) {
  PrefixCache::Session session = prefix.begin(slot, kPrompt);
  const int64_t cached = session.cached();
  const std::span<const int32_t> rest = session.remaining();
  const std::vector<int64_t> ids(rest.begin(), rest.end());
  (void)inner.update(Batch::rows({{slot, cached, std::vector<int32_t>(rest.begin(), rest.end())}}),
                     kv.keys(ids), kv.values(ids));
  session.prefill_done();
  session.close();
  return cached;
}

// Two slots; slot 1's layer cannot be reset. The load replaces the trie, resets slot 0 all the
// same, and throws naming slot 1 (not slot 0) with the layer's own reason; once that slot is
// reset, its next session restores from the loaded trie.
TEST(PrefixCacheLoadReset, ALayerWhoseResetThrowsGetsAnErrorNamingTheSlot) {
  const std::string dir = scratch("slot");
  KVCache saved_inner;
  ResetFails saved_layer(saved_inner);
  PrefixCache saving({&saved_layer}, {.slots = 2});
  EXPECT_EQ(request(saving, saved_inner, 0), 0);
  saving.save(dir, "model");
  ASSERT_GT(saving.node_count(), 0);

  KVCache inner;
  ResetFails layer(inner);
  PrefixCache prefix({&layer}, {.slots = 2});
  const std::vector<int64_t> other = {40, 41, 42};  // slot 0 holds tokens the load resets
  (void)inner.update(Batch::rows({{0, 0, {40, 41, 42}}}), kv.keys(other), kv.values(other));
  layer.fail = true;
  layer.failing = 1;
  std::string message;
  EXPECT_TRUE(throws_error(
      [&] {
        try {
          prefix.load(dir, "model");
        } catch (const Error& e) {
          message = e.what();
          throw;
        }
      },
      {"PrefixCache::load", "loaded", "slot 1's layers", "ResetFails: no reset today",
       "reset them before its next session"}));
  EXPECT_EQ(message.find("slot 0"), std::string::npos) << message;
  EXPECT_EQ(prefix.node_count(), saving.node_count());  // the trie was loaded
  EXPECT_EQ(inner.offset(0), 0);                        // slot 0 was reset all the same
  EXPECT_EQ(prefix.match(kPrompt), static_cast<int64_t>(kPrompt.size()) - 1);
  layer.fail = false;
  layer.reset(1);
  EXPECT_EQ(request(prefix, inner, 1), static_cast<int64_t>(kPrompt.size()) - 1);
  std::filesystem::remove_all(dir);
}

// A single-slot cache over a custom kind that implements only reset() (Cache's default reset(0)
// calls it): the Error names slot 0, and the error is the layer's, whatever its type.
TEST(PrefixCacheLoadReset, ASingleSequenceLayerWhoseResetThrowsNamesSlotZero) {
  class Refuses final : public testing::DelegatingCache {
   public:
    using DelegatingCache::DelegatingCache;
    bool fail = false;
    void reset() override {
      if (fail) throw Error("Refuses::reset: refused");
      inner_.reset();
    }
  };
  const std::string dir = scratch("single");
  KVCache inner;
  Refuses layer(inner);
  PrefixCache prefix({&layer});
  EXPECT_EQ(request(prefix, inner, 0), 0);
  prefix.save(dir, "model");
  const int64_t nodes = prefix.node_count();
  layer.fail = true;
  EXPECT_TRUE(throws_error([&] { prefix.load(dir, "model"); },
                           {"PrefixCache::load", "slot 0's layers", "Refuses::reset: refused"}));
  EXPECT_EQ(prefix.node_count(), nodes);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvsnap::prefix_contract_gaps_test
