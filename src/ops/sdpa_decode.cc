#include "ops/sdpa_decode.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/visibility.h"

namespace kvsnap::detail {
namespace {

// One row of the batch: its paged columns and the columns [lo, hi) its query sees.
struct Row {
  const PagedColumns* columns = nullptr;
  int64_t lo = 0, hi = 0;
};

// Block `i` of a row seen by a group of rows that all hold that same block: one product each for
// scores and values covers them all.
struct Job {
  int64_t first = 0, count = 0;  // columns [first, first + count)
  std::vector<int64_t> rows;     // batch rows, ascending
};

bool plain_f32(const std::vector<Array>& chunks) {
  return !chunks.empty() && std::all_of(chunks.begin(), chunks.end(), [](const Array& c) {
    return c.dtype() == DType::f32 && c.strides()[3] == 1;
  });
}

// Start of key/value head `head` of block `i` of `p` (chunks of [blocks, H, T, D]).
const float* block_data(const std::vector<Array>& chunks, const PagedColumns& p, size_t i,
                        int64_t head) {
  const int64_t block = p.table[i];
  const Array& chunk = chunks[static_cast<size_t>(block / p.blocks_per_chunk)];
  return chunk.data<float>() + (block % p.blocks_per_chunk) * chunk.strides()[0] +
         head * chunk.strides()[1];
}

// The rows of the batch when it has the form attend_decode serves; empty otherwise.
std::vector<Row> decode_rows(const Batch& batch, const Array& q, const KVHistory& history,
                             const AttentionMask& logical) {
  const int64_t rows = batch.batch_size();
  if (batch.length() != 1 || q.dtype() != DType::f32 || q.strides()[3] != 1) return {};
  if (history.ragged() ? history.rows() != rows : rows != 1) return {};
  std::vector<Row> out(static_cast<size_t>(rows));
  const PagedColumns* first = nullptr;
  for (int64_t b = 0; b < rows; ++b) {
    const KVHistory& h = history.row(b);
    if (!h.paged() || !plain_f32(h.paged_columns().key_chunks) ||
        !plain_f32(h.paged_columns().value_chunks)) {
      return {};
    }
    const PagedColumns& p = h.paged_columns();
    if (first == nullptr) first = &p;
    if (p.block_tokens != first->block_tokens ||
        p.key_chunks.front().dim(1) != first->key_chunks.front().dim(1) ||
        p.value_chunks.front().dim(3) != first->value_chunks.front().dim(3)) {
      return {};
    }
    const Batch row = batch.row(b);
    const Visibility visibility(row, h, logical.for_row(b), q.dim(1));
    if (!visibility.ordered()) return {};
    Row& r = out[static_cast<size_t>(b)];
    r.columns = &p;
    if (row.seq_query_lens[0] == 0) continue;  // padding: sees nothing, stays zero
    std::tie(r.lo, r.hi) = visibility.columns(row.seq_offsets[0], row.seq_offsets[0]);
  }
  return out;
}

// Per block index, the rows that see some of it, grouped by the block they hold there (the same
// memory: a block shared by reference).
std::vector<Job> plan(const std::vector<Row>& rows, int64_t block_tokens, int64_t width) {
  std::vector<Job> jobs;
  std::vector<std::pair<const float*, int64_t>> holders;  // (the block's keys, row)
  for (int64_t first = 0; first < width; first += block_tokens) {
    holders.clear();
    const auto index = static_cast<size_t>(first / block_tokens);
    for (size_t b = 0; b < rows.size(); ++b) {
      const Row& r = rows[b];
      if (r.lo < first + block_tokens && r.hi > first) {
        holders.emplace_back(block_data(r.columns->key_chunks, *r.columns, index, 0),
                             static_cast<int64_t>(b));
      }
    }
    std::sort(holders.begin(), holders.end(), [](const auto& x, const auto& y) {
      return std::less<const float*>()(x.first, y.first) ||
             (x.first == y.first && x.second < y.second);
    });
    for (size_t k = 0; k < holders.size(); ++k) {
      if (k == 0 || holders[k].first != holders[k - 1].first) jobs.push_back({first, 0, {}});
      Job& job = jobs.back();
      job.rows.push_back(holders[k].second);
      // Up to the furthest column any of its rows sees (all within that row's length).
      job.count =
          std::max(job.count,
                   std::min(block_tokens, rows[static_cast<size_t>(holders[k].second)].hi - first));
    }
  }
  return jobs;
}

// The product over each job's block, per key/value head: scores for every query that sees it, a
// softmax per query, then the values weighted by them.
class DecodeAttention {
 public:
  DecodeAttention(const Array& q, std::vector<Row> rows, float scale)
      : q_(q), rows_(std::move(rows)), scale_(scale) {
    const PagedColumns& any = *rows_.front().columns;
    query_heads_ = q.dim(1);
    depth_ = q.dim(3);
    kv_heads_ = any.key_chunks.front().dim(1);
    value_depth_ = any.value_chunks.front().dim(3);
    group_ = query_heads_ / kv_heads_;
    for (const Row& r : rows_) width_ = std::max(width_, r.hi);
    jobs_ = plan(rows_, any.block_tokens, width_);
    scores_.resize(rows_.size() * static_cast<size_t>(group_ * width_));
  }

  Array run() {
    Array out = Array::zeros(DType::f32, {q_.dim(0), query_heads_, 1, value_depth_});
    for (int64_t g = 0; g < kv_heads_; ++g) {
      for (const Job& job : jobs_) score(job, g);
      for (size_t b = 0; b < rows_.size(); ++b) {
        for (int64_t j = 0; j < group_; ++j) {
          softmax_row(score_row(static_cast<int64_t>(b), j), width_, rows_[b].lo, rows_[b].hi);
        }
      }
      for (const Job& job : jobs_) weigh(job, g, out.mutable_data<float>());
    }
    return out;
  }

 private:
  // Row b's scores for query head j of the current key/value head, over columns [0, width).
  float* score_row(int64_t b, int64_t j) { return scores_.data() + (b * group_ + j) * width_; }

  const PagedColumns& columns(const Job& job) const {
    return *rows_[static_cast<size_t>(job.rows.front())].columns;
  }

  // Scores of the job's queries (its rows x the query heads of key/value head g) over its block.
  void score(const Job& job, int64_t g) {
    const auto m = static_cast<int64_t>(job.rows.size()) * group_;
    lhs_.resize(static_cast<size_t>(m * depth_));
    product_.resize(static_cast<size_t>(m * job.count));
    for (size_t n = 0; n < job.rows.size(); ++n) {
      for (int64_t j = 0; j < group_; ++j) {
        const float* query =
            q_.data<float>() + job.rows[n] * q_.strides()[0] + (g * group_ + j) * q_.strides()[1];
        std::copy_n(query, depth_, lhs_.data() + (static_cast<int64_t>(n) * group_ + j) * depth_);
      }
    }
    const PagedColumns& p = columns(job);
    const float* keys = block_data(p.key_chunks, p, index(job), g);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                static_cast<int>(job.count), static_cast<int>(depth_), scale_, lhs_.data(),
                static_cast<int>(depth_), keys, static_cast<int>(p.key_chunks.front().strides()[2]),
                0.0f, product_.data(), static_cast<int>(job.count));
    for (size_t n = 0; n < job.rows.size(); ++n) {
      const Row& r = rows_[static_cast<size_t>(job.rows[n])];
      const int64_t from = std::max(r.lo, job.first), to = std::min(r.hi, job.first + job.count);
      for (int64_t j = 0; j < group_; ++j) {
        const int64_t row = static_cast<int64_t>(n) * group_ + j;
        std::copy_n(product_.data() + row * job.count + (from - job.first), to - from,
                    score_row(job.rows[n], j) + from);
      }
    }
  }

  // out += the job's weights times its block's values (weights outside a row's view are 0).
  void weigh(const Job& job, int64_t g, float* out) {
    const auto m = static_cast<int64_t>(job.rows.size()) * group_;
    lhs_.resize(static_cast<size_t>(m * job.count));
    product_.resize(static_cast<size_t>(m * value_depth_));
    for (size_t n = 0; n < job.rows.size(); ++n) {
      for (int64_t j = 0; j < group_; ++j) {
        std::copy_n(score_row(job.rows[n], j) + job.first, job.count,
                    lhs_.data() + (static_cast<int64_t>(n) * group_ + j) * job.count);
      }
    }
    const PagedColumns& p = columns(job);
    const float* values = block_data(p.value_chunks, p, index(job), g);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m),
                static_cast<int>(value_depth_), static_cast<int>(job.count), 1.0f, lhs_.data(),
                static_cast<int>(job.count), values,
                static_cast<int>(p.value_chunks.front().strides()[2]), 0.0f, product_.data(),
                static_cast<int>(value_depth_));
    for (size_t n = 0; n < job.rows.size(); ++n) {
      for (int64_t j = 0; j < group_; ++j) {
        const float* add = product_.data() + (static_cast<int64_t>(n) * group_ + j) * value_depth_;
        float* to = out + (job.rows[n] * query_heads_ + g * group_ + j) * value_depth_;
        for (int64_t d = 0; d < value_depth_; ++d) to[d] += add[d];
      }
    }
  }

  size_t index(const Job& job) const {
    return static_cast<size_t>(job.first / columns(job).block_tokens);
  }

  const Array& q_;
  const std::vector<Row> rows_;
  const float scale_;
  int64_t query_heads_ = 0, depth_ = 0, kv_heads_ = 0, value_depth_ = 0, group_ = 0, width_ = 0;
  std::vector<Job> jobs_;
  std::vector<float> scores_, lhs_, product_;
};

}  // namespace

std::optional<Array> attend_decode(const Batch& batch, const Array& q, const KVHistory& history,
                                   const AttentionMask& logical, float scale) {
  std::vector<Row> rows = decode_rows(batch, q, history, logical);
  if (rows.empty()) return std::nullopt;
  return DecodeAttention(q, std::move(rows), scale).run();
}

}  // namespace kvsnap::detail
