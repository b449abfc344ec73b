#include "numpy_arrays.h"

#include <dlpack/dlpack.h>
#include <fmt/format.h>
#include <kvsnap/dlpack.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "gil.h"

namespace kvsnap::python {
namespace {

struct DTypeMatch {
  const char* numpy_name;
  DType dtype;
};
constexpr DTypeMatch kDTypes[] = {{"float32", DType::f32},
                                  {"float16", DType::f16},
                                  {"int32", DType::i32},
                                  {"uint16", DType::bf16}};

const char* numpy_name(DType dtype) {
  for (const DTypeMatch& match : kDTypes) {
    if (match.dtype == dtype) return match.numpy_name;
  }
  throw Error(fmt::format("kvsnap dtype {} has no numpy dtype", dtype_name(dtype)));
}

// The kvsnap dtype of a native-order numpy dtype, or false.
bool match_dtype(const py::dtype& dtype, DType* out) {
  for (const DTypeMatch& match : kDTypes) {
    if (dtype.equal(py::dtype(match.numpy_name))) {
      *out = match.dtype;
      return true;
    }
  }
  return false;
}

// Whether kvsnap can name `array`'s elements as they lie: non-negative element strides, aligned.
bool wrappable(const py::array& array) {
  const auto itemsize = static_cast<py::ssize_t>(array.itemsize());
  if (reinterpret_cast<std::uintptr_t>(array.data()) % static_cast<std::uintptr_t>(itemsize)) {
    return false;
  }
  for (py::ssize_t axis = 0; axis < array.ndim(); ++axis) {
    if (array.strides(axis) < 0 || array.strides(axis) % itemsize != 0) return false;
  }
  return true;
}

// Keeps `owner` alive while kvsnap names its memory: the returned callback holds the reference,
// queued for release (defer_decref: kvsnap may drop it under a cache's lock, on any thread,
// without the GIL) when the callback is destroyed — after kvsnap's release, or at once when
// Array::wrap refuses the memory.
std::function<void()> keep_alive(py::object owner) {
  std::shared_ptr<PyObject> reference(owner.release().ptr(), &defer_decref);
  return [reference] {};
}

PyArray wrap_numpy(py::array array, const char* what) {
  if (array.ndim() > Array::kMaxDims) {  // before any copy below
    throw Error(fmt::format("{}: numpy array of {} axes; kvsnap arrays have at most {}", what,
                            array.ndim(), Array::kMaxDims));
  }
  const bool read_only = !array.writeable();
  DType dtype;
  if (!match_dtype(array.dtype(), &dtype)) {
    // The same type in the other byte order: a native copy.
    py::dtype native = array.dtype().attr("newbyteorder")("=");
    if (!match_dtype(native, &dtype)) {
      throw Error(fmt::format(
          "{}: numpy dtype {} is not supported (float32, float16, int32, or uint16 holding bf16)",
          what, py::str(array.dtype()).cast<std::string>()));
    }
    array = py::array(array.attr("astype")(native));
  }
  if (!wrappable(array)) {  // a fresh C-order copy (ascontiguousarray keeps misaligned data)
    array = py::array(py::module_::import("numpy").attr("array")(array, py::arg("copy") = true,
                                                                 py::arg("order") = "C"));
  }
  Shape shape, strides;
  for (py::ssize_t axis = 0; axis < array.ndim(); ++axis) {
    shape.push_back(array.shape(axis));
    strides.push_back(array.strides(axis) / array.itemsize());
  }
  // kvsnap names the memory without writing it; read_only keeps writable views from being made.
  void* data = const_cast<void*>(array.data());
  return PyArray{Array::wrap(data, dtype, shape, strides, keep_alive(array)), read_only};
}

void delete_unused_dltensor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* tensor = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    tensor->deleter(tensor);
  }
}

// Whether kvsnap cannot name `tensor`'s layout, which a copy can: a negative stride, or data not
// aligned to its elements (numpy exports both).
bool needs_copy(const DLTensor& tensor) {
  for (int axis = 0; tensor.strides != nullptr && axis < tensor.ndim; ++axis) {
    if (tensor.strides[axis] < 0) return true;
  }
  const uint64_t item = std::max<uint64_t>(1, tensor.dtype.bits / 8);
  return (reinterpret_cast<uintptr_t>(tensor.data) + tensor.byte_offset) % item != 0;
}

// A compact copy of `tensor`, whose strides may be negative and whose data may be misaligned.
// Its checks are from_dlpack's, made on a row-major stand-in whose memory is not read (and its
// limit on byte_offset, which the stand-in does not carry). Touches no Python object: runs
// without the GIL (a tensor may be gigabytes).
Array copy_dlpack(const DLTensor& tensor) {
  if (tensor.byte_offset > (uint64_t{1} << 62)) {
    throw Error(fmt::format("from_dlpack: byte_offset {} is more than 2^62", tensor.byte_offset));
  }
  DLManagedTensor stand_in{};
  stand_in.dl_tensor = tensor;
  stand_in.dl_tensor.strides = nullptr;
  // Aligned (wrap checks it), and null only where the tensor's is (from_dlpack refuses that).
  const auto start = reinterpret_cast<uintptr_t>(tensor.data) + tensor.byte_offset;
  stand_in.dl_tensor.data =
      tensor.data == nullptr
          ? nullptr
          : reinterpret_cast<void*>(std::max<uintptr_t>(start & ~uintptr_t{63}, 64));
  stand_in.dl_tensor.byte_offset = 0;
  stand_in.deleter = [](DLManagedTensor*) {};
  const Array checked = from_dlpack(&stand_in);  // device, dtype, axes
  Array copy = Array::uninitialized(checked.dtype(), checked.shape());
  if (copy.size() == 0) return copy;
  const int64_t item = dtype_size(copy.dtype());
  int64_t strides[Array::kMaxDims] = {};  // in elements; none given: row-major
  int64_t step = 1;
  for (int axis = tensor.ndim - 1; axis >= 0; --axis) {
    strides[axis] = tensor.strides != nullptr ? tensor.strides[axis] : step;
    step *= tensor.shape[axis];
  }
  const char* source = static_cast<const char*>(tensor.data) + tensor.byte_offset;
  char* out = static_cast<char*>(copy.mutable_bytes());
  int64_t index[Array::kMaxDims] = {};
  for (int64_t n = 0; n < copy.size(); ++n) {
    int64_t element = 0;
    for (int axis = 0; axis < tensor.ndim; ++axis) element += index[axis] * strides[axis];
    std::memcpy(out + n * item, source + element * item, static_cast<size_t>(item));
    for (int axis = tensor.ndim - 1; axis >= 0 && ++index[axis] == tensor.shape[axis]; --axis) {
      index[axis] = 0;  // row-major: the last axis moves fastest
    }
  }
  return copy;
}

// The producer's tensor as a kvsnap Array. The capsule stays unconsumed and is what kvsnap keeps
// alive (keep_alive): the tensor's deleter runs when the capsule goes, under the GIL and never
// under a kvsnap lock. Negative strides or misaligned data: a copy (the capsule then goes at
// once).
PyArray array_from_dlpack(py::object producer) {
  py::capsule capsule = producer.attr("__dlpack__")();
  const char* name = capsule.name();
  if (name == nullptr || std::string(name) != "dltensor") {
    throw Error("Array.from_dlpack: __dlpack__ returned a capsule that is not a \"dltensor\"");
  }
  const DLTensor& tensor = static_cast<DLManagedTensor*>(capsule.get_pointer())->dl_tensor;
  // (The capsule, unconsumed, keeps the producer's memory meanwhile.)
  if (needs_copy(tensor)) return PyArray{without_gil([&] { return copy_dlpack(tensor); })};
  DLManagedTensor stand_in{};
  stand_in.dl_tensor = tensor;
  stand_in.deleter = [](DLManagedTensor*) {};
  const Array view = from_dlpack(&stand_in);  // checks device, dtype, axes and strides
  return PyArray{Array::wrap(view.mutable_bytes(), view.dtype(), view.shape(), view.strides(),
                             keep_alive(capsule))};
}

// A DLPack capsule of `self`: a view, or a compact copy when asked (copy=True) or when the array
// is read-only — DLPack 0.x cannot mark a tensor read-only and consumers (numpy, torch) hand out
// writable arrays over what they import. copy=False on a read-only array: BufferError.
// Unversioned (DLPack 0.x) whatever max_version asks, as the protocol allows a producer that has
// no versioned capsule; `dl_device` (None or the CPU's) is checked.
py::capsule export_dlpack(const PyArray& self, const py::object& dl_device,
                          std::optional<bool> copy) {
  if (!dl_device.is_none() && !dl_device.equal(py::make_tuple(static_cast<int>(kDLCPU), 0))) {
    throw py::buffer_error(
        fmt::format("Array.__dlpack__: dl_device {} asked; kvsnap arrays are on the CPU (1, 0)",
                    py::repr(dl_device).cast<std::string>()));
  }
  if (self.read_only && copy == false) {  // BufferError: what the protocol names for it
    throw py::buffer_error(
        "Array.__dlpack__: copy=False, but this array is read-only (a view of a cache's buffers "
        "or of read-only memory) and DLPack cannot export a read-only view; copy=None (the "
        "default) or True exports a copy");
  }
  const Array exported =
      self.read_only || copy.value_or(false)
          ? without_gil([&] { return self.array.contiguous(); })  // a cache's view: maybe GBs
          : self.array;
  // Owned until the capsule holds it: a capsule that cannot be made must not leak the tensor
  // (and the buffer it keeps alive).
  std::unique_ptr<DLManagedTensor, void (*)(DLManagedTensor*)> tensor(
      to_dlpack(exported), [](DLManagedTensor* t) { t->deleter(t); });
  py::capsule capsule(tensor.get(), "dltensor", &delete_unused_dltensor);
  (void)tensor.release();
  return capsule;
}

py::tuple to_tuple(const Shape& extents) {
  py::tuple tuple(extents.size());
  for (size_t i = 0; i < extents.size(); ++i) tuple[i] = extents[i];
  return tuple;
}

}  // namespace

PyArray::~PyArray() {
  array = Array();
  release_deferred_in_destructor();  // what the array let go of (never under a kvsnap lock here)
}

PyArray to_py_array(py::handle object, const char* what, bool allow_none) {
  if (object.is_none()) {
    if (allow_none) return PyArray{};
    throw Error(fmt::format("{}: an array is required, not None", what));
  }
  if (py::isinstance<PyArray>(object)) return object.cast<const PyArray&>();
  const py::module_ numpy = py::module_::import("numpy");
  py::object array = numpy.attr("asarray")(object);
  const bool numbers = py::isinstance<py::list>(object) || py::isinstance<py::tuple>(object) ||
                       py::isinstance<py::int_>(object) || py::isinstance<py::float_>(object);
  const py::object dtype = array.attr("dtype");
  if (numbers &&
      (dtype.equal(numpy.attr("dtype")("int64")) || dtype.equal(numpy.attr("dtype")("float64")))) {
    // Python numbers (lists, tuples, scalars) come as int64 or float64, which kvsnap does not
    // hold: ints become int32, floats float32 (what a model computes in), when every value fits.
    const bool ints = dtype.equal(numpy.attr("dtype")("int64"));
    py::object narrowed = array.attr("astype")(numpy.attr(ints ? "int32" : "float32"));
    const bool fits =
        ints ? numpy.attr("array_equal")(narrowed, array).cast<bool>()
             : numpy.attr("array_equal")(numpy.attr("isinf")(narrowed), numpy.attr("isinf")(array))
                   .cast<bool>();
    if (!fits) {
      throw Error(fmt::format("{}: Python {} outside {}", what, ints ? "ints" : "floats",
                              ints ? "int32" : "float32"));
    }
    array = narrowed;
  }
  return wrap_numpy(py::array(array), what);
}

Array to_array(py::handle object, const char* what, bool allow_none) {
  return to_py_array(object, what, allow_none).array;
}

py::object to_numpy(const Array& array, bool writeable) {
  if (array.empty()) return py::none();
  Shape byte_strides = array.strides();
  for (int64_t& stride : byte_strides) stride *= dtype_size(array.dtype());
  py::object base = py::cast(PyArray{array, !writeable});
  py::array view(py::dtype(numpy_name(array.dtype())), std::vector<int64_t>(array.shape()),
                 std::vector<int64_t>(byte_strides), array.bytes(), base);
  if (!writeable) view.attr("setflags")(py::arg("write") = false);
  return view;
}

void bind_arrays(py::module_& m) {
  py::class_<PyArray>(m, "Array",
                      R"(A kvsnap array: a handle on kvsnap's storage or on memory it wraps.

Array(obj) wraps a numpy array (or anything numpy.asarray accepts) without copying it; the numpy
array stays alive while kvsnap uses it. numpy.asarray(a) and a.numpy() are views again,
read-only when a is (a view of a cache's buffers, or of memory numpy marks read-only); DLPack
(__dlpack__, Array.from_dlpack) exchanges arrays with torch, jax and numpy without a copy, but
exports a copy of a read-only array (DLPack cannot mark a tensor read-only).)")
      .def(py::init([](py::object object) { return to_py_array(object, "kvsnap.Array"); }),
           py::arg("obj"), ReleaseAfter(),
           "Wraps obj (a numpy array) without copying where its layout allows; read-only when "
           "obj is (a read-only numpy array, a view of a cache's buffers).")
      .def_static("from_dlpack", &array_from_dlpack, py::arg("obj"), ReleaseAfter(),
                  "Wraps any DLPack producer's CPU tensor (f32, f16, bf16, i32) without a copy "
                  "(a compact copy when it has negative strides). Writable even where the "
                  "producer's memory is not (an unversioned capsule cannot say so): do not write "
                  "through it to an immutable producer's (jax's) memory.")
      .def(
          "__dlpack__",
          [](const PyArray& self, py::object /*stream*/, py::object /*max_version*/,
             py::object dl_device,
             std::optional<bool> copy) { return export_dlpack(self, dl_device, copy); },
          py::arg("stream") = py::none(), py::kw_only(), py::arg("max_version") = py::none(),
          py::arg("dl_device") = py::none(), py::arg("copy") = py::none(),
          "A DLPack capsule viewing this array (no copy), or a copy of it when copy=True or when "
          "the array is read-only (DLPack cannot mark a tensor read-only); copy=False on a "
          "read-only array, or a device other than the CPU, raises BufferError. "
          "Unversioned (DLPack 0.x) whatever max_version asks.")
      .def("__dlpack_device__", [](const PyArray&) { return py::make_tuple(int(kDLCPU), 0); })
      .def(
          "numpy", [](const PyArray& self) { return to_numpy(self.array, !self.read_only); },
          "A numpy view of this array (no copy); read-only for views of a cache's buffers.")
      .def(
          "__array__",
          [](const PyArray& self, py::object dtype, std::optional<bool> copy) {
            py::object view = to_numpy(self.array, !self.read_only);
            const py::dtype wanted = dtype.is_none() ? view.attr("dtype").cast<py::dtype>()
                                                     : py::dtype::from_args(dtype);
            // bf16 is viewed as its uint16 bits: another dtype converts the values, not the
            // bits (through float32, which holds every bf16 value exactly); uint16 keeps them.
            const bool by_value =
                self.array.dtype() == DType::bf16 && !wanted.equal(py::dtype::of<uint16_t>());
            const bool converts = by_value || !wanted.equal(view.attr("dtype"));
            if (copy == false && converts) {  // numpy 2's protocol: ValueError
              throw py::value_error(fmt::format(
                  "Array.__array__: copy=False, but converting {} to {} needs a copy",
                  dtype_name(self.array.dtype()), wanted.attr("name").cast<std::string>()));
            }
            if (by_value) {  // a new float32 array: the result itself when float32 is wanted
              view = to_numpy(without_gil([&] { return self.array.astype(DType::f32); }), true);
              if (wanted.equal(view.attr("dtype"))) return view;
            }
            if (!converts && !copy.value_or(false)) return view;
            return view.attr("astype")(wanted);  // a new array
          },
          py::arg("dtype") = py::none(), py::kw_only(), py::arg("copy") = py::none(),
          "This array as numpy (a view when dtype is None; bf16 views its uint16 bits), or "
          "converted to `dtype` (bf16 by value); copy=True always copies, copy=False raises "
          "ValueError where a conversion needs a copy (numpy 2's protocol).")
      .def_property_readonly("shape",
                             [](const PyArray& self) { return to_tuple(self.array.shape()); })
      .def_property_readonly(
          "strides", [](const PyArray& self) { return to_tuple(self.array.strides()); },
          "Element strides (not bytes).")
      .def_property_readonly(
          "dtype", [](const PyArray& self) { return std::string(dtype_name(self.array.dtype())); },
          "'f32', 'f16', 'bf16' or 'i32'.")
      .def_property_readonly("nbytes", [](const PyArray& self) { return self.array.nbytes(); })
      .def_property_readonly("read_only", [](const PyArray& self) { return self.read_only; })
      .def(
          "shares_storage",
          [](const PyArray& self, const PyArray& other) {
            return self.array.shares_storage(other.array);
          },
          py::arg("other"), "True when both name the same kvsnap buffer.")
      .def("__repr__", [](const PyArray& self) {
        return fmt::format("kvsnap.Array({})", self.array.describe());
      });
}

}  // namespace kvsnap::python
