package kvsnap

import (
	"errors"
	"strings"
	"testing"
)

func TestZerosAreFilledInPlaceAndCopiedOutInOrder(t *testing.T) {
	before := LiveBytes()
	a, err := Zeros(F32, 2, 3)
	if err != nil {
		t.Fatal(err)
	}
	if got := LiveBytes() - before; got != 24 {
		t.Fatalf("LiveBytes grew by %d, want 24", got)
	}
	data, strides, err := a.Float32s()
	if err != nil {
		t.Fatal(err)
	}
	if len(data) != 6 || strides[0] != 3 || strides[1] != 1 {
		t.Fatalf("Float32s: %d elements, strides %v", len(data), strides)
	}
	for i := range data {
		data[i] = float32(i)
	}
	column, err := a.Slice(1, 1, 2) // [2, 1]: elements 1 and 4, sharing storage
	if err != nil {
		t.Fatal(err)
	}
	defer column.Close()
	if !column.SharesStorage(a) {
		t.Fatal("a slice does not share its array's storage")
	}
	info, _ := column.Info()
	if info.Compact() || info.Shape[0] != 2 || info.Shape[1] != 1 {
		t.Fatalf("slice info %+v", info)
	}
	got, err := column.CopyFloat32s()
	if err != nil || len(got) != 2 || got[0] != 1 || got[1] != 4 {
		t.Fatalf("CopyFloat32s of the slice = %v, %v; want [1 4]", got, err)
	}
	if _, err := column.Bytes(); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "not compact") {
		t.Fatalf("Bytes of a strided view: %v", err)
	}
	a.Close()
	a.Close() // twice is fine
	if _, _, err := a.Float32s(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Float32s after Close: %v, want ErrClosed", err)
	}
	// The slice still names the storage: it lives until the slice is closed too.
	if got, _ := column.CopyFloat32s(); got[1] != 4 {
		t.Fatalf("the slice lost its storage: %v", got)
	}
	column.Close()
	if LiveBytes() != before {
		t.Fatalf("LiveBytes %d after closing everything, was %d", LiveBytes(), before)
	}
}

func TestArraysRefuseWrongData(t *testing.T) {
	if _, err := FromFloat32([]int64{2, 2}, []float32{1, 2, 3}); !errors.Is(err, ErrInvalidArgument) ||
		err.Error() != "kvsnap.FromFloat32: 3 elements for shape [2 2], which holds 4" {
		t.Fatalf("short data: %v", err)
	}
	// A negative extent is the library's contract, whichever call brings it.
	for name, make := range map[string]func() (*Array, error){
		"Zeros":       func() (*Array, error) { return Zeros(F32, 2, -1) },
		"FromFloat32": func() (*Array, error) { return FromFloat32([]int64{2, -1}, []float32{1, 2}) },
		"FromInt32":   func() (*Array, error) { return FromInt32([]int64{-2}, nil) },
	} {
		if _, err := make(); !errors.Is(err, ErrContract) || !strings.HasPrefix(err.Error(), "kvsnap."+name+": shape [") ||
			!strings.HasSuffix(err.Error(), "] has a negative extent") {
			t.Fatalf("%s with a negative extent: %v", name, err)
		}
	}
	if _, err := Zeros(F32, 1, 1, 1, 1, 1); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("five dimensions: %v", err)
	}
	if _, err := Zeros(DType(9), 2); !errors.Is(err, ErrInvalidArgument) || !strings.HasPrefix(err.Error(), "kvsnap_array_zeros") {
		t.Fatalf("unknown dtype: %v", err)
	}
	// Beyond the C enum's range: it would wrap to F32 (1<<32) or F16 (1<<32 | 1), not refused.
	if _, err := Zeros(DType(1)<<32, 2); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "dtype") {
		t.Fatalf("a dtype beyond int32: %v", err)
	}
	ints, err := FromInt32([]int64{3}, []int32{7, 8, 9})
	if err != nil {
		t.Fatal(err)
	}
	defer ints.Close()
	if _, _, err := ints.Float32s(); err == nil || err.Error() != "kvsnap.Array.Float32s: the array holds i32, not f32" {
		t.Fatalf("Float32s of i32: %v", err)
	}
	raw, err := ints.Bytes()
	if err != nil || len(raw) != 12 || raw[4] != 8 {
		t.Fatalf("Bytes of i32 = %v, %v", raw, err)
	}
	if _, err := ints.Slice(0, 2, 5); !errors.Is(err, ErrContract) {
		t.Fatalf("slice past the end: %v", err)
	}
}
