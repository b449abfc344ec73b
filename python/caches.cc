// kvsnap.Snapshot and the caches: kvsnap.Cache (the shared contract), kvsnap.KVCache,
// kvsnap.RotatingKVCache, kvsnap.PagedKVCache and kvsnap.RecurrentCache.
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings.h"

namespace kvsnap::python {

Snapshot& PySnapshot::get(const char* call) const {
  if (snapshot_ == nullptr) {
    throw Error(fmt::format("{}: this snapshot was consumed by {}; use the snapshot it returned",
                            call, consumer_));
  }
  return *snapshot_;
}

PySnapshot::~PySnapshot() {
  // May wait for its cache's lock (another thread's update) or copy: without the GIL.
  let_go_without_gil([&] { snapshot_.reset(); });
  release_deferred_in_destructor();
}

void PySnapshot::check_take(const char* consumer) const {
  (void)get(consumer);
  if (users_ > 0) {
    throw Error(fmt::format(
        "{}: this snapshot is in use by a call running on another thread; a snapshot is "
        "consumed only when no call uses it",
        consumer));
  }
}

SnapshotPtr PySnapshot::take(const char* consumer) {
  check_take(consumer);
  consumer_ = consumer;
  return std::move(snapshot_);
}

PySnapshot::Use::Use(const PySnapshot* snapshot, const char* call)
    : owner_(snapshot), snapshot_(snapshot != nullptr ? &snapshot->get(call) : nullptr) {
  if (owner_ != nullptr) ++owner_->users_;
}

PySnapshot::Use::~Use() {
  if (owner_ != nullptr) --owner_->users_;
}

std::unique_ptr<PySnapshot> wrap_snapshot(SnapshotPtr snapshot) {
  if (snapshot == nullptr) return nullptr;
  return std::make_unique<PySnapshot>(std::move(snapshot));
}

std::vector<Cache*> to_layers(const py::tuple& layers, const char* call) {
  std::vector<Cache*> caches;
  for (size_t i = 0; i < layers.size(); ++i) {
    const py::handle layer = layers[i];
    if (!layer.is_none() && !py::isinstance<Cache>(layer)) {
      throw Error(fmt::format(
          "{}: layers[{}] has type {}; each layer is a kvsnap cache (KVCache, RotatingKVCache, "
          "PagedKVCache, RecurrentCache) or None (a stateless layer)",
          call, i, Py_TYPE(layer.ptr())->tp_name));
    }
    caches.push_back(layer.is_none() ? nullptr : layer.cast<Cache*>());
  }
  return caches;
}

namespace {

py::list wrap_snapshots(std::vector<SnapshotPtr> snapshots) {
  py::list list;
  for (SnapshotPtr& snapshot : snapshots) list.append(py::cast(wrap_snapshot(std::move(snapshot))));
  return list;
}

py::list to_numpy_list(const std::vector<Array>& arrays, bool writeable) {
  py::list list;
  for (const Array& array : arrays) list.append(to_numpy(array, writeable));
  return list;
}

void bind_snapshot(py::module_& m) {
  py::class_<PySnapshot>(m, "Snapshot", R"(State that lets a cache return to an offset.

KV kinds hold the tokens [from_offset, to_offset); whole-state kinds (rotating window, recurrent)
hold the state at one offset (from_offset == to_offset). A lazy snapshot names slots of its
cache's live buffer and owns no bytes until a write would overwrite them. Dropping the object
releases its memory. merge() and split() consume their inputs: a consumed snapshot raises
kvsnap.Error on any use.)")
      .def_property_readonly(
          "from_offset", [](const PySnapshot& s) { return s.get("Snapshot.from_offset").from(); })
      .def_property_readonly("to_offset",
                             [](const PySnapshot& s) { return s.get("Snapshot.to_offset").to(); })
      .def_property_readonly(
          "size",
          [](const PySnapshot& s) {
            const PySnapshot::Use use(&s, "Snapshot.size");  // may wait for its cache's lock
            return without_gil([&] { return use.get()->size(); });
          },
          "Bytes this snapshot owns: 0 while wholly lazy.")
      .def_property_readonly(
          "is_lazy",
          [](const PySnapshot& s) {
            const PySnapshot::Use use(&s, "Snapshot.is_lazy");
            return without_gil([&] { return use.get()->is_lazy(); });
          },
          "True while it names live cache slots for some of its data.")
      .def_property_readonly("consumed", &PySnapshot::consumed,
                             "True once merge() or split() took it.")
      .def("__repr__", [](const PySnapshot& s) {
        if (s.consumed()) return std::string("kvsnap.Snapshot(consumed)");
        const PySnapshot::Use use(&s, "Snapshot.__repr__");
        return without_gil([&] {
          const Snapshot& snapshot = *use.get();
          return fmt::format("kvsnap.Snapshot([{}, {}), size={}, lazy={})", snapshot.from(),
                             snapshot.to(), snapshot.size(), snapshot.is_lazy() ? "True" : "False");
        });
      });

  py::class_<CopyStats>(m, "CopyStats", "Bytes a cache has copied, by reason.")
      .def_readonly("appended_bytes", &CopyStats::appended_bytes)
      .def_readonly("growth_bytes", &CopyStats::growth_bytes)
      .def_readonly("materialized_bytes", &CopyStats::materialized_bytes)
      .def_readonly("restored_bytes", &CopyStats::restored_bytes)
      .def_readonly("snapshot_bytes", &CopyStats::snapshot_bytes);
}

std::unique_ptr<PySnapshot> merge(Cache& cache, PySnapshot* parent, PySnapshot* child) {
  if (parent != nullptr && parent == child) {  // refused before either is taken: both stay usable
    throw Error(
        "Cache.merge: parent and child are the same snapshot; merge joins two adjacent ones");
  }
  if (parent != nullptr) parent->check_take("Cache.merge");  // both usable before either is taken
  if (child != nullptr) child->check_take("Cache.merge");
  SnapshotPtr first = parent != nullptr ? parent->take("Cache.merge") : nullptr;
  SnapshotPtr second = child != nullptr ? child->take("Cache.merge") : nullptr;
  return wrap_snapshot(
      without_gil([&] { return cache.merge(std::move(first), std::move(second)); }));
}

py::tuple split(Cache& cache, PySnapshot* snapshot, int64_t at) {
  SnapshotPtr whole = snapshot != nullptr ? snapshot->take("Cache.split") : nullptr;
  auto [before, after] = without_gil([&] { return cache.split(std::move(whole), at); });
  return py::make_tuple(wrap_snapshot(std::move(before)), wrap_snapshot(std::move(after)));
}

// The calls on a cache's state and offsets. Every call waits for the cache's lock with the GIL
// released (Released, or without_gil around the kvsnap part).
void bind_cache_state(CacheClass<Cache>& cache) {
  cache
      .def_property_readonly(
          "offset", [](const Cache& c) { return without_gil([&] { return c.offset(); }); },
          "Tokens written so far.")
      .def(
          "offset_of", [](const Cache& c, SeqId seq) { return c.offset(seq); },
          py::arg("seq").noconvert(), Released(), "Tokens written so far to sequence `seq`.")
      .def(
          "sequences", [](const Cache& c) { return c.sequences(); }, Released(),
          "The sequences the cache has made (written, restored or given a schedule), "
          "ascending; a reset one stays listed, at offset 0.")
      .def("exposed_bytes", &Cache::exposed_bytes, py::arg("seq").noconvert() = 0, Released(),
           "Bytes the sequence's writes may still copy into snapshots taken: an upper bound.")
      .def(
          "state",
          [](const Cache& c, std::optional<SeqId> seq) {
            const std::vector<Array> state =
                without_gil([&] { return seq ? c.state(*seq) : c.state(); });
            return to_numpy_list(state, /*writeable=*/false);
          },
          py::kw_only(), py::arg("seq").noconvert() = py::none(),
          "The live state arrays (of sequence `seq`, default 0) as read-only numpy views (none "
          "before the first write): views of the cache's buffers, valid until its next write to "
          "that sequence, which may change them (copy them to keep them) — a PagedKVCache "
          "gives copies gathered from its blocks.")
      .def(
          "reset", [](Cache& c, std::optional<SeqId> seq) { seq ? c.reset(*seq) : c.reset(); },
          py::kw_only(), py::arg("seq").noconvert() = py::none(), Released(),
          "Drops all state and any schedule (of sequence `seq` only, when given).")
      .def(
          "restore",
          [](Cache& c, PySnapshot* snapshot, int64_t target, std::optional<SeqId> seq) {
            const PySnapshot::Use use(snapshot, "Cache.restore");
            return without_gil([&] {
              return seq ? c.restore(*seq, use.get(), target) : c.restore(use.get(), target);
            });
          },
          py::arg("snapshot"), py::arg("target").noconvert(), py::kw_only(),
          py::arg("seq").noconvert() = py::none(),
          "Returns to `target` using `snapshot` (None: live rewind); False, changing nothing, "
          "when unreachable.")
      .def("copy_stats", &Cache::copy_stats, Released(), "Bytes copied so far, by reason.");
}

// The calls that make, schedule and combine snapshots.
void bind_cache_snapshots(CacheClass<Cache>& cache) {
  cache
      .def(
          "snapshot",
          [](Cache& c, int64_t from, std::optional<SeqId> seq) {
            return wrap_snapshot(
                without_gil([&] { return seq ? c.snapshot(*seq, from) : c.snapshot(from); }));
          },
          py::arg("from_offset").noconvert() = 0, py::kw_only(),
          py::arg("seq").noconvert() = py::none(),
          "Snapshot of [from_offset, offset) (KV) or of the whole state (others); None when "
          "there is nothing to hold.")
      .def(
          "prepare_snapshots",
          [](Cache& c, const std::vector<int64_t>& offsets, std::optional<SeqId> seq) {
            seq ? c.prepare_snapshots(*seq, offsets) : c.prepare_snapshots(offsets);
          },
          py::arg("offsets").noconvert(), py::kw_only(), py::arg("seq").noconvert() = py::none(),
          Released(), "Schedules captures as later writes reach each offset.")
      .def(
          "take_snapshots",
          [](Cache& c, std::optional<SeqId> seq) {
            return wrap_snapshots(
                without_gil([&] { return seq ? c.take_snapshots(*seq) : c.take_snapshots(); }));
          },
          py::kw_only(), py::arg("seq").noconvert() = py::none(),
          "One entry per scheduled offset, in order (None for zero-width edges).")
      .def(
          "take_reached_snapshots",
          [](Cache& c, std::optional<SeqId> seq) {
            return wrap_snapshots(without_gil(
                [&] { return seq ? c.take_reached_snapshots(*seq) : c.take_reached_snapshots(); }));
          },
          py::kw_only(), py::arg("seq").noconvert() = py::none(),
          "For a forward cut short: the entries for the offsets already reached.")
      .def(
          "cancel_snapshots",
          [](Cache& c, std::optional<SeqId> seq) {
            seq ? c.cancel_snapshots(*seq) : c.cancel_snapshots();
          },
          py::kw_only(), py::arg("seq").noconvert() = py::none(), Released(),
          "Drops the schedule and its captures.")
      .def("merge", &merge, py::arg("parent"), py::arg("child"),
           "Joins adjacent snapshots (consumes both). None as either gives None, the other "
           "consumed all the same (the C++ rule: null in, null out) — a zero-width capture "
           "from take_snapshots() is None, so drop it rather than merge it.")
      .def("split", &split, py::arg("snapshot"), py::arg("at").noconvert(),
           "Splits at `at` into (before, after) (consumes the snapshot).");
}

void bind_cache(py::module_& m) {
  CacheClass<Cache> cache(m, "Cache", R"(One layer's inference state: the contract every kind keeps.

Offsets count tokens written so far. Every mutating call either succeeds or raises kvsnap.Error
and changes nothing — but merge and split, which consume the snapshots they are given whatever
happens once they start (a refusal before that — the same snapshot twice, one already consumed
or in use on another thread — consumes none). A cache locks itself: its calls may come from several threads (they run
one at a time, the GIL released while they wait and work).)");
  bind_cache_state(cache);
  bind_cache_snapshots(cache);
}

void bind_attention_caches(py::module_& m) {
  CacheClass<Attention, Cache>(m, "Attention", "A cache of attention keys and values.")
      .def(
          "update",
          [](Attention& c, const Batch& batch, py::object keys, py::object values) {
            const Array k = to_array(keys, "Attention.update keys");
            const Array v = to_array(values, "Attention.update values");
            return without_gil([&] { return c.update(batch, k, v); });
          },
          py::arg("batch"), py::arg("keys"), py::arg("values"), ReleaseAfter(),
          "Appends keys [B, H, L, D] and values [B, H, L, Dv] (copied into the cache) and "
          "returns the history every query of the batch attends to.")
      .def("view", &Attention::view, py::arg("batch"), Released(),
           "The current history, without writing.");

  CacheClass<KVCache, Attention>(m, "KVCache",
                                 "An append-only attention cache with lazy snapshots.")
      .def(py::init<>())
      .def("reserve", &KVCache::reserve, py::arg("tokens").noconvert(), Released(),
           "Makes room for `tokens` tokens.")
      .def_property_readonly(
          "capacity", [](const KVCache& c) { return without_gil([&] { return c.capacity(); }); })
      .def("lazy_bytes", py::overload_cast<int64_t, int64_t>(&KVCache::lazy_bytes, py::const_),
           py::arg("from_offset").noconvert(), py::arg("to_offset").noconvert(), Released(),
           "Bytes lazy snapshots name in slots [from_offset, to_offset).");

  CacheClass<RotatingKVCache, Attention>(m, "RotatingKVCache",
                                         "A sliding-window attention cache of max_size tokens.")
      .def(py::init<int64_t>(), py::arg("max_size").noconvert())
      .def_property_readonly("max_size", &RotatingKVCache::max_size);
}

void bind_paged_cache(py::module_& m) {
  py::class_<PagedKVCache::PoolStats>(m, "PoolStats", "The blocks of a PagedKVCache's pool.")
      .def_readonly("blocks", &PagedKVCache::PoolStats::blocks, "Blocks allocated.")
      .def_readonly("blocks_in_use", &PagedKVCache::PoolStats::blocks_in_use,
                    "Referenced by a sequence or a snapshot.")
      .def_readonly("bytes_in_use", &PagedKVCache::PoolStats::bytes_in_use)
      .def_readonly("blocks_copied", &PagedKVCache::PoolStats::blocks_copied,
                    "Copies on write and joins at restore.")
      .def_readonly("live_blocks", &PagedKVCache::PoolStats::live_blocks,
                    "Used by sequences (a block shared by several counts once).")
      .def_readonly("live_bytes", &PagedKVCache::PoolStats::live_bytes);

  CacheClass<PagedKVCache, Attention>(m, "PagedKVCache", R"(A paged attention cache.

Each sequence is a list of blocks of block_tokens tokens; full blocks are shared by reference
count between sequences and snapshots, a write into a shared block copies that block only, and
a restore splices block references. Rows of a batch address sequences by seq_ids.)")
      .def(py::init([](int64_t block_tokens, int64_t blocks_per_chunk) {
             return new PagedKVCache(PagedKVCache::Options{.block_tokens = block_tokens,
                                                           .blocks_per_chunk = blocks_per_chunk});
           }),
           py::arg("block_tokens").noconvert() = 16, py::arg("blocks_per_chunk").noconvert() = 64)
      .def_property_readonly("block_tokens", &PagedKVCache::block_tokens)
      .def("pool_stats", &PagedKVCache::pool_stats, Released(),
           "Blocks allocated, in use, copied, live.");
}

#define kAdopted                                                                            \
  "The cache adopts the arrays without a copy (numpy arrays are kept alive) and snapshots " \
  "share them: recurrent states are immutable values, so do not write to the arrays "       \
  "afterwards (a write would change the live state and every snapshot of it); pass a copy " \
  "to keep writing one."

// The arrays of a Python sequence of states (a list or tuple, one array each: an array is not
// split along its first axis), converted once.
std::vector<Array> to_arrays(const py::object& states, const std::string& what) {
  if (!py::isinstance<py::list>(states) && !py::isinstance<py::tuple>(states)) {
    throw Error(fmt::format("{}: a list of arrays (one per state) is required, not {}", what,
                            Py_TYPE(states.ptr())->tp_name));
  }
  std::vector<Array> arrays;
  for (const py::handle state : py::tuple(states)) arrays.push_back(to_array(state, what.c_str()));
  return arrays;
}

RecurrentStates to_states(const py::object& conv, const py::object& delta, const char* call) {
  return {to_arrays(conv, fmt::format("{} conv_states", call)),
          to_arrays(delta, fmt::format("{} delta_states", call))};
}

// Row `b`'s (conv_states, delta_states) pair for put_rows.
RecurrentStates row_states(py::handle row, size_t b) {
  if (!py::isinstance<py::sequence>(row) || py::isinstance<py::str>(row) || py::len(row) != 2) {
    throw Error(fmt::format(
        "RecurrentCache.put_rows: rows[{}] has type {}; each row is a pair (conv_states, "
        "delta_states)",
        b, Py_TYPE(row.ptr())->tp_name));
  }
  const py::tuple pair(py::reinterpret_borrow<py::object>(row));
  return to_states(pair[0], pair[1], fmt::format("RecurrentCache.put_rows rows[{}]", b).c_str());
}

void bind_recurrent_cache(py::module_& m) {
  CacheClass<RecurrentCache, Cache>(m, "RecurrentCache", R"(A recurrent layer's state.

Conv tail [B, conv_tail, conv_dim] in the activation dtype, delta state [B, num_v_heads,
head_v_dim, head_k_dim] float32. Snapshots are whole states at exact offsets.)")
      .def(py::init<int, int, int, int, int>(), py::arg("conv_tail").noconvert(),
           py::arg("conv_dim").noconvert(), py::arg("num_v_heads").noconvert(),
           py::arg("head_v_dim").noconvert(), py::arg("head_k_dim").noconvert())
      .def(
          "get",
          [](RecurrentCache& c, const Batch& batch, const std::string& dtype) {
            for (DType d : {DType::f32, DType::f16, DType::bf16}) {
              if (dtype_name(d) == dtype) return without_gil([&] { return c.get(batch, d); });
            }
            throw Error(fmt::format(
                "RecurrentCache.get: activation dtype \"{}\" is not one of f32, f16, bf16", dtype));
          },
          py::arg("batch"), py::arg("activation_dtype") = "f32",
          "The live state for `batch`, zero-initialized on first use.")
      .def(
          "put",
          [](RecurrentCache& c, const Batch& batch, const py::object& conv,
             const py::object& delta) {
            if (batch.batch_size() > 1) {
              throw Error(fmt::format(
                  "RecurrentCache.put: a batch of {} rows needs one (conv_states, delta_states) "
                  "pair per row: use put_rows",
                  batch.batch_size()));
            }
            const RecurrentStates states = to_states(conv, delta, "RecurrentCache.put");
            without_gil([&] { c.put(batch, states.conv, states.delta); });
          },
          py::arg("batch"), py::arg("conv_states"), py::arg("delta_states"), ReleaseAfter(),
          "Ends a one-row forward: one state per scheduled split point, then the end "
          "state. " kAdopted
          " A row of no tokens leaves its sequence as it is: its arrays are "
          "checked, not adopted.")
      .def(
          "put_rows",
          [](RecurrentCache& c, const Batch& batch, const py::sequence& rows) {
            const py::tuple items(rows);  // one pass over the caller's sequence
            std::vector<RecurrentStates> states;
            for (size_t b = 0; b < items.size(); ++b) states.push_back(row_states(items[b], b));
            without_gil([&] { c.put(batch, states); });
          },
          py::arg("batch"), py::arg("rows"), ReleaseAfter(),
          "Ends a forward of any rows (rows of different sequences): rows[b] is row b's "
          "(conv_states, delta_states), each as put takes them. Every row is checked before "
          "any state changes. The arrays are adopted as put adopts them: do not write to them "
          "afterwards.")
      .def(
          "snapshot_splits",
          [](const RecurrentCache& c, int64_t forward_len, std::optional<SeqId> seq) {
            return seq ? c.snapshot_splits(*seq, forward_len) : c.snapshot_splits(forward_len);
          },
          py::arg("forward_len").noconvert(), py::kw_only(),
          py::arg("seq").noconvert() = py::none(), Released(),
          "Scheduled offsets strictly inside the next forward of sequence `seq` (default 0), "
          "relative to its offset.")
      .def_property_readonly("conv_tail", &RecurrentCache::conv_tail)
      .def_property_readonly("conv_dim", &RecurrentCache::conv_dim)
      .def_property_readonly("num_v_heads", &RecurrentCache::num_v_heads)
      .def_property_readonly("head_v_dim", &RecurrentCache::head_v_dim)
      .def_property_readonly("head_k_dim", &RecurrentCache::head_k_dim);
}

}  // namespace

void bind_caches(py::module_& m) {
  bind_snapshot(m);
  bind_cache(m);
  bind_attention_caches(m);
  bind_paged_cache(m);
  bind_recurrent_cache(m);
}

}  // namespace kvsnap::python
