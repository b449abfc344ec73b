// The index of lazy pieces a KV store keeps: its range sums against a brute-force count over
// random pieces linked and unlinked in any order, some with storage (partly copied out).
#include "cache/lazy_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

namespace kvsnap::detail {
namespace {

TEST(LazyIndex, SumsEqualABruteForceCountAsPiecesComeAndGo) {
  std::mt19937 rng(11);
  std::vector<std::unique_ptr<Piece>> pieces;
  LazyIndex index;
  const auto brute = [&](int64_t from, int64_t to, bool unbacked_only) {
    int64_t total = 0;
    for (const auto& p : pieces) {
      if (!p->indexed || (unbacked_only && !p->keys.empty())) continue;
      total += std::max<int64_t>(0, std::min(to, p->lazy_end()) - std::max(from, p->lazy_begin()));
    }
    return total;
  };
  for (int round = 0; round < 3000; ++round) {
    if (rng() % 3 != 0 || pieces.empty()) {
      auto p = std::make_unique<Piece>();
      p->column = rng() % 200;
      p->tokens = 1 + rng() % 40;
      p->owned = rng() % 2 == 0 ? 0 : static_cast<int64_t>(rng() % p->tokens);
      if (p->owned > 0 || rng() % 4 == 0) p->keys = Array::zeros(DType::f32, {1});  // storage
      index.insert(p.get());
      pieces.push_back(std::move(p));
    } else {
      const size_t i = rng() % pieces.size();
      if (pieces[i]->indexed) index.erase(pieces[i].get());
      pieces.erase(pieces.begin() + static_cast<std::ptrdiff_t>(i));
    }
    const auto from = static_cast<int64_t>(rng() % 260) - 10;
    const int64_t to = from + static_cast<int64_t>(rng() % 80);
    std::vector<Piece*> overlapping;
    index.overlapping(from, to, overlapping);
    int64_t columns = 0;
    for (const Piece* p : overlapping) {
      columns += std::min(to, p->lazy_end()) - std::max(from, p->lazy_begin());
    }
    ASSERT_EQ(columns, brute(from, to, false)) << "round " << round;
    ASSERT_EQ(index.unbacked_from(from), brute(from, INT64_MAX, true)) << "round " << round;
    ASSERT_EQ(index.unbacked_from(INT64_MIN), brute(INT64_MIN, INT64_MAX, true));
  }
}

}  // namespace
}  // namespace kvsnap::detail
