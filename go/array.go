package kvsnap

/*
#include <stdlib.h>
#include <kvsnap/kvsnap_c.h>
*/
import "C"

import (
	"fmt"
	"math"
	"runtime"
	"sync"
	"unsafe"
)

// DType is an element type (kvsnap_dtype).
type DType int

const (
	F32  DType = C.KVSNAP_F32
	F16  DType = C.KVSNAP_F16
	BF16 DType = C.KVSNAP_BF16
	I32  DType = C.KVSNAP_I32
)

// Size is the bytes of one element.
func (d DType) Size() int {
	switch d {
	case F16, BF16:
		return 2
	}
	return 4
}

func (d DType) String() string {
	switch d {
	case F32:
		return "f32"
	case F16:
		return "f16"
	case BF16:
		return "bf16"
	case I32:
		return "i32"
	}
	return fmt.Sprintf("dtype(%d)", int(d))
}

// MaxDims is the most dimensions an array has (KVSNAP_MAX_DIMS).
const MaxDims = C.KVSNAP_MAX_DIMS

// Array is a kvsnap array in C memory: one the library allocated (Zeros, FromFloat32), or a
// view of a cache's buffers (a History's keys and values, a cache's state), which is read-only
// and live: a later write to the cache may change what it shows (a window's ring wraps), so
// read a history before the next write to its cache. Its memory lives until Close of the last
// array, view, snapshot or cache naming it.
type Array struct {
	mu  sync.RWMutex
	ptr *C.kvsnap_array
}

func newArray(ptr *C.kvsnap_array) *Array {
	if ptr == nil {
		return nil
	}
	a := &Array{ptr: ptr}
	runtime.SetFinalizer(a, (*Array).Close)
	return a
}

func cShape(call string, shape []int64) (*C.int64_t, C.int, error) {
	if len(shape) > MaxDims {
		return nil, 0, invalid(call, "%d dimensions, at most %d", len(shape), MaxDims)
	}
	for _, extent := range shape {
		if extent < 0 { // a contract, as the library's own refusal of one is
			return nil, 0, contract(call, "shape %v has a negative extent", shape)
		}
	}
	if len(shape) == 0 {
		return nil, 0, nil
	}
	return (*C.int64_t)(unsafe.Pointer(&shape[0])), C.int(len(shape)), nil
}

func elements(shape []int64) int64 {
	n := int64(1)
	for _, extent := range shape {
		n *= extent
	}
	return n
}

// Zeros is a compact (row-major) array of zeros, which Float32s (and Bytes) let the caller
// fill in place.
func Zeros(dtype DType, shape ...int64) (*Array, error) {
	dims, ndim, err := cShape("Zeros", shape)
	if err != nil {
		return nil, err
	}
	cdtype, err := dtype.c("Zeros")
	if err != nil {
		return nil, err
	}
	var out *C.kvsnap_array
	err = check(func() C.kvsnap_status { return C.kvsnap_array_zeros(cdtype, ndim, dims, &out) })
	return newArray(out), err
}

// c is d as the C API takes it; a value the C enum cannot hold (it would wrap to a valid one)
// is refused here, the others by the library.
func (d DType) c(call string) (C.kvsnap_dtype, error) {
	if d < 0 || d > math.MaxInt32 {
		return 0, invalid(call, "dtype %d is not F32, F16, BF16 or I32", int(d))
	}
	return C.kvsnap_dtype(d), nil
}

func fromData(call string, dtype DType, shape []int64, data unsafe.Pointer, count int) (*Array, error) {
	dims, ndim, err := cShape(call, shape)
	if err != nil {
		return nil, err
	}
	if want := elements(shape); int64(count) != want {
		return nil, invalid(call, "%d elements for shape %v, which holds %d", count, shape, want)
	}
	cdtype, err := dtype.c(call)
	if err != nil {
		return nil, err
	}
	var out *C.kvsnap_array
	err = check(func() C.kvsnap_status {
		return C.kvsnap_array_from_data(cdtype, ndim, dims, data, &out)
	})
	return newArray(out), err
}

// FromFloat32 is an f32 array of `shape` holding a copy of data (row-major).
func FromFloat32(shape []int64, data []float32) (*Array, error) {
	var p unsafe.Pointer
	if len(data) > 0 {
		p = unsafe.Pointer(&data[0])
	}
	return fromData("FromFloat32", F32, shape, p, len(data))
}

// FromInt32 is an i32 array of `shape` holding a copy of data (row-major).
func FromInt32(shape []int64, data []int32) (*Array, error) {
	var p unsafe.Pointer
	if len(data) > 0 {
		p = unsafe.Pointer(&data[0])
	}
	return fromData("FromInt32", I32, shape, p, len(data))
}

// ArrayInfo describes an array: its element type, shape, and strides in elements.
type ArrayInfo struct {
	DType   DType
	Shape   []int64
	Strides []int64
	data    unsafe.Pointer
}

// Compact says whether the elements lie in row-major order without gaps.
func (i ArrayInfo) Compact() bool {
	step := int64(1)
	for axis := len(i.Shape) - 1; axis >= 0; axis-- {
		if i.Shape[axis] != 1 && i.Strides[axis] != step {
			return false
		}
		step *= i.Shape[axis]
	}
	return true
}

// extent is the elements from [0, ..., 0] to the last one, inclusive (0 when empty).
func (i ArrayInfo) extent() int64 {
	last := int64(0)
	for axis, n := range i.Shape {
		if n == 0 {
			return 0
		}
		last += (n - 1) * i.Strides[axis]
	}
	return last + 1
}

// Info is the array's element type, shape and strides.
func (a *Array) Info() (info ArrayInfo, err error) {
	err = a.read("Array.Info", func(i ArrayInfo) error { info = i; return nil })
	return info, err
}

// read runs f with the array's description, the array read-locked (Close waits); it fails for a
// nil or closed array.
func (a *Array) read(call string, f func(ArrayInfo) error) error {
	if a == nil {
		return closedError(call, "array")
	}
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.ptr == nil {
		return closedError(call, "array")
	}
	var info C.kvsnap_array_info
	if err := check(func() C.kvsnap_status { return C.kvsnap_array_get_info(a.ptr, &info) }); err != nil {
		return err
	}
	out := ArrayInfo{DType: DType(info.dtype), Shape: make([]int64, info.ndim),
		Strides: make([]int64, info.ndim), data: info.data}
	for axis := 0; axis < int(info.ndim); axis++ {
		out.Shape[axis] = int64(info.shape[axis])
		out.Strides[axis] = int64(info.strides[axis])
	}
	return f(out)
}

// Shape is the array's extents (nil once closed).
func (a *Array) Shape() []int64 {
	info, err := a.Info()
	if err != nil {
		return nil
	}
	return info.Shape
}

// Float32s is an f32 array's memory in place, without a copy: element (i0, ..., in) is
// data[i0*strides[0] + ... + in*strides[n]]. The slice is C memory that this Array keeps: it is
// valid while the Array is open and reachable — keep a reference (or runtime.KeepAlive(a) after
// the last use), as its finalizer would otherwise close it under the slice. Write only into
// arrays the caller made (Zeros), never into a cache's views.
func (a *Array) Float32s() (data []float32, strides []int64, err error) {
	call := "Array.Float32s"
	err = a.read(call, func(info ArrayInfo) error {
		if info.DType != F32 {
			return invalid(call, "the array holds %v, not f32", info.DType)
		}
		data, strides = []float32{}, info.Strides
		if n := info.extent(); n > 0 {
			data = unsafe.Slice((*float32)(info.data), n)
		}
		return nil
	})
	return data, strides, err
}

// Bytes is a compact array's memory in place (row-major, DType.Size() bytes an element), for
// any dtype (f16, bf16 as their bits); valid while the Array is open and reachable, as for
// Float32s.
func (a *Array) Bytes() (data []byte, err error) {
	call := "Array.Bytes"
	err = a.read(call, func(info ArrayInfo) error {
		if !info.Compact() {
			return invalid(call, "the array (shape %v, strides %v) is not compact: use CopyBytes", info.Shape, info.Strides)
		}
		data = []byte{}
		if n := elements(info.Shape) * int64(info.DType.Size()); n > 0 {
			data = unsafe.Slice((*byte)(info.data), n)
		}
		return nil
	})
	return data, err
}

// copyTo copies the elements in logical row-major order into to (bytes > 0, at least the
// array's).
func (a *Array) copyTo(to unsafe.Pointer, bytes int) error {
	return check(func() C.kvsnap_status { return C.kvsnap_array_copy_to(a.ptr, to, C.size_t(bytes)) })
}

// CopyBytes copies the elements in logical row-major order into a new slice.
func (a *Array) CopyBytes() (out []byte, err error) {
	err = a.read("Array.CopyBytes", func(info ArrayInfo) error {
		out = make([]byte, elements(info.Shape)*int64(info.DType.Size()))
		if len(out) == 0 {
			return nil
		}
		return a.copyTo(unsafe.Pointer(&out[0]), len(out))
	})
	return out, err
}

// CopyFloat32s copies an f32 array's elements in logical row-major order into a new slice.
func (a *Array) CopyFloat32s() (out []float32, err error) {
	call := "Array.CopyFloat32s"
	err = a.read(call, func(info ArrayInfo) error {
		if info.DType != F32 {
			return invalid(call, "the array holds %v, not f32", info.DType)
		}
		out = make([]float32, elements(info.Shape))
		if len(out) == 0 {
			return nil
		}
		return a.copyTo(unsafe.Pointer(&out[0]), 4*len(out))
	})
	return out, err
}

// Slice is a view of [start, stop) along axis, sharing storage.
func (a *Array) Slice(axis int, start, stop int64) (*Array, error) {
	if a == nil {
		return nil, closedError("Array.Slice", "array")
	}
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.ptr == nil {
		return nil, closedError("Array.Slice", "array")
	}
	if axis < -MaxDims || axis >= MaxDims {
		return nil, contract("Array.Slice", "axis %d outside [-%d, %d)", axis, MaxDims, MaxDims)
	}
	var out *C.kvsnap_array
	err := check(func() C.kvsnap_status {
		return C.kvsnap_array_slice(a.ptr, C.int(axis), C.int64_t(start), C.int64_t(stop), &out)
	})
	return newArray(out), err
}

// SharesStorage says whether both arrays name the same buffer (false if either is closed).
func (a *Array) SharesStorage(b *Array) bool {
	if a == nil || b == nil {
		return false
	}
	for _, x := range distinct([]*Array{a, b}) {
		x.mu.RLock()
		defer x.mu.RUnlock()
	}
	return bool(C.kvsnap_array_shares_storage(a.ptr, b.ptr))
}

// Close releases the array (its memory once nothing else names it). Safe to call twice.
func (a *Array) Close() {
	if a == nil {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	C.kvsnap_array_destroy(a.ptr)
	a.ptr = nil
}

// cArrays read-locks the arrays for a call and returns their handles (nil entries stay nil).
func cArrays(call string, arrays ...*Array) ([]*C.kvsnap_array, func(), error) {
	held := distinct(arrays)
	for _, a := range held {
		a.mu.RLock()
	}
	unlock := func() {
		for _, a := range held {
			a.mu.RUnlock()
		}
	}
	ptrs := make([]*C.kvsnap_array, len(arrays))
	for i, a := range arrays {
		if a == nil {
			continue
		}
		if a.ptr == nil {
			unlock()
			return nil, nil, closedError(call, "array")
		}
		ptrs[i] = a.ptr
	}
	return ptrs, unlock, nil
}
