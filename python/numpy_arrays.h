// The Python module's array boundary: numpy arrays (or kvsnap.Array, or what numpy.asarray takes;
// Array.from_dlpack for a DLPack producer) into kvsnap Arrays without a copy where the layout
// allows, and kvsnap Arrays out as numpy views whose base keeps the kvsnap buffer alive.
#pragma once

#include <kvsnap/array.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace kvsnap::python {

namespace py = pybind11;

// The Python face of kvsnap::Array (class kvsnap.Array): a handle on kvsnap storage or on
// wrapped memory. `read_only` for views of a cache's buffers and for memory numpy marks
// read-only (immutable bytes, broadcasts): no writable view of it is ever handed out.
struct PyArray {
  Array array;
  bool read_only = false;
  // Drops the array, then gives back what it let go of (release_deferred, python/gil.h).
  ~PyArray();
};

// `object` as a kvsnap Array: a kvsnap.Array as is; a numpy array (or any array-like) of dtype
// float32, float16, int32 or uint16 (bf16 bits) wrapped without a copy, the numpy array kept
// alive until kvsnap lets go of it; copied first only when the layout cannot be wrapped
// (negative or unaligned strides, misaligned data, non-native byte order). None gives an empty
// Array when `allow_none`. Throws kvsnap::Error naming `what` for other dtypes. read_only: the
// source's (a kvsnap.Array's flag, numpy's writeable flag negated).
PyArray to_py_array(py::handle object, const char* what, bool allow_none = false);
// The same, for inputs kvsnap only reads or adopts (never writes).
Array to_array(py::handle object, const char* what, bool allow_none = false);

// A numpy view of `array` (no copy) whose base is a kvsnap.Array holding it; None when empty.
// bf16 comes out as uint16 (numpy has no bfloat16).
py::object to_numpy(const Array& array, bool writeable);

// Registers kvsnap.Array (wrap, numpy views, DLPack) on the module.
void bind_arrays(py::module_& module);

}  // namespace kvsnap::python
