// The README's "API by example", compiled and run (ctest `api_tour`) so the README stays true.
#include <kvsnap/kvsnap.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <vector>

using namespace kvsnap;

namespace {

Array tokens_kv(int64_t tokens, float seed) {
  std::vector<float> values(static_cast<size_t>(2 * tokens * 8));
  for (size_t i = 0; i < values.size(); ++i)
    values[i] = std::sin(seed + 0.1f * static_cast<float>(i));
  return Array::from_floats(values, {1, 2, tokens, 8}, DType::f16);
}

}  // namespace

int main() {
  // Arrays: cheap handles over shared, accounted storage.
  auto a = Array::from_floats(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3}, DType::f16);
  auto col = a.slice(1, 1, 2);
  if (!col.shares_storage(a) || col.to_floats() != std::vector<float>{2, 5}) return 1;

  // A KV cache: update returns the history the layer attends to.
  KVCache cache;
  const std::vector<int32_t> prompt{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  Batch batch = Batch::single(prompt, cache.offset());
  KVHistory history = cache.update(batch, tokens_kv(12, 0.0f), tokens_kv(12, 1.0f));
  Array q = Array::from_floats(std::vector<float>(4 * 12 * 8, 0.5f), {1, 4, 12, 8});
  Array out = sdpa(batch, q, history, AttentionMask::causal(), 1.0f / std::sqrt(8.0f));

  // Lazy snapshots, rewinds and restores.
  SnapshotPtr s = cache.snapshot(0);
  if (s->size() != 0 || !cache.restore(nullptr, 5) || !cache.restore(s.get(), 12)) return 2;

  // Captures inside one batched write.
  KVCache prefill;
  prefill.prepare_snapshots(std::vector<int64_t>{4, 8});
  (void)prefill.update(Batch::uniform(1, 12, 0), tokens_kv(12, 2.0f), tokens_kv(12, 3.0f));
  std::vector<SnapshotPtr> edges = prefill.take_snapshots();
  if (edges.size() != 2 || edges[1]->from() != 4 || edges[1]->to() != 8) return 3;

  // The prefix cache over a stack with a stateless layer.
  KVCache attention;
  PrefixCache prefix({&attention, nullptr});
  for (int turn = 0; turn < 2; ++turn) {
    PrefixCache::Session session = prefix.begin(prompt);
    if (session.cached() <= 6) session.schedule_snapshots(std::vector<int64_t>{6});
    const auto remaining = session.remaining();
    (void)attention.update(Batch::single(remaining, session.cached()),
                           tokens_kv(static_cast<int64_t>(remaining.size()), 4.0f),
                           tokens_kv(static_cast<int64_t>(remaining.size()), 5.0f));
    session.prefill_done();
    session.append_output(42);
    session.close();
  }
  if (prefix.stats().reused_tokens != 11) return 4;

  // What a write would copy, and a forward cut short.
  (void)cache.restore(nullptr, 5);
  if (cache.lazy_bytes(5, 12) != 7 * 2 * 2 * 8 * 2) return 6;  // s names slots 5..11
  KVCache cut;
  cut.prepare_snapshots(std::vector<int64_t>{4, 8});
  (void)cut.update(Batch::uniform(1, 6, 0), tokens_kv(6, 2.0f), tokens_kv(6, 3.0f));
  if (cut.take_reached_snapshots().size() != 1) return 7;
  (void)cache.restore(s.get(), 12);

  // The buffer pool.
  const PoolOptions pool = pool_options();
  set_pool_options({.max_bytes = int64_t(1) << 30, .idle_seconds = 5});
  trim_pool();
  set_pool_options(pool);

  // Persistence.
  const auto dir = std::filesystem::temp_directory_path() / "kvsnap_api_tour";
  std::filesystem::create_directories(dir);
  save_snapshots((dir / "turn.safetensors").string(), cache.offset(), {s.get()});
  LoadedSnapshots loaded = load_snapshots((dir / "turn.safetensors").string());
  prefix.save((dir / "cache").string(), "tour");
  PrefixCache restarted({&attention, nullptr});
  restarted.load((dir / "cache").string(), "tour");
  std::filesystem::remove_all(dir);
  if (loaded.offset != 12 || restarted.node_count() != prefix.node_count()) return 5;

  std::printf("api tour: ok (output %s, %lld trie nodes)\n", out.describe().c_str(),
              static_cast<long long>(restarted.node_count()));
  return 0;
}
