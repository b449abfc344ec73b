// The reference kernels (sdpa, causal_conv1d, gated_delta) and byte accounting.
#include <pybind11/stl.h>

#include "bindings.h"

namespace kvsnap::python {
namespace {

py::list to_numpy_list(const std::vector<Array>& arrays) {
  py::list list;
  for (const Array& array : arrays) list.append(to_numpy(array, /*writeable=*/true));
  return list;
}

void bind_kernels(py::module_& m) {
  m.def(
      "sdpa",
      [](const Batch& batch, py::object q, const KVHistory& history, const AttentionMask& mask,
         float scale) {
        const Array queries = to_array(q, "sdpa q");
        return to_numpy(without_gil([&] { return sdpa(batch, queries, history, mask, scale); }),
                        true);
      },
      py::arg("batch"), py::arg("q"), py::arg("history"), py::arg("mask"), py::arg("scale"),
      ReleaseAfter(),
      "Reference attention: q [B, Hq, L, D] over the history; float32 [B, Hq, L, Dv].");
  m.def(
      "causal_conv1d",
      [](py::object x, py::object weight, py::object tail, const std::vector<int64_t>& boundaries) {
        const Array input = to_array(x, "causal_conv1d x");
        const Array weights = to_array(weight, "causal_conv1d weight");
        const Array start = to_array(tail, "causal_conv1d tail", /*allow_none=*/true);
        Conv1dResult result =
            without_gil([&] { return causal_conv1d(input, weights, start, boundaries); });
        return py::make_tuple(to_numpy(result.output, true), to_numpy_list(result.tails));
      },
      py::arg("x"), py::arg("weight"), py::arg("tail") = py::none(),
      py::arg("boundaries").noconvert() = std::vector<int64_t>{}, ReleaseAfter(),
      "Causal depthwise conv1d: x [B, L, C], weight [C, W], tail [B, W-1, C] (None: zeros). "
      "Returns (output float32 [B, L, C], [tail per boundary, then the end]).");
  m.def(
      "gated_delta",
      [](py::object q, py::object k, py::object v, py::object g, py::object beta, py::object state,
         const std::vector<int64_t>& boundaries) {
        const std::vector<Array> in = {
            to_array(q, "gated_delta q"),       to_array(k, "gated_delta k"),
            to_array(v, "gated_delta v"),       to_array(g, "gated_delta g"),
            to_array(beta, "gated_delta beta"), to_array(state, "gated_delta state", true)};
        GatedDeltaResult result = without_gil(
            [&] { return gated_delta(in[0], in[1], in[2], in[3], in[4], in[5], boundaries); });
        return py::make_tuple(to_numpy(result.output, true), to_numpy_list(result.states));
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"),
      py::arg("state") = py::none(), py::arg("boundaries").noconvert() = std::vector<int64_t>{},
      ReleaseAfter(),
      "Gated delta rule: q, k [B, L, Hk, Dk]; v [B, L, Hv, Dv]; g, beta [B, L, Hv]; state "
      "[B, Hv, Dv, Dk] (None: zeros). Returns (output float32 [B, L, Hv, Dv], [state per "
      "boundary, then the end]).");
}

}  // namespace

void bind_ops(py::module_& m) {
  bind_kernels(m);
  m.def("set_threads", &set_threads, py::arg("threads").noconvert(), Released(),
        "Threads the kernels use (sdpa over a batch), the calling one included; 1 (the default) "
        "runs everything on the calling thread. Every count gives bitwise the same results. "
        "Raises kvsnap.Error outside [1, 256].");
  m.def("threads", &threads, "The kernels' thread count (set_threads).");
  m.def("live_bytes", &live_bytes,
        "Bytes held by live kvsnap-allocated arrays (not wrapped ones).");
  m.def("allocation_count", &allocation_count, "Allocations of kvsnap's allocator so far.");
  m.def("pool_bytes", &pool_bytes, "Bytes the buffer pool holds for reuse.");
  m.def("trim_pool", &trim_pool, Released(), "Returns every pooled buffer to the system now.");
}

}  // namespace kvsnap::python
