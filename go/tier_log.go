package kvsnap

/*
#include <stdint.h>
*/
import "C"

import "runtime/cgo"

// kvsnapGoTierLog is a Tier's log callback, called by the C tier from any thread (its writer
// thread too) with the handle of its tierLog; a panic in TierOptions.Log loses its line only.
//
//export kvsnapGoTierLog
func kvsnapGoTierLog(handle C.uintptr_t, line *C.char) {
	// A panic would cross the C++ frames that called it and end the process: that line is lost.
	defer func() { _ = recover() }()
	cgo.Handle(handle).Value().(*tierLog).f(C.GoString(line))
}
