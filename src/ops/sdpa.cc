#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "kvsnap/ops.h"
#include "ops/checks.h"
#include "ops/decode_kernels.h"
#include "ops/parallel.h"
#include "ops/sdpa_decode.h"
#include "ops/softmax.h"
#include "ops/visibility.h"

namespace kvsnap {
namespace {

using detail::all_finite;
using detail::divide_by;
using detail::kMasked;
using detail::softmax_numerators;
using detail::Visibility;
using detail::weigh_seen;

// Queries go through in blocks so the score matrix stays small for long prefills.
constexpr int64_t kBlock = 128;

void check_inputs(const Batch& batch, const Array& q, const KVHistory& history, float scale) {
  constexpr const char* kCall = "sdpa";
  detail::require_ndim(q, 4, kCall, "q", "[B, Hq, L, D]");
  detail::require_float(q, kCall, "q");
  batch.validate(kCall);
  if (batch.batch_size() != q.dim(0) || batch.length() != q.dim(2)) {
    throw Error(fmt::format("sdpa: q {} does not match the batch ({} rows of {} queries)",
                            q.describe(), batch.batch_size(), batch.length()));
  }
  if (!std::isfinite(scale)) throw Error(fmt::format("sdpa: scale {} is not finite", scale));
  if (history.ragged() && history.rows() != q.dim(0)) {
    throw Error(fmt::format("sdpa: a history of {} rows for q {}: need one per q row",
                            history.rows(), q.describe()));
  }
  int64_t value_depth = 0;
  for (int64_t b = 0; b < (history.ragged() ? history.rows() : 1); ++b) {
    const KVHistory& row = history.row(b);
    const Array keys = row.paged() ? row.paged_columns().key_chunks.empty()
                                         ? Array()
                                         : row.paged_columns().key_chunks.front()
                                   : row.keys();
    const Array values = row.paged() ? row.paged_columns().value_chunks.empty()
                                           ? Array()
                                           : row.paged_columns().value_chunks.front()
                                     : row.values();
    detail::require_ndim(keys, 4, kCall, "keys", "[B, H, K, D]");
    detail::require_float(keys, kCall, "keys");
    detail::require_float(values, kCall, "values");
    if (!row.paged() && !history.ragged()) detail::require_extent(keys, 0, q.dim(0), kCall, "keys");
    if (row.paged() && !history.ragged() && q.dim(0) != 1) {
      throw Error(fmt::format(
          "sdpa: a paged history holds one sequence, q {} has {} rows (give one history per row: "
          "KVHistory::of_rows)",
          q.describe(), q.dim(0)));
    }
    detail::require_extent(keys, 3, q.dim(3), kCall, "keys");
    if (keys.dim(1) == 0 || q.dim(1) % keys.dim(1) != 0) {
      throw Error(fmt::format("sdpa: {} query heads is not a multiple of {} key/value heads (GQA)",
                              q.dim(1), keys.dim(1)));
    }
    // The rows' outputs go into one array: every row's values are as deep.
    if (b > 0 && values.dim(3) != value_depth) {
      throw Error(fmt::format(
          "sdpa: row {} of the history has values {} deep, row 0's are {} (one output array)", b,
          values.dim(3), value_depth));
    }
    if (b == 0) value_depth = values.dim(3);
  }
}

// Explicit mask arrays serve the whole batch (a first axis of 1) or one slice per row.
void check_mask_rows(const Batch& batch, const AttentionMask& logical) {
  for (const Array& array : logical.arrays()) {
    if (array.ndim() >= 1 && array.dim(0) != 1 && array.dim(0) != batch.batch_size()) {
      throw Error(fmt::format("sdpa: mask {} has {} rows; the batch has {} (one, or one per row)",
                              array.describe(), array.dim(0), batch.batch_size()));
    }
  }
}

// `a` itself when the kernels read it in place (rows_in_place), else an f32 copy.
Array rows_f32(const Array& a) { return detail::rows_in_place(a) ? a : a.astype(DType::f32); }

// A run of consecutive key columns [first, first + count) of one (row, key head): `count` key
// rows of `key_stride` floats and value rows of `value_stride` floats.
struct Run {
  int64_t first, count;
  const float* keys;
  int64_t key_stride;
  const float* values;
  int64_t value_stride;
};

// The key/value columns of one history row as runs: one for a contiguous history (converted to
// f32 whole when it is not), one per block for a paged one read in place, or one over a head of
// it converted whole for the task that reads it.
class Columns {
 public:
  explicit Columns(const KVHistory& history) : history_(history) {
    if (!history.paged()) {
      keys_ = rows_f32(history.keys());
      values_ = rows_f32(history.values());
      return;
    }
    // As rows_f32 decides for each block: a run read in place must outlive its visit.
    const auto f32 = [](const std::vector<Array>& chunks) {
      return std::all_of(chunks.begin(), chunks.end(), detail::rows_in_place);
    };
    in_place_ =
        f32(history.paged_columns().key_chunks) && f32(history.paged_columns().value_chunks);
  }

  // Whether the runs lie in the history's own memory: keys and values f32 with unit-strided rows,
  // read in place (for_each). Otherwise (either of them another type, or rows that overlap) a
  // task reads its head converted (convert).
  bool in_place() const { return in_place_; }

  // Head h of a paged history that is not read in place, converted whole into `keys` [length, D]
  // and `values` [length, Dv] f32: the run over all its columns. For a task that passes over the
  // head several times (scores and weights, every query tile), where for_each converts each
  // block on every pass.
  Run convert(int64_t h, std::vector<float>& keys, std::vector<float>& values) const {
    const PagedColumns& p = history_.paged_columns();
    const int64_t depth = p.key_chunks.front().dim(3), value_depth = p.value_chunks.front().dim(3);
    keys.resize(static_cast<size_t>(p.length * depth));
    values.resize(static_cast<size_t>(p.length * value_depth));
    for (int64_t i = 0; i * p.block_tokens < p.length; ++i) {
      const int64_t first = i * p.block_tokens;
      const int64_t count = std::min(p.block_tokens, p.length - first);
      const auto head = [&](const Array& block, int64_t width, std::vector<float>& into) {
        const std::vector<float> rows = block.slice(1, h, h + 1).slice(2, 0, count).to_floats();
        std::copy(rows.begin(), rows.end(), into.begin() + first * width);
      };
      head(p.key_block(static_cast<size_t>(i)), depth, keys);
      head(p.value_block(static_cast<size_t>(i)), value_depth, values);
    }
    return Run{0, p.length, keys.data(), depth, values.data(), value_depth};
  }

  // Calls visit(run) for the runs covering columns [lo, hi) of batch row b, key head h, in
  // column order (a run may begin before lo; visit clips). A paged history only when in_place()
  // (else convert).
  template <class Visit>
  void for_each(int64_t b, int64_t h, int64_t lo, int64_t hi, Visit&& visit) const {
    if (!history_.paged()) {
      visit(Run{0, keys_.dim(2),
                keys_.data<float>() + b * keys_.strides()[0] + h * keys_.strides()[1],
                keys_.strides()[2],
                values_.data<float>() + b * values_.strides()[0] + h * values_.strides()[1],
                values_.strides()[2]});
      return;
    }
    // Blocks that continue each other in memory (consecutive blocks of a chunk) go as one run.
    const PagedColumns& p = history_.paged_columns();
    std::optional<Run> pending;
    for (int64_t i = lo / p.block_tokens; i * p.block_tokens < hi; ++i) {
      const Array k = p.key_block(static_cast<size_t>(i));
      const Array v = p.value_block(static_cast<size_t>(i));
      const int64_t first = i * p.block_tokens;
      const Run run{first,
                    std::min(p.block_tokens, p.length - first),
                    k.data<float>() + h * k.strides()[1],
                    k.strides()[2],
                    v.data<float>() + h * v.strides()[1],
                    v.strides()[2]};
      if (pending && continues(*pending, run)) {
        pending->count += run.count;
        continue;
      }
      if (pending) visit(*pending);
      pending = run;
    }
    if (pending) visit(*pending);
  }

 private:
  static bool continues(const Run& run, const Run& next) {
    const int64_t gap = next.first - run.first;
    return run.count == gap && run.key_stride == next.key_stride &&
           run.value_stride == next.value_stride && run.keys + gap * run.key_stride == next.keys &&
           run.values + gap * run.value_stride == next.values;
  }

  const KVHistory& history_;
  Array keys_, values_;
  bool in_place_ = true;
};

// Attention of one batch (its history one contiguous or paged history, or ragged rows, each
// handled on its own). The query heads that share a key/value head go through together — their
// queries stacked into one left-hand side — so each product reads (and OpenBLAS packs) a key or
// value run once per key/value head, not once per query head: a decode step's products have as
// many rows as the group has heads instead of one. Each (row, key/value head) is one task for the
// kernels' threads (ops/parallel.h): its outputs are its own, its sums the same on any thread.
class Attend {
 public:
  Attend(const Batch& batch, const Array& q, const KVHistory& history, const AttentionMask& logical,
         float scale)
      : batch_(batch),
        qf_(rows_f32(q)),
        visibility_(batch, history, logical, q.dim(1)),
        source_(history),
        scale_(scale),
        query_heads_(q.dim(1)),
        queries_(q.dim(2)),
        depth_(q.dim(3)),
        columns_(history.length()) {
    value_depth_ = history.paged() ? history.paged_columns().value_chunks.front().dim(3)
                                   : history.values().dim(3);
    kv_heads_ =
        history.paged() ? history.paged_columns().key_chunks.front().dim(1) : history.keys().dim(1);
    group_ = query_heads_ / kv_heads_;
    // Queries per block: group x step stacked rows, within kBlock unless one group is larger.
    step_ = std::max<int64_t>(1, kBlock / std::max<int64_t>(group_, 1));
    most_ = std::min(queries_, step_) * group_;
  }

  Array run() {
    Array out = Array::zeros(DType::f32, {q_rows(), query_heads_, queries_, value_depth_});
    if (group_ == 0) return out;  // no query heads: nothing to attend
    const int64_t tasks = q_rows() * kv_heads_;
    const int64_t threads = std::min(tasks, int64_t{detail::parallel_threads()});
    detail::parallel_for(threads, [&](int64_t t) {
      // One buffer per thread for the stacked queries, their scores and their weighed values.
      // Kept by each thread between calls up to detail::kKeptScratch floats (a prefill's buffer
      // is megabytes: allocating it per call costs page faults); larger ones live for the call.
      // Every part is written before it is read.
      Work once;
      const auto need = static_cast<size_t>(most_ * (depth_ + columns_ + value_depth_));
      Work& work = detail::scratch_for(need, once);
      if (work.buffer.size() < need) work.buffer.resize(need);
      if (work.sums.size() < static_cast<size_t>(most_))
        work.sums.resize(static_cast<size_t>(most_));
      for (int64_t task = t; task < tasks; task += threads) {
        head(task / kv_heads_, task % kv_heads_, work, out.mutable_data<float>());
      }
    });
    return out;
  }

 private:
  struct Work {
    std::vector<float> buffer, tile;
    std::vector<float> sums;         // per stacked query row: its softmax's denominator
    std::vector<const float*> from;  // the kernels' operand rows (decode_kernels.h)
    std::vector<float*> to;          // and result rows
    std::vector<detail::ColumnRun> runs;
    const Run* whole = nullptr;  // the task's head, converted once (Columns::convert), if it is
  };

  int64_t q_rows() const { return qf_.dim(0); }

  // Row b, key/value head g: its query heads' outputs.
  void head(int64_t b, int64_t g, Work& work, float* out) const {
    std::vector<float> keys, values;  // head g converted, when not read in place
    std::optional<Run> whole;
    if (!source_.in_place()) whole = source_.convert(g, keys, values);
    work.whole = whole ? &*whole : nullptr;
    attend_head(b, g, work, out);
    work.whole = nullptr;
  }

  // The runs of columns [lo, hi) (or more: visit clips) of row b, key/value head g.
  template <class Visit>
  void each_run(int64_t b, int64_t g, int64_t lo, int64_t hi, const Work& work,
                Visit&& visit) const {
    if (work.whole != nullptr) {
      visit(*work.whole);
      return;
    }
    source_.for_each(b, g, lo, hi, visit);
  }

  // head() over the runs each_run gives.
  void attend_head(int64_t b, int64_t g, Work& work, float* out) const {
    float* const lhs = work.buffer.data();
    float* const scores = lhs + most_ * depth_;
    float* const weighed = scores + most_ * columns_;
    const int64_t offset = batch_.seq_offsets[b], real = batch_.seq_query_lens[b];
    for (int64_t l0 = 0; l0 < real; l0 += step_) {
      const int64_t block = std::min(step_, real - l0);  // padding rows stay zero
      const int64_t m = group_ * block;                  // stacked row j * block + r
      const auto [lo, hi] = visibility_.columns(offset + l0, offset + l0 + block - 1);
      const int64_t width = hi - lo;
      if (width <= 0) continue;
      for (int64_t j = 0; j < group_; ++j) {
        const float* from = qf_.data<float>() + b * qf_.strides()[0] +
                            (g * group_ + j) * qf_.strides()[1] + l0 * qf_.strides()[2];
        for (int64_t r = 0; r < block; ++r) {
          std::copy_n(from + r * qf_.strides()[2], depth_, lhs + (j * block + r) * depth_);
        }
      }
      scores_of(b, g, lo, hi, m, lhs, scores, work);
      for (int64_t j = 0; j < group_; ++j) {
        for (int64_t r = 0; r < block; ++r) {
          float* row = scores + (j * block + r) * width;
          const auto [begin, end] =
              visibility_.mask(row, lo, width, b, g * group_ + j, l0 + r, offset + l0 + r);
          work.sums[static_cast<size_t>(j * block + r)] =
              softmax_numerators(row, width, begin, end);
        }
      }
      if (!weigh(b, g, lo, hi, m, scores, weighed, work)) continue;  // no run: rows stay zero
      for (int64_t i = 0; i < m; ++i) {
        float* sum = weighed + i * value_depth_;
        if (all_finite(sum, value_depth_)) continue;
        std::fill_n(sum, value_depth_, 0.0f);  // again without the columns it does not see
        batches(b, g, lo, hi, /*keys=*/false, work,
                [&](const std::vector<detail::ColumnRun>& runs, int64_t stride, int64_t at) {
                  weigh_seen(scores + i * width + at, runs.data(), runs.size(), stride,
                             value_depth_, sum);
                });
      }
      for (int64_t j = 0; j < group_; ++j) {
        float* to = out + ((b * query_heads_ + g * group_ + j) * queries_ + l0) * value_depth_;
        std::copy_n(weighed + j * block * value_depth_, block * value_depth_, to);
        for (int64_t r = 0; r < block; ++r) {
          divide_by(to + r * value_depth_, value_depth_,
                    work.sums[static_cast<size_t>(j * block + r)]);
        }
      }
    }
  }

  // The runs of columns [lo, hi) of row b, key/value head g — keys, or values — in batches one
  // kernel call takes (runs that share a stride and outlive the visit): call(runs, stride, at),
  // `at` the batch's first column less lo. A history's runs in as few calls as that allows.
  template <class Call>
  void batches(int64_t b, int64_t g, int64_t lo, int64_t hi, bool keys, Work& work,
               Call&& call) const {
    work.runs.clear();
    int64_t stride = 0, at = 0, next = 0;
    const auto flush = [&] {
      if (!work.runs.empty()) call(work.runs, stride, at);
      work.runs.clear();
      at = next;
    };
    each_run(b, g, lo, hi, work, [&](const Run& run) {
      const int64_t from = std::max(lo, run.first), to = std::min(hi, run.first + run.count);
      if (from >= to) return;
      const int64_t run_stride = keys ? run.key_stride : run.value_stride;
      if (run_stride != stride) flush();
      stride = run_stride;
      work.runs.push_back(
          {(keys ? run.keys : run.values) + (from - run.first) * run_stride, to - from});
      next = to - lo;
    });
    flush();
  }

  // scores = scale * Q K^T over columns [lo, hi): with decode_kernels.h where the CPU has them
  // (keys read in place; sgemm would pack them for a product of a few queries), else BLAS run by
  // run.
  void scores_of(int64_t b, int64_t g, int64_t lo, int64_t hi, int64_t m, const float* lhs,
                 float* scores, Work& work) const {
    const int64_t width = hi - lo;
    if (detail::decode_kernels_available()) {
      rows_of(lhs, depth_, scores, width, m, work);
      batches(b, g, lo, hi, /*keys=*/true, work,
              [&](const std::vector<detail::ColumnRun>& runs, int64_t stride, int64_t at) {
                for (int64_t i = 0; i < m; ++i) work.to[i] = scores + i * width + at;
                detail::decode_scores(work.from.data(), m, depth_, runs.data(), runs.size(), stride,
                                      scale_, work.to.data(), work.tile);
              });
      return;
    }
    each_run(b, g, lo, hi, work, [&](const Run& run) {
      const int64_t from = std::max(lo, run.first), to = std::min(hi, run.first + run.count);
      if (from >= to) return;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                  static_cast<int>(to - from), static_cast<int>(depth_), scale_, lhs,
                  detail::blas_ld(depth_), run.keys + (from - run.first) * run.key_stride,
                  detail::blas_ld(run.key_stride), 0.0f, scores + (from - lo),
                  detail::blas_ld(width));
    });
  }

  // weighed = P V over columns [lo, hi): with decode_kernels.h in as few calls as batches()
  // allows (the sums stay in registers across a paged history's blocks; the same sums as a call
  // per run), else run by run with BLAS; false when no run lies in range.
  bool weigh(int64_t b, int64_t g, int64_t lo, int64_t hi, int64_t m, const float* scores,
             float* weighed, Work& work) const {
    const int64_t width = hi - lo;
    if (detail::decode_kernels_available()) {
      std::fill_n(weighed, m * value_depth_, 0.0f);
      rows_of(scores, width, weighed, value_depth_, m, work);
      bool any = false;
      batches(b, g, lo, hi, /*keys=*/false, work,
              [&](const std::vector<detail::ColumnRun>& runs, int64_t stride, int64_t at) {
                for (int64_t i = 0; i < m; ++i) work.from[i] = scores + i * width + at;
                detail::decode_weigh(work.from.data(), m, runs.data(), runs.size(), stride,
                                     value_depth_, work.to.data());
                any = true;
              });
      return any;
    }
    float beta = 0.0f;
    each_run(b, g, lo, hi, work, [&](const Run& run) {
      const int64_t from = std::max(lo, run.first), to = std::min(hi, run.first + run.count);
      if (from >= to) return;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m),
                  static_cast<int>(value_depth_), static_cast<int>(to - from), 1.0f,
                  scores + (from - lo), detail::blas_ld(width),
                  run.values + (from - run.first) * run.value_stride,
                  detail::blas_ld(run.value_stride), beta, weighed, detail::blas_ld(value_depth_));
      beta = 1.0f;
    });
    return beta != 0.0f;
  }

  // The kernels' row pointers: from[i] = in + i * in_width, to[i] = out + i * out_width.
  static void rows_of(const float* in, int64_t in_width, float* out, int64_t out_width, int64_t m,
                      Work& work) {
    work.from.resize(static_cast<size_t>(m));
    work.to.resize(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) {
      work.from[i] = in + i * in_width;
      work.to[i] = out + i * out_width;
    }
  }

  const Batch& batch_;
  const Array qf_;
  const Visibility visibility_;
  const Columns source_;
  const float scale_;
  const int64_t query_heads_, queries_, depth_, columns_;
  int64_t value_depth_ = 0, kv_heads_ = 0, group_ = 0, step_ = 0, most_ = 0;
};

Array attend(const Batch& batch, const Array& q, const KVHistory& history,
             const AttentionMask& logical, float scale) {
  return Attend(batch, q, history, logical, scale).run();
}

}  // namespace

Array sdpa(const Batch& batch, const Array& q, const KVHistory& history,
           const AttentionMask& logical, float scale) {
  check_inputs(batch, q, history, scale);
  check_mask_rows(batch, logical);
  if (batch.length() == 1) {
    if (std::optional<Array> out = detail::attend_decode(batch, q, history, logical, scale)) {
      return std::move(*out);
    }
  }
  if (!history.ragged()) return attend(batch, q, history, logical, scale);
  // Rows of different sequences, each with its own history: one task each for the kernels'
  // threads (each row's attention runs on one thread, so its sums are the same on any).
  std::vector<Array> rows(static_cast<size_t>(batch.batch_size()));
  if (rows.empty()) return {};
  detail::parallel_for(batch.batch_size(), [&](int64_t b) {
    rows[static_cast<size_t>(b)] =
        attend(batch.row(b), q.slice(0, b, b + 1), history.row(b), logical.for_row(b), scale);
  });
  Array out = Array::zeros(DType::f32, {q.dim(0), q.dim(1), q.dim(2), rows.front().dim(3)});
  for (int64_t b = 0; b < batch.batch_size(); ++b) {
    out.assign_slice(0, b, rows[static_cast<size_t>(b)]);
  }
  return out;
}

}  // namespace kvsnap
