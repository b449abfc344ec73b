package kvsnap

/*
#include <kvsnap/kvsnap_c.h>
*/
import "C"

import (
	"runtime"
	"sync"
)

// SpeculationStats count a speculation's rounds.
type SpeculationStats struct {
	Rounds   int64 // accepted rounds
	Drafted  int64 // draft tokens verified
	Accepted int64 // of them, confirmed
	Restores int64 // layer restores from a capture
	Rewinds  int64 // layer offset rewinds
}

// Speculation rolls a verified chunk back exactly, for every cache kind: Begin(k) before the
// verify forward of the last accepted token and k drafts, Accept(a) after it; every layer then
// stands at start + a + 1, attention layers rewound, whole-state layers restored from captures
// the forward took. Use it from one goroutine at a time.
type Speculation struct {
	mu     sync.Mutex
	ptr    *C.kvsnap_speculation
	layers []*Cache
}

// NewSpeculation drives rounds over sequence seq of the layers (a nil entry is a stateless
// layer; a cache listed twice is one state, rolled back once), which cannot be closed until the
// speculation is. It fails for seq outside [0, 2^20).
func NewSpeculation(layers []*Cache, seq int32) (*Speculation, error) {
	ptrs, release, err := borrow("NewSpeculation", layers)
	if err != nil {
		return nil, err
	}
	var out *C.kvsnap_speculation
	err = check(func() C.kvsnap_status {
		return C.kvsnap_speculation_create(&ptrs[0], C.size_t(len(layers)), C.int32_t(seq), &out)
	})
	if err != nil {
		release(true)
		return nil, err
	}
	release(false)
	s := &Speculation{ptr: out, layers: append([]*Cache{}, layers...)}
	runtime.SetFinalizer(s, (*Speculation).Close)
	return s, nil
}

// Close cancels an open round (its captures dropped, the layers left where they are) and frees
// the speculation. Safe to call twice.
func (s *Speculation) Close() {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return
	}
	C.kvsnap_speculation_destroy(s.ptr)
	s.ptr = nil
	unborrow(s.layers)
	s.layers = nil
}

func (s *Speculation) use(call string, f func(*C.kvsnap_speculation) error) error {
	if s == nil {
		return closedError(call, "speculation")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return closedError(call, "speculation")
	}
	return f(s.ptr)
}

// Begin opens a round of drafts drafts at the layers' common offset. Fails, changing nothing,
// for drafts < 0 or > 2^20, a round ending past position 2^31 - 1, an open round, layers that
// disagree on their offset, or a layer of any kind with captures already scheduled for the
// sequence.
func (s *Speculation) Begin(drafts int64) error {
	return s.use("Speculation.Begin", func(p *C.kvsnap_speculation) error {
		return check(func() C.kvsnap_status { return C.kvsnap_speculation_begin(p, C.int64_t(drafts)) })
	})
}

// Accept closes the round: the first accepted drafts were confirmed. Every layer is checked
// before any moves: fails, the round left open and nothing changed, unless 0 <= accepted <=
// drafts, every layer stands at the verify forward's end, and every layer that must move can —
// one that rewinds has no schedule (someone else's: take or cancel it, then accept again), a
// capturing one still holds the round's captures (taken or replaced by another call on the
// sequence, they are gone: only Cancel ends the round then). Out of memory (ErrOutOfMemory)
// restoring a window may have moved some whole-state layers: Accept again with the same count
// (it moves the others only), or Cancel and reset the sequence.
func (s *Speculation) Accept(accepted int64) error {
	return s.use("Speculation.Accept", func(p *C.kvsnap_speculation) error {
		return check(func() C.kvsnap_status { return C.kvsnap_speculation_accept(p, C.int64_t(accepted)) })
	})
}

// Cancel drops an open round's captures without moving any layer (a schedule that replaced the
// round's is someone else's and stays).
func (s *Speculation) Cancel() error {
	return s.use("Speculation.Cancel", func(p *C.kvsnap_speculation) error {
		return check(func() C.kvsnap_status { return C.kvsnap_speculation_cancel(p) })
	})
}

// Round says whether a round is open, and its start offset and draft count (once it closed,
// the last round's; 0 before any).
func (s *Speculation) Round() (open bool, start, drafts int64, err error) {
	var o C.bool
	var st, d C.int64_t
	err = s.use("Speculation.Round", func(p *C.kvsnap_speculation) error {
		return check(func() C.kvsnap_status { return C.kvsnap_speculation_get_round(p, &o, &st, &d) })
	})
	return bool(o), int64(st), int64(d), err
}

// Stats counts the speculation's rounds.
func (s *Speculation) Stats() (SpeculationStats, error) {
	var st C.kvsnap_speculation_stats
	err := s.use("Speculation.Stats", func(p *C.kvsnap_speculation) error {
		return check(func() C.kvsnap_status { return C.kvsnap_speculation_get_stats(p, &st) })
	})
	return SpeculationStats{int64(st.rounds), int64(st.drafted), int64(st.accepted), int64(st.restores), int64(st.rewinds)}, err
}
