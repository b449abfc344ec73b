// Package kvsnap is the Go binding of kvsnap, a library that owns a language model's per-layer
// inference state — attention KV caches (contiguous, sliding-window and paged), recurrent
// SSM / gated-delta state — and makes it cheap to snapshot, rewind, branch and reuse across
// requests through a prefix cache.
//
// It calls the C API (kvsnap_c.h) through cgo: build with the library's headers and shared
// library where the C compiler and linker find them (an installed kvsnap needs nothing more;
// an in-tree build sets CGO_CFLAGS to its include folders and CGO_LDFLAGS to -L of libkvsnap.so).
//
// Every call that can fail returns an error of type *Error, whose message is the library's
// (what call, what values, what rule); on failure the objects involved are unchanged, as in C
// (with C's exceptions: a session's begin or close that runs out of memory ends it; after a
// failed PrefillDone, close it), unless the error's Applied is true: the call's change took
// place and only handing its result to Go failed (out of memory) — Update and UpdateRows wrote
// the batch, TakeSnapshots and TakeReachedSnapshots took the captures, which are lost.
// Objects hold C memory: Close them when done (a finalizer frees what is forgotten, later).
//
// Goroutines: caches and prefix caches may be used from several goroutines at once (the library
// locks them), as may an Array (its calls only read it); a Session, a Snapshot and a
// Speculation from one goroutine at a time. A call that locks several objects locks them in
// one global order. Close waits for calls in flight on
// the same object (a PrefixCache's also for its sessions') and makes later calls fail with
// ErrClosed. Arrays a cache hands out are live views of its buffers: read them before the next
// write to that cache, which the race detector cannot check, as it is C memory.
package kvsnap

/*
#cgo LDFLAGS: -lkvsnap
#include <kvsnap/kvsnap_c.h>
*/
import "C"

import (
	"fmt"
	"runtime"
	"strings"
	"unsafe"
)

// Status says what kind of failure an Error is (kvsnap_status).
type Status int

const (
	// StatusContract: the library's rules refused the call (kvsnap::Error: a contract
	// violation or bad data).
	StatusContract Status = C.KVSNAP_ERROR
	// StatusInvalidArgument: a missing object, an unknown enum value, the wrong cache kind, a
	// Go value of the wrong length.
	StatusInvalidArgument Status = C.KVSNAP_INVALID_ARGUMENT
	// StatusOutOfMemory: an allocation failed.
	StatusOutOfMemory Status = C.KVSNAP_OUT_OF_MEMORY
	// StatusInternal: any other failure, a bug in kvsnap.
	StatusInternal Status = C.KVSNAP_INTERNAL_ERROR
	// StatusClosed: the object was closed (a Go-side status; the C API has no such handle).
	StatusClosed Status = -1
)

func (s Status) String() string {
	switch s {
	case StatusContract:
		return "contract"
	case StatusInvalidArgument:
		return "invalid argument"
	case StatusOutOfMemory:
		return "out of memory"
	case StatusInternal:
		return "internal"
	case StatusClosed:
		return "closed"
	}
	return fmt.Sprintf("status %d", int(s))
}

// Error is a failed call: its Status and the library's message, which names the call, the
// values and the rule.
type Error struct {
	Status  Status
	Message string
	// Applied: the call changed what it was to change before it failed (see the package doc);
	// do not repeat it.
	Applied bool
}

func (e *Error) Error() string { return e.Message }

// Is matches the sentinels below by Status: errors.Is(err, kvsnap.ErrContract).
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Message == "" && t.Status == e.Status
}

// Sentinels for errors.Is, one per Status.
var (
	ErrContract        = &Error{Status: StatusContract}
	ErrInvalidArgument = &Error{Status: StatusInvalidArgument}
	ErrOutOfMemory     = &Error{Status: StatusOutOfMemory}
	ErrInternal        = &Error{Status: StatusInternal}
	ErrClosed          = &Error{Status: StatusClosed}
)

// check runs one C call and turns a failed status into an *Error. The C API keeps the last
// error per thread, so the call and the read of its message stay on one OS thread.
func check(call func() C.kvsnap_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if status := call(); status != C.KVSNAP_OK {
		return &Error{Status: Status(status), Message: C.GoString(C.kvsnap_last_error())}
	}
	return nil
}

// handOut runs a C call that hands a finished call's result to Go (a history's arrays, a taken
// snapshot): check, unless a test has set failHandOut to make it fail as running out of memory
// would (the only way these fail), to check what the calls around it report.
func handOut(call string, f func() C.kvsnap_status) error {
	if failHandOut != nil {
		if err := failHandOut(call); err != nil {
			return err
		}
	}
	return check(f)
}

// failHandOut is nil outside tests.
var failHandOut func(call string) error

// applied marks err (from handing a call's result to Go) as failing after the call's change
// took place, saying what took place.
func applied(err error, what string) error {
	e, ok := err.(*Error)
	if !ok {
		return err
	}
	return &Error{Status: e.Status, Message: e.Message + " (" + what + ")", Applied: true}
}

func closedError(call, what string) error {
	return &Error{Status: StatusClosed, Message: fmt.Sprintf("kvsnap.%s: the %s is closed", call, what)}
}

// cString is s for the C API, which reads a string up to its first NUL: one holding a NUL
// (a model id of raw bytes, a path) would reach it cut short — a trie saved for one model
// loading for another — so it is refused. The caller frees the result.
func cString(call, what, s string) (*C.char, error) {
	if strings.IndexByte(s, 0) >= 0 {
		return nil, invalid(call, "the %s %q holds a NUL byte, which the C API cannot pass", what, s)
	}
	return C.CString(s), nil
}

func invalid(call, format string, args ...any) error {
	return &Error{Status: StatusInvalidArgument,
		Message: fmt.Sprintf("kvsnap.%s: %s", call, fmt.Sprintf(format, args...))}
}

// contract is a value the library would refuse too (an axis, a count out of its range), refused
// here because C cannot hold it: the same sentinel (ErrContract) as the library's refusal.
func contract(call, format string, args ...any) error {
	return &Error{Status: StatusContract,
		Message: fmt.Sprintf("kvsnap.%s: %s", call, fmt.Sprintf(format, args...))}
}

// LiveBytes is the bytes held by all live kvsnap-allocated arrays (kvsnap_live_bytes).
func LiveBytes() int64 { return int64(C.kvsnap_live_bytes()) }

// distinct is the objects a call locks: items without nils or repeats (a read lock taken twice
// can deadlock against a Close waiting between the two), in the order of their addresses, so
// every call takes several locks in one global order (Go's heap objects never move).
func distinct[T any](items []*T) []*T {
	out := make([]*T, 0, len(items))
	for _, item := range items {
		if item == nil {
			continue
		}
		at := len(out) // insertion by address: a call names a handful of objects
		for at > 0 && uintptr(unsafe.Pointer(out[at-1])) > uintptr(unsafe.Pointer(item)) {
			at--
		}
		if at > 0 && out[at-1] == item {
			continue
		}
		out = append(out, nil)
		copy(out[at+1:], out[at:])
		out[at] = item
	}
	return out
}
