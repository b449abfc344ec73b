package kvsnap

/*
#include <stdint.h>
*/
import "C"

import "runtime/cgo"

// kvsnapGoTierLog is a Tier's log callback, called by the C tier from any thread (its writer
// thread too) with the handle of its tierLog.
//
//export kvsnapGoTierLog
func kvsnapGoTierLog(handle C.uintptr_t, line *C.char) {
	cgo.Handle(handle).Value().(*tierLog).f(C.GoString(line))
}
