// The kernels' worker threads (ops/parallel.h, kvsnap::set_threads): every task runs exactly
// once for every thread count, a task's exception reaches the caller, nested and concurrent
// regions run (serially) instead of waiting, and bad counts are refused. Also under TSan.
#include "ops/parallel.h"

#include <gtest/gtest.h>
#include <kvsnap/ops.h>

#include <atomic>
#include <cstring>
#include <optional>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "ops/decode_kernels.h"
#include "support/test_support.h"

namespace kvsnap {
namespace {

using testing::throws_error;

// Sets the thread count for one test and puts back the default.
struct Threads {
  explicit Threads(int n) { set_threads(n); }
  ~Threads() { set_threads(1); }
};

TEST(KernelThreads, EveryTaskRunsOnceForEveryThreadCount) {
  for (const int n : {1, 2, 3, 8}) {
    const Threads threads(n);
    EXPECT_EQ(kvsnap::threads(), n);
    for (const int64_t tasks : {0, 1, 2, 7, 1000}) {
      std::vector<std::atomic<int>> runs(static_cast<size_t>(tasks));
      for (int region = 0; region < 20; ++region) {
        detail::parallel_for(tasks, [&](int64_t i) { ++runs[static_cast<size_t>(i)]; });
      }
      for (int64_t i = 0; i < tasks; ++i) {
        ASSERT_EQ(runs[static_cast<size_t>(i)].load(), 20) << n << " threads, task " << i;
      }
    }
  }
}

TEST(KernelThreads, WorkIsSharedAcrossThreads) {
  const Threads threads(2);
  std::atomic<int> inside{0}, most{0};
  // Each task waits (bounded) for another to be running at the same time.
  detail::parallel_for(2, [&](int64_t) {
    const int now = ++inside;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
    for (int spin = 0; spin < 2000000 && most.load() < 2; ++spin) std::this_thread::yield();
    --inside;
  });
  EXPECT_EQ(most.load(), 2);
}

TEST(KernelThreads, ATasksExceptionReachesTheCallerAfterTheRegion) {
  const Threads threads(3);
  std::atomic<int> ran{0};
  EXPECT_THROW(detail::parallel_for(50,
                                    [&](int64_t i) {
                                      ++ran;
                                      if (i == 17) throw std::runtime_error("task 17");
                                    }),
               std::runtime_error);
  EXPECT_EQ(ran.load(), 50);  // the others still ran; the region ended before the rethrow
  std::atomic<int> count{0};  // the pool still works
  detail::parallel_for(10, [&](int64_t) { ++count; });
  EXPECT_EQ(count.load(), 10);
}

TEST(KernelThreads, NestedRegionsRunOnTheTasksThread) {
  const Threads threads(2);
  std::atomic<int> inner{0};
  detail::parallel_for(4, [&](int64_t) {
    EXPECT_EQ(detail::parallel_threads(), 1);
    const std::thread::id self = std::this_thread::get_id();
    detail::parallel_for(5, [&](int64_t) {
      EXPECT_EQ(std::this_thread::get_id(), self);
      ++inner;
    });
  });
  EXPECT_EQ(inner.load(), 20);
}

TEST(KernelThreads, ARegionOfOneTaskLeavesThePoolToTheRegionsItStarts) {
  const Threads threads(2);
  std::atomic<int> together{0};
  detail::parallel_for(1, [&](int64_t) {
    EXPECT_EQ(detail::parallel_threads(), 2);
    std::atomic<int> inside{0};
    detail::parallel_for(2, [&](int64_t) {
      ++inside;
      for (int spin = 0; spin < 2000000 && inside.load() < 2; ++spin) std::this_thread::yield();
      if (inside.load() == 2) ++together;
    });
  });
  EXPECT_EQ(together.load(), 2);  // both inner tasks ran at the same time
}

TEST(KernelThreads, SerialRegionsAlsoRunEveryTaskBeforeRethrowing) {
  const Threads threads(2);
  std::atomic<int> ran{0};
  detail::parallel_for(2, [&](int64_t) {
    EXPECT_THROW(detail::parallel_for(6,
                                      [&](int64_t i) {
                                        ++ran;
                                        if (i == 1) throw std::runtime_error("inner");
                                      }),
                 std::runtime_error);
  });
  EXPECT_EQ(ran.load(), 12);
}

TEST(KernelThreads, SetThreadsFromInsideATaskIsRefused) {
  const Threads threads(2);
  std::atomic<int> refused{0};
  detail::parallel_for(2, [&](int64_t) {
    if (throws_error([] { set_threads(3); }, {"set_threads", "inside a parallel region"})) {
      ++refused;
    }
  });
  EXPECT_EQ(refused.load(), 2);
  EXPECT_EQ(kvsnap::threads(), 2);
}

TEST(KernelThreads, RegionsFromSeveralThreadsAtOnceAllComplete) {
  const Threads threads(2);
  std::vector<std::thread> callers;
  std::atomic<int64_t> total{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int region = 0; region < 200; ++region) {
        std::vector<int> out(64, 0);
        detail::parallel_for(64, [&](int64_t i) { out[static_cast<size_t>(i)] = 1; });
        int64_t sum = 0;
        for (int v : out) sum += v;
        total += sum;
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  EXPECT_EQ(total.load(), 4 * 200 * 64);
}

TEST(KernelThreads, ResizingWhileOtherThreadsRunRegions) {
  std::atomic<bool> stop{false};
  std::atomic<int64_t> done{0};
  std::thread caller([&] {
    while (!stop.load()) {
      std::atomic<int> count{0};
      detail::parallel_for(16, [&](int64_t) { ++count; });
      if (count.load() == 16) ++done;
    }
  });
  for (const int n : {2, 4, 1, 3, 1}) set_threads(n);
  stop = true;
  caller.join();
  EXPECT_GT(done.load(), 0);
}

// sdpa over one history of several rows splits by (row, key/value head): every thread count
// gives bitwise the result of one thread. (Ragged and paged histories: ModelThreads.)
TEST(KernelThreads, SdpaGivesBitwiseTheSameResultForEveryThreadCount) {
  std::mt19937 rng(3);
  const Array q = testing::random_array({3, 8, 20, 16}, rng);
  const Array k = testing::random_array({3, 2, 50, 16}, rng);
  const Array v = testing::random_array({3, 2, 50, 12}, rng);
  for (const AttentionMask& mask : {AttentionMask::causal(), AttentionMask::sliding_window(7)}) {
    const auto run = [&](int n) {
      const Threads threads(n);
      return sdpa(Batch::uniform(3, 20, 30), q, KVHistory(k, v), mask, 0.25f);
    };
    const Array one = run(1);
    for (const int n : {2, 3, 7}) {
      const Array many = run(n);
      ASSERT_EQ(
          std::memcmp(many.data<float>(), one.data<float>(), static_cast<size_t>(one.nbytes())), 0)
          << n << " threads";
    }
  }
}

// Rows of paged histories sharing blocks (the decode planner's jobs) and prefilling ragged
// chunks over them, with the decode kernels and without (the BLAS path): bitwise the same for
// every thread count.
TEST(KernelThreads, PagedRowsGiveBitwiseTheSameResultForEveryThreadCount) {
  std::mt19937 rng(4);
  const int64_t tokens = 4, per_chunk = 16, depth = 32;
  // Four key/value heads: the decode path splits by them, so 3 and 7 threads split otherwise
  // than 2.
  const Array k = testing::random_array({1, 4, per_chunk * tokens, depth}, rng);
  const Array v = testing::random_array({1, 4, per_chunk * tokens, depth}, rng);
  const std::vector<std::vector<int32_t>> tables{{0, 1, 2, 5}, {0, 1, 3}, {0, 4, 6, 7}};
  const std::vector<int64_t> lengths{15, 11, 16};
  std::vector<KVHistory> rows;
  for (size_t r = 0; r < tables.size(); ++r) {
    rows.emplace_back(PagedColumns{{k}, {v}, per_chunk, tokens, tables[r], lengths[r]});
  }
  const KVHistory history = KVHistory::of_rows(rows);
  const Batch decode = Batch::rows({{0, 14, {0}}, {1, 10, {0}}, {2, 15, {0}}});
  const Batch prefill = Batch::rows({{0, 12, {0, 0, 0}}, {1, 9, {0, 0}}, {2, 13, {0, 0, 0}}});
  const Array q1 = testing::random_array({3, 8, 1, depth}, rng);
  const Array q3 = testing::random_array({3, 8, 3, depth}, rng);
  for (const bool kernels : {true, false}) {
    std::optional<detail::DecodeKernelsOff> off;
    if (!kernels) off.emplace();
    for (const auto& [batch, q] : {std::pair{&decode, &q1}, std::pair{&prefill, &q3}}) {
      const auto run = [&](int n) {
        const Threads threads(n);
        return sdpa(*batch, *q, history, AttentionMask::causal(), 0.2f);
      };
      const Array one = run(1);
      for (const int n : {2, 3, 7}) {
        const Array many = run(n);
        ASSERT_EQ(
            std::memcmp(many.data<float>(), one.data<float>(), static_cast<size_t>(one.nbytes())),
            0)
            << n << " threads, " << q->dim(2) << " queries, kernels " << kernels;
      }
    }
  }
}

TEST(KernelThreads, CountsOutsideTheRangeAreRefused) {
  EXPECT_TRUE(throws_error([] { set_threads(0); }, {"set_threads", "0 threads", "[1, 256]"}));
  EXPECT_TRUE(throws_error([] { set_threads(257); }, {"set_threads", "257"}));
  EXPECT_EQ(threads(), 1);  // unchanged
}

}  // namespace
}  // namespace kvsnap
