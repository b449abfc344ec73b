// kvsnap.Batch, kvsnap.AttentionMask, kvsnap.KVHistory and kvsnap.RecurrentHistory: what a
// layer passes in and gets back.
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <tuple>

#include "bindings.h"

namespace kvsnap::python {
namespace {

const char* mask_kind_name(AttentionMask::Kind kind) {
  switch (kind) {
    case AttentionMask::Kind::none:
      return "none";
    case AttentionMask::Kind::causal:
      return "causal";
    case AttentionMask::Kind::sliding_window:
      return "sliding_window";
    case AttentionMask::Kind::array:
      return "array";
    case AttentionMask::Kind::intersection:
      return "intersection";
    case AttentionMask::Kind::lookback:
      return "lookback";
  }
  return "?";
}

// input_ids as the int32 array Batch holds: another integer dtype (a list of Python ints comes
// as int64) is converted when every value fits, else Error; an empty array of another dtype (an
// empty list comes as float64) is no ids (None). Any other dtype is refused: token ids are
// integers.
py::object input_ids_int32(py::object ids) {
  if (ids.is_none()) return ids;
  const py::module_ numpy = py::module_::import("numpy");
  py::object array = numpy.attr("asarray")(ids);
  const py::object dtype = array.attr("dtype");
  const auto kind = py::str(dtype.attr("kind")).cast<std::string>();
  if (dtype.equal(numpy.attr("dtype")("int32"))) return array;
  if (kind != "i" && kind != "u") {
    if (array.attr("size").cast<int64_t>() == 0) return py::none();  // no ids
    throw Error(fmt::format("Batch.input_ids: {} {}; token ids are integers (int32)",
                            py::str(dtype).cast<std::string>(),
                            py::str(array.attr("shape")).cast<std::string>()));
  }
  py::object narrowed = array.attr("astype")(numpy.attr("int32"));
  if (!numpy.attr("array_equal")(narrowed, array).cast<bool>()) {
    throw Error(fmt::format("Batch.input_ids: {} values outside int32 (token ids are int32)",
                            py::str(dtype).cast<std::string>()));
  }
  return narrowed;
}

void bind_batch(py::module_& m) {
  py::class_<Batch>(m, "Batch", R"(What one forward step processes: B rows of L columns.

Row b holds seq_query_lens[b] real tokens (the rest is padding) starting at absolute position
seq_offsets[b].)")
      .def(py::init([](py::object input_ids, std::vector<int32_t> seq_offsets,
                       std::vector<int32_t> seq_query_lens, std::vector<SeqId> seq_ids) {
             Batch batch;
             // A copy (a few ids): an engine refilling its buffer changes no earlier Batch.
             batch.input_ids =
                 to_array(input_ids_int32(input_ids), "Batch.input_ids", /*allow_none=*/true);
             if (!batch.input_ids.empty()) batch.input_ids = batch.input_ids.contiguous();
             batch.seq_offsets = std::move(seq_offsets);
             batch.seq_query_lens = std::move(seq_query_lens);
             batch.seq_ids = std::move(seq_ids);
             return batch;
           }),
           py::arg("input_ids") = py::none(),
           py::arg("seq_offsets").noconvert() = std::vector<int32_t>{},
           py::arg("seq_query_lens").noconvert() = std::vector<int32_t>{},
           py::arg("seq_ids").noconvert() = std::vector<SeqId>{}, ReleaseAfter(),
           "input_ids: int32 [B, L], copied (or None; other integer arrays and lists of ints "
           "are converted when every id fits int32); one offset and one query length per row; "
           "seq_ids: the sequence of each row (empty: row b is sequence b).")
      .def_static(
          "rows",
          [](const std::vector<std::tuple<int32_t, int64_t, std::vector<int32_t>>>& rows) {
            std::vector<Batch::Chunk> chunks;
            for (const auto& row : rows) {
              chunks.push_back({std::get<0>(row), std::get<1>(row), std::get<2>(row)});
            }
            return Batch::rows(chunks);
          },
          py::arg("rows").noconvert(),
          "One row per (seq, offset, tokens): rows of different sequences, each at its own "
          "offset with its own length (shorter rows padded).")
      .def_static(
          "single",
          [](const std::vector<int32_t>& tokens, int64_t offset) {
            return Batch::single(tokens, offset);
          },
          py::arg("tokens").noconvert(), py::arg("offset").noconvert(),
          "One row of `tokens` starting at `offset`, no padding.")
      .def_static("uniform", &Batch::uniform, py::arg("rows").noconvert(),
                  py::arg("length").noconvert(), py::arg("offset").noconvert(),
                  "`rows` rows of `length` placeholder tokens at `offset`.")
      .def_property_readonly(
          "input_ids", [](const Batch& b) { return to_numpy(b.input_ids, /*writeable=*/false); })
      .def_readonly("seq_offsets", &Batch::seq_offsets)
      .def_readonly("seq_query_lens", &Batch::seq_query_lens)
      .def_readonly("seq_ids", &Batch::seq_ids)
      .def_property_readonly("batch_size", &Batch::batch_size, "Rows B.")
      .def_property_readonly("length", &Batch::length, "Columns L.")
      .def(
          "validate", [](const Batch& b) { b.validate("Batch.validate"); },
          "Raises kvsnap.Error unless the rows agree with each other and with input_ids.");
}

void bind_mask(py::module_& m) {
  py::class_<AttentionMask>(m, "AttentionMask",
                            "Which key positions each query position may see (absolute "
                            "positions).")
      .def_static("none", &AttentionMask::none, "Every key visible.")
      .def_static("causal", &AttentionMask::causal, "Query i sees keys j <= i.")
      .def_static("sliding_window", &AttentionMask::sliding_window, py::arg("window").noconvert(),
                  "Query i sees keys j with i - window < j <= i.")
      .def_static("lookback", &AttentionMask::lookback, py::arg("window").noconvert(),
                  "Query i sees keys j > i - window, later keys included.")
      .def_static(
          "from_array",
          [](py::object array) {
            return AttentionMask::from_array(to_array(array, "AttentionMask.from_array"));
          },
          py::arg("array"), ReleaseAfter(),
          "Explicit [B|1, Hq|1, L, P] mask: int32 is boolean, float an additive bias. The "
          "array is wrapped, not copied (masks can be large): a write to it changes the mask, "
          "and must not happen while a call on another thread reads it.")
      .def("intersect", &AttentionMask::intersect, py::arg("other"), "Keys visible under both.")
      .def_property_readonly("kind",
                             [](const AttentionMask& mask) { return mask_kind_name(mask.kind()); })
      .def_property_readonly("is_causal", &AttentionMask::is_causal)
      .def_property_readonly("window", &AttentionMask::window, "Lookback window, 0 for none.")
      .def("allows", &AttentionMask::allows, py::arg("query").noconvert(),
           py::arg("key").noconvert(),
           "Whether the positional rules let position `query` see `key`.");
}

void bind_paged_columns(py::module_& m) {
  py::class_<PagedColumns>(m, "PagedColumns", R"(A paged history's blocks, for an engine's own
paged attention kernel.

Column k of the sequence is in slot k % block_tokens of block table[k // block_tokens]; block i
holds columns [r * T, (r + 1) * T) of chunk i // blocks_per_chunk, where r = i % blocks_per_chunk
and T = block_tokens. key_chunks and value_chunks are read-only numpy views
[1, H, blocks_per_chunk * T, D] of the pool (no copy).)")
      .def_readonly("block_tokens", &PagedColumns::block_tokens)
      .def_readonly("blocks_per_chunk", &PagedColumns::blocks_per_chunk)
      .def_readonly("length", &PagedColumns::length, "Columns K; the last block may be partial.")
      .def_property_readonly(
          "table",
          [](const PagedColumns& p) {
            return py::array_t<int32_t>(static_cast<py::ssize_t>(p.table.size()), p.table.data());
          },
          "Block ids in position order (int32, a copy).")
      .def_property_readonly("key_chunks",
                             [](const PagedColumns& p) {
                               py::list out;
                               for (const Array& a : p.key_chunks) out.append(to_numpy(a, false));
                               return out;
                             })
      .def_property_readonly("value_chunks", [](const PagedColumns& p) {
        py::list out;
        for (const Array& a : p.value_chunks) out.append(to_numpy(a, false));
        return out;
      });
}

// Error naming `call` for a ragged history: its rows have their own columns (row(b)).
void require_columns(const KVHistory& h, const char* call) {
  if (h.ragged()) {
    throw Error(
        fmt::format("{}: this history is ragged ({} rows of different sequences, each with its own "
                    "columns); ask row(b)",
                    call, h.rows()));
  }
}

void bind_kv_history(py::module_& m) {
  py::class_<KVHistory>(m, "KVHistory", R"(Keys and values a cache hands back for attention.

keys [B, H, K, D] and values [B, H, K, Dv] are read-only numpy views of the cache's buffers (no
copy; they keep the buffers alive). They show the history as of the call that returned it:
later writes to the cache may change what they show. Key column c holds absolute position
position(c).)")
      .def_property_readonly(
          "keys", [](const KVHistory& h) { return to_numpy(h.keys(), /*writeable=*/false); })
      .def_property_readonly(
          "values", [](const KVHistory& h) { return to_numpy(h.values(), /*writeable=*/false); })
      .def_property_readonly("length", &KVHistory::length, "Key columns K.")
      .def_property_readonly(
          "first_position",
          [](const KVHistory& h) {
            require_columns(h, "KVHistory.first_position");
            return h.first_position();
          },
          "Absolute position of column oldest_column.")
      .def_property_readonly(
          "oldest_column",
          [](const KVHistory& h) {
            require_columns(h, "KVHistory.oldest_column");
            return h.oldest_column();
          },
          "The column holding first_position (columns wrap in a rotating window's ring).")
      .def_property_readonly(
          "window",
          [](const KVHistory& h) {
            require_columns(h, "KVHistory.window");  // a ragged history's rows have their own
            return h.window();
          },
          "The cache's lookback window, or 0.")
      .def(
          "position",
          [](const KVHistory& h, int64_t column) {
            require_columns(h, "KVHistory.position");
            if (column < 0 || column >= h.length()) {
              throw Error(fmt::format("KVHistory.position: column {} out of range [0, {})", column,
                                      h.length()));
            }
            return h.position(column);
          },
          py::arg("column").noconvert(), "Absolute position held by key column `column`.")
      .def("apply_mask", &KVHistory::apply_mask, py::arg("batch"), py::arg("logical"), Released(),
           "The physical mask over this history's columns for `batch`'s queries.")
      .def_property_readonly("paged", &KVHistory::paged,
                             "A sequence's blocks in a paged cache (keys/values are None).")
      .def_property_readonly(
          "paged_columns",
          [](const KVHistory& h) -> py::object {
            if (!h.paged()) return py::none();
            return py::cast(h.paged_columns());
          },
          "A paged history's blocks (PagedColumns), else None.")
      .def_property_readonly("ragged", &KVHistory::ragged,
                             "One history per batch row (rows of different sequences).")
      .def_property_readonly("rows", &KVHistory::rows, "Rows of a ragged history, else 1.")
      .def(
          "row",
          [](const KVHistory& h, int64_t b) {
            if (b < 0 || b >= h.rows()) {
              throw Error(fmt::format("KVHistory.row: row {} out of range [0, {})", b, h.rows()));
            }
            return h.row(b);
          },
          py::arg("b").noconvert(), "Row b's history (this one unless ragged).")
      .def("contiguous", &KVHistory::contiguous, Released(),
           "A contiguous copy of a paged history (keys and values as plain arrays).");
}

void bind_recurrent_history(py::module_& m) {
  py::class_<RecurrentHistory>(m, "RecurrentHistory", R"(A recurrent layer's live state.

conv_state and delta_state are read-only numpy views of the states the cache holds (no copy);
for a batch of several rows (rows of different sequences) they are None: take row(b).)")
      .def_property_readonly(
          "conv_state",
          [](const RecurrentHistory& h) { return to_numpy(h.conv_state(), /*writeable=*/false); },
          "[1, conv_tail, conv_dim] in the activation dtype (None for several rows).")
      .def_property_readonly(
          "delta_state",
          [](const RecurrentHistory& h) { return to_numpy(h.delta_state(), /*writeable=*/false); },
          "[1, v_heads, v_dim, k_dim] float32 (None for several rows).")
      .def_property_readonly("rows", &RecurrentHistory::rows, "Rows of the batch it was got for.")
      .def(
          "row",
          [](const RecurrentHistory& h, int64_t b) {
            if (b < 0 || b >= h.rows()) {
              throw Error(
                  fmt::format("RecurrentHistory.row: row {} out of range [0, {})", b, h.rows()));
            }
            return h.row(b);
          },
          py::arg("b").noconvert(), "Row b's states (this history for a single row).");
}

}  // namespace

void bind_batch_and_history(py::module_& m) {
  bind_batch(m);
  bind_mask(m);
  bind_paged_columns(m);
  bind_kv_history(m);
  bind_recurrent_history(m);
}

}  // namespace kvsnap::python
