#include "ops/sdpa_decode.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/decode_kernels.h"
#include "ops/parallel.h"
#include "ops/visibility.h"

namespace kvsnap::detail {
namespace {

// One row of the batch: its paged columns and the columns [lo, hi) its query sees.
struct Row {
  const PagedColumns* columns = nullptr;
  int64_t lo = 0, hi = 0;
};

// Columns [first, first + count) that a group of rows all hold in the same memory: one product
// each for scores and values covers them. They lie in segments (a block, or a run of consecutive
// blocks of one chunk); a job's segments need not continue each other in memory — a sequence
// decoding beside others gets its blocks interleaved with theirs — and are read in one call.
struct Segment {
  int64_t count = 0;
  const float* keys = nullptr;    // key head 0 at the segment's first column
  const float* values = nullptr;  // value head 0 at the segment's first column
};
struct Job {
  int64_t first = 0, count = 0;
  std::vector<int64_t> rows;  // batch rows, ascending
  std::vector<Segment> segments;
};

bool plain_f32(const std::vector<Array>& chunks) {
  return !chunks.empty() && std::all_of(chunks.begin(), chunks.end(), rows_in_place);
}

// Head 0 of block `i` of `p` (chunks of [1, H, blocks_per_chunk * T, D]).
const float* block_data(const std::vector<Array>& chunks, const PagedColumns& p, size_t i) {
  const int64_t block = p.table[i];
  const Array& chunk = chunks[static_cast<size_t>(block / p.blocks_per_chunk)];
  return chunk.data<float>() + block % p.blocks_per_chunk * p.block_tokens * chunk.strides()[2];
}

// The rows of the batch when it has the form attend_decode serves; empty otherwise.
std::vector<Row> decode_rows(const Batch& batch, const Array& q, const KVHistory& history,
                             const AttentionMask& logical) {
  const int64_t rows = batch.batch_size();
  if (batch.length() != 1 || q.dtype() != DType::f32 || q.strides()[3] != 1) return {};
  // Only positional rules (explicit arrays: the general path, before any is applied).
  if (!logical.arrays().empty()) return {};
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
    // One set of strides serves every row (DecodeAttention reads them from row 0's chunks).
    if (p.block_tokens != first->block_tokens ||
        p.key_chunks.front().dim(1) != first->key_chunks.front().dim(1) ||
        p.value_chunks.front().dim(3) != first->value_chunks.front().dim(3) ||
        p.key_chunks.front().strides() != first->key_chunks.front().strides() ||
        p.value_chunks.front().strides() != first->value_chunks.front().strides()) {
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

// Per block index, the rows that see some of it, grouped by the memory they hold there (a block
// shared by reference: the same keys and the same values). A group that continues a job of the
// block before — the same rows, and the next columns of the same chunk — extends that job instead:
// a prefix written in one go lies in consecutive blocks, so it is multiplied in a few long runs.
class Planner {
 public:
  Planner(const std::vector<Row>& rows, const PagedColumns& any)
      : rows_(rows),
        block_tokens_(any.block_tokens),
        key_stride_(any.key_chunks.front().strides()[2]),
        value_stride_(any.value_chunks.front().strides()[2]) {}

  std::vector<Job> plan(int64_t width) {
    for (int64_t first = 0; first < width; first += block_tokens_) block(first);
    return std::move(jobs_);
  }

 private:
  struct Holder {
    const float *keys, *values;
    int64_t row;
  };

  void block(int64_t first) {
    holders_.clear();
    const auto index = static_cast<size_t>(first / block_tokens_);
    for (size_t b = 0; b < rows_.size(); ++b) {
      const Row& r = rows_[b];
      if (r.lo >= first + block_tokens_ || r.hi <= first) continue;
      holders_.push_back({block_data(r.columns->key_chunks, *r.columns, index),
                          block_data(r.columns->value_chunks, *r.columns, index),
                          static_cast<int64_t>(b)});
    }
    // Grouped by keys and values both: rows may hold the same keys beside values of their own.
    std::sort(holders_.begin(), holders_.end(), [](const Holder& x, const Holder& y) {
      const std::less<const float*> before;
      if (x.keys != y.keys) return before(x.keys, y.keys);
      if (x.values != y.values) return before(x.values, y.values);
      return x.row < y.row;
    });
    // Each group of rows holding the same memory here extends the job that ends where this
    // block begins, or starts one. Scratch vectors are members: nothing is allocated per block
    // but a new job.
    next_open_.clear();
    for (size_t k = 0; k < holders_.size();) {
      Segment segment{0, holders_[k].keys, holders_[k].values};
      group_rows_.clear();
      for (; k < holders_.size() && holders_[k].keys == segment.keys &&
             holders_[k].values == segment.values;
           ++k) {
        group_rows_.push_back(holders_[k].row);
        // Up to the furthest column any of its rows sees (all within that row's length).
        const int64_t seen = rows_[static_cast<size_t>(holders_[k].row)].hi - first;
        segment.count = std::max(segment.count, std::min(block_tokens_, seen));
      }
      next_open_.push_back(extend_or_add(first, segment));
    }
    std::swap(open_, next_open_);
  }

  // A job of the same rows that ends where this block's columns begin takes them: its last
  // segment grows when the memory continues it, else a segment is added. Otherwise a new job.
  size_t extend_or_add(int64_t first, const Segment& next) {
    for (size_t i : open_) {
      Job& j = jobs_[i];
      if (j.first + j.count != first || j.rows != group_rows_) continue;
      Segment& last = j.segments.back();
      if (last.keys + last.count * key_stride_ == next.keys &&
          last.values + last.count * value_stride_ == next.values) {
        last.count += next.count;
      } else {
        j.segments.push_back(next);
      }
      j.count += next.count;
      return i;
    }
    jobs_.push_back(Job{first, next.count, group_rows_, {next}});
    return jobs_.size() - 1;
  }

  const std::vector<Row>& rows_;
  const int64_t block_tokens_, key_stride_, value_stride_;
  std::vector<Job> jobs_;
  std::vector<size_t> open_, next_open_;  // jobs that end at the current block's end
  std::vector<Holder> holders_;
  std::vector<int64_t> group_rows_;  // the rows of the group being planned
};

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
    jobs_ = Planner(rows_, any).plan(width_);
    // Each row's scores span the columns its jobs reach (its own, and where a block it shares
    // goes further, the rest of that block): a short row beside a long one takes little room.
    widths_.assign(rows_.size(), 0);
    for (size_t b = 0; b < rows_.size(); ++b) widths_[b] = rows_[b].hi;
    for (const Job& job : jobs_) {
      for (const int64_t b : job.rows) {
        int64_t& width = widths_[static_cast<size_t>(b)];
        width = std::max(width, job.first + job.count);
      }
    }
    starts_.assign(rows_.size() + 1, 0);
    for (size_t b = 0; b < rows_.size(); ++b) starts_[b + 1] = starts_[b] + group_ * widths_[b];
    key_head_ = any.key_chunks.front().strides()[1];
    value_head_ = any.value_chunks.front().strides()[1];
    key_stride_ = any.key_chunks.front().strides()[2];
    value_stride_ = any.value_chunks.front().strides()[2];
  }

  // Each key/value head is one task for the kernels' threads (ops/parallel.h), with its own
  // scratch: its outputs are its own and its sums the same on any thread.
  Array run() {
    Array out = Array::zeros(DType::f32, {q_.dim(0), query_heads_, 1, value_depth_});
    const int64_t threads = std::min(kv_heads_, int64_t{parallel_threads()});
    parallel_for(threads, [&](int64_t t) {
      // Kept by each thread between calls up to kKeptScratch floats: a step's scores (rows x
      // heads x context) are large enough that allocating them afresh costs page faults on every
      // layer; larger ones live for the call. Never read before written (columns a row does not
      // see get 0 from its softmax).
      Scratch once;
      const auto need = static_cast<size_t>(starts_.back());
      Scratch& scratch = scratch_for(need, once);
      if (scratch.scores.size() < need) scratch.scores.resize(need);
      for (int64_t g = t; g < kv_heads_; g += threads) head(g, scratch, out.mutable_data<float>());
    });
    return out;
  }

 private:
  struct Scratch {
    std::vector<float> scores, tile, lhs, product;
    std::vector<float> sums;  // per query: its softmax's denominator
    std::vector<const float*> queries;
    std::vector<float*> outputs;
    std::vector<ColumnRun> runs;
  };

  // Row b's scores for query head j of the current key/value head, over its columns
  // [0, widths_[b]).
  float* row(Scratch& s, int64_t b, int64_t j) const {
    return s.scores.data() + starts_[static_cast<size_t>(b)] + j * widths_[static_cast<size_t>(b)];
  }

  void head(int64_t g, Scratch& s, float* out) const {
    for (const Job& job : jobs_) score(job, g, s);
    s.sums.resize(rows_.size() * static_cast<size_t>(group_));
    for (size_t b = 0; b < rows_.size(); ++b) {
      for (int64_t j = 0; j < group_; ++j) {
        s.sums[b * static_cast<size_t>(group_) + static_cast<size_t>(j)] = softmax_numerators(
            row(s, static_cast<int64_t>(b), j), widths_[b], rows_[b].lo, rows_[b].hi);
      }
    }
    for (const Job& job : jobs_) weigh(job, g, s, out);
    for (size_t b = 0; b < rows_.size(); ++b) {
      for (int64_t j = 0; j < group_; ++j) {
        float* const sum =
            out + (static_cast<int64_t>(b) * query_heads_ + g * group_ + j) * value_depth_;
        if (!all_finite(sum, value_depth_)) weigh_seen(static_cast<int64_t>(b), j, g, s, sum);
        divide_by(sum, value_depth_,
                  s.sums[b * static_cast<size_t>(group_) + static_cast<size_t>(j)]);
      }
    }
  }

  // Query head j of key/value head g of row b, whose sum came out not finite: again without
  // the columns it does not see (visibility.h's weigh_seen), over its jobs in column order.
  void weigh_seen(int64_t b, int64_t j, int64_t g, Scratch& s, float* sum) const {
    std::fill_n(sum, value_depth_, 0.0f);
    for (const Job& job : jobs_) {
      if (!std::binary_search(job.rows.begin(), job.rows.end(), b)) continue;
      runs_of(job, /*keys=*/false, g * value_head_, s.runs);
      detail::weigh_seen(row(s, b, j) + job.first, s.runs.data(), s.runs.size(), value_stride_,
                         value_depth_, sum);
    }
  }

  // The job's segments as runs of one head's keys (or values): `head` floats past head 0.
  static void runs_of(const Job& job, bool keys, int64_t head, std::vector<ColumnRun>& runs) {
    runs.clear();
    for (const Segment& segment : job.segments) {
      runs.push_back({(keys ? segment.keys : segment.values) + head, segment.count});
    }
  }

  // Scores of the job's queries (its rows x the query heads of key/value head g) over its
  // columns, straight into each query's score row (columns a row does not see are overwritten
  // by its softmax with 0), all its segments in one call: decode_kernels.h where the CPU has
  // them, else BLAS.
  void score(const Job& job, int64_t g, Scratch& s) const {
    if (!decode_kernels_available()) return score_blas(job, g, s);
    s.queries.clear();
    s.outputs.clear();
    for (const int64_t b : job.rows) {
      for (int64_t j = 0; j < group_; ++j) {
        s.queries.push_back(q_.data<float>() + b * q_.strides()[0] +
                            (g * group_ + j) * q_.strides()[1]);
        s.outputs.push_back(row(s, b, j) + job.first);
      }
    }
    runs_of(job, /*keys=*/true, g * key_head_, s.runs);
    decode_scores(s.queries.data(), static_cast<int64_t>(s.queries.size()), depth_, s.runs.data(),
                  s.runs.size(), key_stride_, scale_, s.outputs.data(), s.tile);
  }

  // out += the job's weights times its columns' values (weights outside a row's view are 0);
  // with decode_kernels.h column after column onto what each output holds, all the job's
  // segments in one call, so a row's result does not depend on which rows share its blocks.
  void weigh(const Job& job, int64_t g, Scratch& s, float* out) const {
    if (!decode_kernels_available()) return weigh_blas(job, g, s, out);
    s.queries.clear();
    s.outputs.clear();
    for (const int64_t b : job.rows) {
      for (int64_t j = 0; j < group_; ++j) {
        s.queries.push_back(row(s, b, j) + job.first);
        s.outputs.push_back(out + (b * query_heads_ + g * group_ + j) * value_depth_);
      }
    }
    runs_of(job, /*keys=*/false, g * value_head_, s.runs);
    decode_weigh(s.queries.data(), static_cast<int64_t>(s.queries.size()), s.runs.data(),
                 s.runs.size(), value_stride_, value_depth_, s.outputs.data());
  }

  // Scores of the job's queries (its rows x the query heads of key/value head g), a segment at a
  // time.
  void score_blas(const Job& job, int64_t g, Scratch& s) const {
    const auto m = static_cast<int64_t>(job.rows.size()) * group_;
    s.lhs.resize(static_cast<size_t>(m * depth_));
    for (size_t n = 0; n < job.rows.size(); ++n) {
      for (int64_t j = 0; j < group_; ++j) {
        const float* query =
            q_.data<float>() + job.rows[n] * q_.strides()[0] + (g * group_ + j) * q_.strides()[1];
        std::copy_n(query, depth_, s.lhs.data() + (static_cast<int64_t>(n) * group_ + j) * depth_);
      }
    }
    int64_t first = job.first;
    for (const Segment& segment : job.segments) {
      const int64_t count = segment.count;
      s.product.resize(static_cast<size_t>(m * count));
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                  static_cast<int>(count), static_cast<int>(depth_), scale_, s.lhs.data(),
                  blas_ld(depth_), segment.keys + g * key_head_, blas_ld(key_stride_), 0.0f,
                  s.product.data(), blas_ld(count));
      for (size_t n = 0; n < job.rows.size(); ++n) {
        const Row& r = rows_[static_cast<size_t>(job.rows[n])];
        const int64_t from = std::max(r.lo, first), to = std::min(r.hi, first + count);
        for (int64_t j = 0; j < group_ && from < to; ++j) {
          const int64_t query = static_cast<int64_t>(n) * group_ + j;
          std::copy_n(s.product.data() + query * count + (from - first), to - from,
                      row(s, job.rows[n], j) + from);
        }
      }
      first += count;
    }
  }

  // out += the job's weights times its values (weights outside a row's view are 0), a segment
  // at a time.
  void weigh_blas(const Job& job, int64_t g, Scratch& s, float* out) const {
    const auto m = static_cast<int64_t>(job.rows.size()) * group_;
    s.product.resize(static_cast<size_t>(m * value_depth_));
    int64_t first = job.first;
    for (const Segment& segment : job.segments) {
      const int64_t count = segment.count;
      s.lhs.resize(static_cast<size_t>(m * count));
      for (size_t n = 0; n < job.rows.size(); ++n) {
        for (int64_t j = 0; j < group_; ++j) {
          std::copy_n(row(s, job.rows[n], j) + first, count,
                      s.lhs.data() + (static_cast<int64_t>(n) * group_ + j) * count);
        }
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m),
                  static_cast<int>(value_depth_), static_cast<int>(count), 1.0f, s.lhs.data(),
                  blas_ld(count), segment.values + g * value_head_, blas_ld(value_stride_), 0.0f,
                  s.product.data(), blas_ld(value_depth_));
      for (size_t n = 0; n < job.rows.size(); ++n) {
        for (int64_t j = 0; j < group_; ++j) {
          const float* add =
              s.product.data() + (static_cast<int64_t>(n) * group_ + j) * value_depth_;
          float* to = out + (job.rows[n] * query_heads_ + g * group_ + j) * value_depth_;
          for (int64_t d = 0; d < value_depth_; ++d) to[d] += add[d];
        }
      }
      first += count;
    }
  }

  const Array& q_;
  const std::vector<Row> rows_;
  const float scale_;
  int64_t query_heads_ = 0, depth_ = 0, kv_heads_ = 0, value_depth_ = 0, group_ = 0, width_ = 0;
  int64_t key_head_ = 0, value_head_ = 0, key_stride_ = 0, value_stride_ = 0;
  std::vector<Job> jobs_;
  std::vector<int64_t> widths_, starts_;  // per row: its scores' columns; where they start
};

}  // namespace

std::optional<Array> attend_decode(const Batch& batch, const Array& q, const KVHistory& history,
                                   const AttentionMask& logical, float scale) {
  std::vector<Row> rows = decode_rows(batch, q, history, logical);
  if (rows.empty()) return std::nullopt;
  return DecodeAttention(q, std::move(rows), scale).run();
}

}  // namespace kvsnap::detail
