// A steady-state decode step allocates nothing: every global operator new is counted while 100
// decode steps of each cache kind run — updates, recurrent get/put, a capture and its release,
// and a live rewind. (Its own binary: the counting operator new replaces the global one.)
#include <gtest/gtest.h>
#include <kvsnap/kvsnap.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <new>
#include <thread>

#include "support/cache_support.h"
#include "support/replaced_new.h"

namespace {
std::atomic<int64_t> allocations{0};
std::atomic<size_t> largest{0};  // the largest allocation since it was last set to 0
}  // namespace

// Every form of global operator new is counted (support/replaced_new.h).
void kvsnap::testing::on_allocation(std::size_t bytes) {
  allocations.fetch_add(1, std::memory_order_relaxed);
  size_t seen = largest.load(std::memory_order_relaxed);
  while (bytes > seen && !largest.compare_exchange_weak(seen, bytes, std::memory_order_relaxed)) {
  }
}

namespace kvsnap {
namespace {

using testing::TokenKV;

const TokenKV kv{.heads = 8, .depth = 64, .dtype = DType::f16};

// Runs `step` 100 times after 100 warm-up steps; returns the global allocations it made.
template <class Step>
int64_t allocations_of(Step&& step) {
  for (int i = 0; i < 100; ++i) step();
  const int64_t before = allocations.load();
  for (int i = 0; i < 100; ++i) step();
  return allocations.load() - before;
}

TEST(DecodeAllocation, TheCounterSeesEveryAllocation) {
  // The check itself: a step that allocates is seen, a shared_ptr copy is not.
  EXPECT_EQ(allocations_of([] { delete new int(1); }), 100);
  const Array a = Array::zeros(DType::f32, {2, 3});
  EXPECT_EQ(allocations_of([&] { (void)a.slice(1, 0, 2); }), 0);
  EXPECT_EQ(allocations_of([&] { (void)Array::zeros(DType::f32, {2}); }), 200);  // storage, buffer
}

TEST(DecodeAllocation, KVCacheUpdateCaptureAndRewindAllocateNothing) {
  KVCache cache;
  cache.reserve(4096);
  testing::write(cache, kv, testing::id_range(0, 64));
  const std::vector<int64_t> token{7};
  const Array keys = kv.keys(token), values = kv.values(token);
  Batch batch = Batch::uniform(1, 1, 0);
  const auto decode = [&] {
    batch.seq_offsets[0] = static_cast<int32_t>(cache.offset());
    const KVHistory history = cache.update(batch, keys, values);
    (void)history;
  };
  EXPECT_EQ(allocations_of([&] {
              decode();
              SnapshotPtr capture = cache.snapshot(cache.offset() - 8);  // lazy, pooled object
              capture.reset();
              ASSERT_TRUE(cache.restore(nullptr, cache.offset() - 1));  // a rejected token
              decode();
            }),
            0);
}

// A decode step of sequence 0: a token at its offset, its history let go.
void decode_step(Attention& cache, Batch& batch, const Array& keys, const Array& values) {
  batch.seq_offsets[0] = static_cast<int32_t>(cache.offset());
  const KVHistory history = cache.update(batch, keys, values);
  (void)history;
}

TEST(DecodeAllocation, RotatingKVCacheRingUpdateAndCaptureAllocateNothing) {
  RotatingKVCache cache(256);
  testing::write(cache, kv, testing::id_range(0, 300));  // a chunk: longer than the window
  const std::vector<int64_t> token{7};
  const Array keys = kv.keys(token), values = kv.values(token);
  Batch batch = Batch::uniform(1, 1, 0);
  EXPECT_EQ(allocations_of([&] {
              decode_step(cache, batch, keys, values);
              SnapshotPtr window = cache.snapshot(0);  // lazy runs of the ring
              window.reset();
            }),
            0);
}

TEST(DecodeAllocation, RotatingKVCacheLiveRewindAllocatesNothing) {
  RotatingKVCache cache(4096);  // nothing evicted yet: live rewinds are allowed
  // 32 tokens take a buffer of 256 columns (room for as much again, in steps of 256): the 200
  // steps below, each a token longer, stay within it.
  testing::write(cache, kv, testing::id_range(0, 32));
  const std::vector<int64_t> token{7};
  const Array keys = kv.keys(token), values = kv.values(token);
  Batch batch = Batch::uniform(1, 1, 0);
  EXPECT_EQ(allocations_of([&] {
              for (int i = 0; i < 2; ++i) {
                batch.seq_offsets[0] = static_cast<int32_t>(cache.offset());
                (void)cache.update(batch, keys, values);
              }
              ASSERT_TRUE(cache.restore(nullptr, cache.offset() - 1));
            }),
            0);
}

TEST(DecodeAllocation, RecurrentGetPutAndCaptureAllocateNothing) {
  RecurrentCache cache(3, 64, 4, 32, 32);
  const Batch first = Batch::uniform(1, 1, 0);
  (void)cache.get(first, DType::f32);
  // The states a kernel would return, made up front (the kernel's own buffers are its own).
  const Array conv[2] = {Array::zeros(DType::f32, {1, 3, 64}),
                         Array::zeros(DType::f32, {1, 3, 64})};
  const Array delta[2] = {Array::zeros(DType::f32, {1, 4, 32, 32}),
                          Array::zeros(DType::f32, {1, 4, 32, 32})};
  Batch batch = Batch::uniform(1, 1, 0);
  int parity = 0;
  EXPECT_EQ(allocations_of([&] {
              batch.seq_offsets[0] = static_cast<int32_t>(cache.offset());
              const RecurrentHistory history = cache.get(batch, DType::f32);
              (void)history;
              (void)cache.snapshot_splits(1);
              cache.put(batch, std::span(&conv[parity], 1), std::span(&delta[parity], 1));
              parity ^= 1;
              SnapshotPtr capture = cache.snapshot(0);  // shares the state: pooled object only
              ASSERT_TRUE(cache.restore(capture.get(), cache.offset()));
              ASSERT_TRUE(cache.restore(nullptr, cache.offset()));
            }),
            0);
}

// Releasing blocks allocates nothing (destructors release them): a PagedKVCache whose pool grew
// a block at a time while none was free is destroyed while a snapshot holds half its blocks,
// then the snapshot goes too.
TEST(DecodeAllocation, PagedKVCacheReleasesBlocksWithoutAllocating) {
  auto cache = std::make_unique<PagedKVCache>(
      PagedKVCache::Options{.block_tokens = 1, .blocks_per_chunk = 1});
  testing::write(*cache, kv, testing::id_range(0, 64));  // 64 growths, none with a block free
  SnapshotPtr half = cache->snapshot(32);
  const int64_t before = allocations.load();
  cache.reset();  // frees blocks [0, 32); the snapshot keeps the others
  half.reset();   // frees them
  EXPECT_EQ(allocations.load() - before, 0);
}

// A speculation round over the three kinds — begin (captures scheduled), the verify write of
// 1 + k tokens, accept (rewind or restore of a capture, captures released) — allocates nothing
// once warm, whatever the accepted length.
TEST(DecodeAllocation, SpeculationRoundAllocatesNothing) {
  constexpr int64_t k = 3;
  KVCache attention;
  attention.reserve(4096);  // 200 rounds stay inside it
  RotatingKVCache window(8);
  RecurrentCache recurrent(3, 64, 4, 32, 32);
  testing::write(attention, kv, testing::id_range(0, 64));
  testing::write(window, kv, testing::id_range(0, 64));  // evicted: it captures
  const std::vector<int64_t> ids = testing::id_range(64, k + 1);
  const Array keys = kv.keys(ids), values = kv.values(ids);
  const Batch first = Batch::uniform(1, 64, 0);
  (void)recurrent.get(first, DType::f32);
  std::vector<Array> conv, delta;  // what the kernels would return for the 1 + k tokens
  for (int64_t i = 0; i <= k; ++i) {
    conv.push_back(Array::zeros(DType::f32, {1, 3, 64}));
    delta.push_back(Array::zeros(DType::f32, {1, 4, 32, 32}));
  }
  recurrent.put(first, std::span(conv).first(1), std::span(delta).first(1));  // at 64 too
  Speculation round({&attention, &window, &recurrent});
  Batch batch = Batch::uniform(1, k + 1, 0);
  int64_t accepted = 0;
  EXPECT_EQ(allocations_of([&] {
              round.begin(k);
              batch.seq_offsets[0] = static_cast<int32_t>(attention.offset());
              (void)attention.update(batch, keys, values);
              (void)window.update(batch, keys, values);
              const RecurrentHistory history = recurrent.get(batch, DType::f32);
              (void)history;
              recurrent.put(batch, conv, delta);
              round.accept(accepted);
              accepted = (accepted + 1) % (k + 1);
            }),
            0);
  EXPECT_GT(round.stats().restores, 0);
  EXPECT_GT(round.stats().rewinds, 0);
}

// append_output, the PrefixCache call per decoded token, allocates nothing: under the budget,
// and over it when nothing more can be evicted — here a window snapshot the caller holds keeps
// the ring's exposure above a zero budget, and the last resort is not retried while the trie
// is unchanged.
TEST(DecodeAllocation, AppendOutputAllocatesNothingUnderOrOverTheBudget) {
  for (const int64_t budget : {int64_t{1} << 30, int64_t{0}}) {
    KVCache attention;
    RotatingKVCache window(8);
    PrefixCache cache({&attention, &window}, {.max_paged_out_bytes = budget});
    std::vector<int32_t> prompt(20);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i);
    PrefixCache::Session session = cache.begin(prompt);
    testing::write(attention, kv, testing::id_range(0, 20));
    testing::write(window, kv, testing::id_range(0, 20));
    session.prefill_done();
    const SnapshotPtr held = window.snapshot(0);  // lazy in the ring: exposed, not the trie's
    EXPECT_EQ(allocations_of([&] {
                session.append_output(7);
                session.retract_outputs(1);  // the session's token list keeps its size
              }),
              0)
        << "budget " << budget;
    EXPECT_EQ(cache.check_invariants(), "");
  }
}

// Continuous batching: a decode step of two sequences at different offsets — one update, a
// ragged history — allocates nothing once warm on any attention kind: the rows' batches, the
// history's rows and a paged sequence's columns are kept for reuse by the cache (a history comes
// back when its caller lets it go). Warm: both sequences written to 300 tokens in one update
// (the pool's blocks taken, the kept histories that long), then rewound to 64 and 30 (a window
// is not: it wraps).
TEST(DecodeAllocation, AStepOfTwoSequencesAllocatesNothing) {
  const std::vector<int64_t> token{7};
  const Array keys = kv.keys(token, 2), values = kv.values(token, 2);
  for (const std::string kind : {"kv", "window", "paged"}) {
    std::unique_ptr<Attention> cache;
    if (kind == "kv") {
      auto contiguous = std::make_unique<KVCache>();
      contiguous->reserve(4096);
      cache = std::move(contiguous);
    }
    if (kind == "window") cache = std::make_unique<RotatingKVCache>(256);
    if (kind == "paged") cache = std::make_unique<PagedKVCache>(PagedKVCache::Options{});
    Batch warm = Batch::uniform(2, 300, 0);
    warm.seq_ids = {0, 1};
    const std::vector<int64_t> ids = testing::id_range(0, 300);
    (void)cache->update(warm, kv.keys(ids, 2), kv.values(ids, 2));
    if (kind != "window") {
      ASSERT_TRUE(cache->restore(0, nullptr, 64));
      ASSERT_TRUE(cache->restore(1, nullptr, 30));
    }
    Batch step = Batch::uniform(2, 1, 0);
    step.seq_ids = {0, 1};
    EXPECT_EQ(allocations_of([&] {
                step.seq_offsets = {static_cast<int32_t>(cache->offset(0)),
                                    static_cast<int32_t>(cache->offset(1))};
                const KVHistory history = cache->update(step, keys, values);
                EXPECT_EQ(history.rows(), 2);
                EXPECT_EQ(cache->view(step).rows(), 2);
              }),
              0)
        << kind;
  }
}

// A paged sequence's decode step and a capture of its last tokens (their blocks' references),
// warm as above.
TEST(DecodeAllocation, PagedKVCacheUpdateAndCaptureAllocateNothing) {
  PagedKVCache cache;
  testing::write(cache, kv, testing::id_range(0, 300));
  ASSERT_TRUE(cache.restore(0, nullptr, 64));
  const std::vector<int64_t> token{7};
  const Array keys = kv.keys(token), values = kv.values(token);
  Batch batch = Batch::uniform(1, 1, 0);
  EXPECT_EQ(allocations_of([&] { decode_step(cache, batch, keys, values); }), 0);
  EXPECT_EQ(allocations_of([&] {
              SnapshotPtr capture = cache.snapshot(0, cache.offset() - 8);
              capture.reset();
            }),
            0);
}

// The same for a recurrent cache: get and put of two sequences' states.
TEST(DecodeAllocation, RecurrentGetAndPutOfTwoSequencesAllocateNothing) {
  RecurrentCache cache(3, 64, 4, 32, 32);
  Batch step = Batch::uniform(2, 1, 0);
  step.seq_ids = {0, 1};
  (void)cache.get(step, DType::f32);
  const RecurrentStates states[2] = {
      {{Array::zeros(DType::f32, {1, 3, 64})}, {Array::zeros(DType::f32, {1, 4, 32, 32})}},
      {{Array::zeros(DType::f32, {1, 3, 64})}, {Array::zeros(DType::f32, {1, 4, 32, 32})}}};
  EXPECT_EQ(allocations_of([&] {
              step.seq_offsets = {static_cast<int32_t>(cache.offset(0)),
                                  static_cast<int32_t>(cache.offset(1))};
              const RecurrentHistory history = cache.get(step, DType::f32);
              EXPECT_EQ(history.rows(), 2);
              cache.put(step, std::span(states, 2));
            }),
            0);
}

// Continuous batching over paged caches: a decode step's scores take room for each row's own
// columns, not every row as long as the longest. 64 rows — one of 40000 tokens, 63 of 10 — take
// 4 heads x (40000 + 63 x 16) floats of scratch (0.7 MB), not 64 x 4 x 40000 (41 MB). Run on a
// fresh thread: its scratch is its own.
TEST(DecodeAllocation, ADecodeStepsScoresTakeRoomForEachRowsColumns) {
  constexpr int64_t kRows = 64, kLong = 40000, kShort = 10, kBlock = 16, kDepth = 32;
  const int64_t blocks = kLong / kBlock + kRows;
  const Array keys = Array::zeros(DType::f32, {1, 1, blocks * kBlock, kDepth});
  const Array values = keys.clone();
  std::vector<KVHistory> rows;
  Batch batch = Batch::uniform(kRows, 1, 0);
  batch.seq_ids.clear();
  for (int64_t b = 0; b < kRows; ++b) {
    std::vector<int32_t> table;
    const int64_t length = b == 0 ? kLong : kShort;
    if (b == 0) {
      for (int64_t i = 0; i < kLong / kBlock; ++i) table.push_back(static_cast<int32_t>(i));
    } else {
      table.push_back(static_cast<int32_t>(kLong / kBlock + b));
    }
    rows.emplace_back(PagedColumns{{keys}, {values}, blocks, kBlock, table, length});
    batch.seq_offsets[static_cast<size_t>(b)] = static_cast<int32_t>(length - 1);
  }
  const KVHistory history = KVHistory::of_rows(std::move(rows));
  const Array q = Array::zeros(DType::f32, {kRows, 4, 1, kDepth});
  size_t peak = 0;
  std::thread([&] {
    largest = 0;
    const Array out = sdpa(batch, q, history, AttentionMask::causal(), 0.2f);
    peak = largest.load();
    EXPECT_EQ(out.dim(0), kRows);
  }).join();
  const size_t scores = 4 * (kLong + (kRows - 1) * kBlock) * sizeof(float);
  EXPECT_LE(peak, 2 * scores);
  EXPECT_GE(peak, scores / 2);  // the scores' scratch is the largest
}

}  // namespace
}  // namespace kvsnap
