#include "numpy_arrays.h"

#include <dlpack/dlpack.h>
#include <fmt/format.h>
#include <kvsnap/dlpack.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

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
  return "?";
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
// given back (under the GIL) when the callback is destroyed — after kvsnap's release, or at once
// when Array::wrap refuses the memory. Not given back once the interpreter is shutting down.
std::function<void()> keep_alive(py::object owner) {
  std::shared_ptr<PyObject> reference(owner.release().ptr(), [](PyObject* object) {
#if PY_VERSION_HEX >= 0x030D0000
    if (!Py_IsInitialized() || Py_IsFinalizing()) return;
#else
    if (!Py_IsInitialized() || _Py_IsFinalizing()) return;
#endif
    py::gil_scoped_acquire gil;
    Py_DECREF(object);
  });
  return [reference] {};
}

Array wrap_numpy(py::array array, const char* what) {
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
  if (!wrappable(array))
    array = py::array(py::module_::import("numpy").attr("ascontiguousarray")(array));
  Shape shape, strides;
  for (py::ssize_t axis = 0; axis < array.ndim(); ++axis) {
    shape.push_back(array.shape(axis));
    strides.push_back(array.strides(axis) / array.itemsize());
  }
  if (shape.size() > static_cast<size_t>(Array::kMaxDims)) {
    throw Error(fmt::format("{}: numpy array of {} axes; kvsnap arrays have at most {}", what,
                            array.ndim(), Array::kMaxDims));
  }
  void* data = const_cast<void*>(array.data());
  return Array::wrap(data, dtype, shape, strides, keep_alive(array));
}

PyArray array_from_dlpack(py::object producer) {
  py::capsule capsule = producer.attr("__dlpack__")();
  if (std::string(capsule.name()) != "dltensor") {
    throw Error("Array.from_dlpack: __dlpack__ returned a capsule that is not a \"dltensor\"");
  }
  auto* tensor = static_cast<DLManagedTensor*>(capsule.get_pointer());
  PyArray result{from_dlpack(tensor)};                // takes ownership once it succeeds ...
  PyCapsule_SetName(capsule.ptr(), "used_dltensor");  // ... so the capsule must not delete it
  return result;
}

void delete_unused_dltensor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* tensor = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    tensor->deleter(tensor);
  }
}

py::tuple to_tuple(const Shape& extents) {
  py::tuple tuple(extents.size());
  for (size_t i = 0; i < extents.size(); ++i) tuple[i] = extents[i];
  return tuple;
}

}  // namespace

Array to_array(py::handle object, const char* what, bool allow_none) {
  if (object.is_none()) {
    if (allow_none) return Array();
    throw Error(fmt::format("{}: an array is required, not None", what));
  }
  if (py::isinstance<PyArray>(object)) return object.cast<const PyArray&>().array;
  return wrap_numpy(py::array(py::module_::import("numpy").attr("asarray")(object)), what);
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
array stays alive while kvsnap uses it. numpy.asarray(a) and a.numpy() are views again; DLPack
(__dlpack__, Array.from_dlpack) exchanges arrays with torch, jax and numpy without a copy.)")
      .def(py::init([](py::object object) { return PyArray{to_array(object, "kvsnap.Array")}; }),
           py::arg("obj"), "Wraps obj (a numpy array) without copying where its layout allows.")
      .def_static("from_dlpack", &array_from_dlpack, py::arg("obj"),
                  "Wraps any DLPack producer's CPU tensor (f32, f16, bf16, i32) without a copy.")
      .def(
          "__dlpack__",
          [](const PyArray& self, py::object /*stream*/) {
            return py::capsule(to_dlpack(self.array), "dltensor", &delete_unused_dltensor);
          },
          py::arg("stream") = py::none(),
          "A DLPack capsule viewing this array (no copy). DLPack has no read-only flag: treat "
          "views of a cache's buffers as read-only.")
      .def("__dlpack_device__", [](const PyArray&) { return py::make_tuple(int(kDLCPU), 0); })
      .def(
          "numpy", [](const PyArray& self) { return to_numpy(self.array, !self.read_only); },
          "A numpy view of this array (no copy); read-only for views of a cache's buffers.")
      .def(
          "__array__",
          [](const PyArray& self, py::object dtype) {
            py::object view = to_numpy(self.array, !self.read_only);
            return dtype.is_none() ? view : view.attr("astype")(dtype);
          },
          py::arg("dtype") = py::none())
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
