package kvsnap

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Lifetimes, closing and concurrency at the binding's edges (several of these began as an
// adversarial review's reproductions).

// gcUntil forces collections (finalizers run on their own goroutine) until cond holds.
func gcUntil(cond func() bool) bool {
	for i := 0; i < 50; i++ {
		if cond() {
			return true
		}
		runtime.GC()
		time.Sleep(2 * time.Millisecond)
	}
	return cond()
}

func TestForgottenObjectsAreFreedByFinalizersInAnyOrder(t *testing.T) {
	runtime.GC()
	base := LiveBytes()
	func() {
		c, _ := NewKVCache()
		h := write(t, c, 0, []int32{1, 2, 3})
		lazy, _ := c.Snapshot(0)
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		// A history and a lazy snapshot outlive their cache: the snapshot's data copied out.
		if got, err := h.Keys.CopyFloat32s(); err != nil || got[0] != key(1, 0, 0, 0) {
			t.Errorf("a history after its cache closed: %v %v", got, err)
		}
		if info, _ := lazy.Info(); info.Lazy || info.Size == 0 {
			t.Errorf("a lazy snapshot after its cache closed: %+v", info)
		}
		fresh, _ := NewKVCache()
		defer fresh.Close()
		if ok, err := fresh.Restore(lazy, 3); !ok || err != nil {
			t.Errorf("a restore from it: %v %v", ok, err)
		}
		h.Close()
		lazy.Close()
	}()
	for i := 0; i < 10; i++ { // engines, sessions, snapshots and speculations dropped unclosed
		e := newEngine(t, 2, 0)
		session, _ := e.prefix.BeginSlot(1, []int32{1, 2, 3, 4, 5})
		e.forward(t, 1, []int32{1, 2, 3, 4, 5}, 0)
		if err := session.PrefillDone(); err != nil {
			t.Fatal(err)
		}
		if _, err := e.attention.Seq(1).Snapshot(0); err != nil {
			t.Fatal(err)
		}
		if _, err := NewSpeculation([]*Cache{e.attention}, 0); err != nil {
			t.Fatal(err)
		}
		runtime.GC()
	}
	if !gcUntil(func() bool { return LiveBytes() == base }) {
		t.Fatalf("LiveBytes %d once every object was dropped, was %d", LiveBytes(), base)
	}
}

func TestSessionsOutliveTheirPrefixCache(t *testing.T) {
	layer, _ := NewKVCache()
	p, _ := NewPrefixCache([]*Cache{layer}, nil)
	closed, err := p.Begin([]int32{1, 2, 3})
	if err != nil {
		t.Fatal(err)
	}
	if slot, err := closed.Slot(); slot != 0 || err != nil {
		t.Fatalf("slot %d, %v", slot, err)
	}
	if err := closed.Close(); err != nil {
		t.Fatal(err)
	}
	open, err := p.Begin([]int32{1, 2, 3})
	if err != nil {
		t.Fatal(err)
	}
	p.Close()
	if _, err := open.Cached(); !errors.Is(err, ErrContract) || !strings.Contains(err.Error(), "was destroyed") {
		t.Fatalf("an open session after its prefix cache closed: %v", err)
	}
	if err := open.Close(); err != nil {
		t.Fatalf("closing a detached session: %v", err)
	}
	if err := closed.AppendOutput(1); !errors.Is(err, ErrClosed) {
		t.Fatalf("a closed session: %v", err)
	}
	if err := layer.Close(); err != nil {
		t.Fatal(err)
	}
}

// Sessions busy on four slots while the prefix cache closes under them: Close waits for the
// calls in flight, later calls fail. (Before sessions took the prefix cache's lock, this hung:
// the C++ cache freed the mutex a session call held.)
func TestClosingAPrefixCacheUnderBusySessions(t *testing.T) {
	prompt := make([]int32, 64)
	for i := range prompt {
		prompt[i] = int32(i)
	}
	for iteration := 0; iteration < 30; iteration++ {
		layers := make([]*Cache, 4)
		for i := range layers {
			layers[i], _ = NewPagedKVCache(4)
		}
		p, err := NewPrefixCache(layers, &PrefixOptions{Slots: 4})
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		var begun atomic.Int32
		for slot := int32(0); slot < 4; slot++ {
			wg.Add(1)
			go func(slot int32) {
				defer wg.Done()
				for r := 0; r < 50; r++ {
					s, err := p.BeginSlot(slot, prompt)
					if err != nil {
						return // closed
					}
					begun.Add(1)
					for i := 0; i < 10; i++ {
						s.Cached()
						s.Remaining()
					}
					s.PrefillDone()
					s.Close()
				}
			}(slot)
		}
		for begun.Load() < int32(iteration%8+1) {
			runtime.Gosched()
		}
		p.Close()
		wg.Wait()
		for _, c := range layers {
			if err := c.Close(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// Sessions that only begin and close (paging out) while the prefix cache closes: its Close
// waits for each page-out in flight.
func TestClosingAPrefixCacheUnderClosingSessions(t *testing.T) {
	prompt := make([]int32, 48)
	for i := range prompt {
		prompt[i] = int32(i % 7)
	}
	for iteration := 0; iteration < 60; iteration++ {
		layer, _ := NewPagedKVCache(4)
		p, _ := NewPrefixCache([]*Cache{layer}, &PrefixOptions{Slots: 4})
		var wg sync.WaitGroup
		var closes atomic.Int32
		for slot := int32(0); slot < 4; slot++ {
			wg.Add(1)
			go func(slot int32) {
				defer wg.Done()
				for {
					s, err := p.BeginSlot(slot, prompt[:8+slot])
					if err != nil {
						return // closed
					}
					s.Close()
					closes.Add(1)
				}
			}(slot)
		}
		for closes.Load() < int32(iteration%16+1) {
			runtime.Gosched()
		}
		p.Close()
		wg.Wait()
		if err := layer.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// A cache closed while a prefix cache is being made over it: exactly one of the two wins.
func TestClosingACacheRacesWithBorrowingIt(t *testing.T) {
	for iteration := 0; iteration < 20000; iteration++ {
		c, _ := NewKVCache()
		var p *PrefixCache
		var perr, cerr error
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); p, perr = NewPrefixCache([]*Cache{c}, nil) }()
		go func() { defer wg.Done(); cerr = c.Close() }()
		wg.Wait()
		if (perr == nil) == (cerr == nil) {
			t.Fatalf("iteration %d: NewPrefixCache %v, Cache.Close %v: exactly one must succeed", iteration, perr, cerr)
		}
		p.Close()
		c.Close()
	}
}

func TestErrorsFromManyGoroutinesKeepTheirOwnMessages(t *testing.T) {
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			c, _ := NewKVCache()
			defer c.Close()
			k, _ := Zeros(F32, 1, 1, 1, 2)
			defer k.Close()
			for i := 0; i < 200; i++ {
				offset := int32(g*1000 + i + 1)
				err := c.Append(&Batch{Rows: 1, Length: 1, Offsets: []int32{offset}}, k, k)
				if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("starts at %d ", offset)) {
					t.Errorf("goroutine %d: %v", g, err)
					return
				}
			}
		}(g)
	}
	wg.Wait()
}

func TestNilAndEmptyArrays(t *testing.T) {
	var a *Array
	if _, err := a.Info(); !errors.Is(err, ErrClosed) {
		t.Errorf("Info of nil: %v", err)
	}
	if _, _, err := a.Float32s(); !errors.Is(err, ErrClosed) {
		t.Errorf("Float32s of nil: %v", err)
	}
	if _, err := a.Slice(0, 0, 0); !errors.Is(err, ErrClosed) {
		t.Errorf("Slice of nil: %v", err)
	}
	if a.Shape() != nil {
		t.Error("Shape of nil")
	}
	if _, err := a.Bytes(); !errors.Is(err, ErrClosed) {
		t.Errorf("Bytes of nil: %v", err)
	}
	if _, err := a.CopyBytes(); !errors.Is(err, ErrClosed) {
		t.Errorf("CopyBytes of nil: %v", err)
	}
	if _, err := a.CopyFloat32s(); !errors.Is(err, ErrClosed) {
		t.Errorf("CopyFloat32s of nil: %v", err)
	}
	a.Close()

	scalar, _ := Zeros(F32)
	defer scalar.Close()
	d, _, err := scalar.Float32s()
	b, _ := scalar.Bytes()
	c, _ := scalar.CopyFloat32s()
	if len(d) != 1 || len(b) != 4 || len(c) != 1 || err != nil {
		t.Errorf("a 0-d array: %d %d %d %v", len(d), len(b), len(c), err)
	}
	empty, _ := Zeros(F32, 0, 3)
	defer empty.Close()
	d, _, err = empty.Float32s()
	raw, err2 := empty.CopyBytes()
	if len(d) != 0 || len(raw) != 0 || err != nil || err2 != nil {
		t.Errorf("an empty array: %v %v %v %v", d, raw, err, err2)
	}
	m, _ := FromFloat32([]int64{3, 4}, []float32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11})
	defer m.Close()
	column, _ := m.Slice(1, 3, 4) // [3, 1], strides [4, 1]
	defer column.Close()
	d, strides, _ := column.Float32s()
	if len(d) != 9 || d[0] != 3 || d[2*strides[0]] != 11 {
		t.Errorf("a strided view: %d elements, strides %v", len(d), strides)
	}
	raw, err = column.CopyBytes()
	if err != nil || len(raw) != 12 {
		t.Errorf("CopyBytes of the view: %d bytes, %v", len(raw), err)
	}
	if _, err := FromFloat32([]int64{1 << 32, 1 << 32}, nil); err == nil {
		t.Error("a shape whose element count overflows was accepted")
	}
}

func TestMergeAndSplitRefuseConsumedSnapshots(t *testing.T) {
	c, _ := NewKVCache()
	defer c.Close()
	write(t, c, 0, []int32{1, 2, 3, 4}).Close()
	whole, _ := c.Snapshot(0)
	first, second, err := c.Split(whole, 2)
	if err != nil {
		t.Fatal(err)
	}
	merged, err := c.Merge(first, second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Merge(first, merged); !errors.Is(err, ErrClosed) {
		t.Fatalf("a merge of a consumed snapshot: %v", err)
	}
	if _, err := merged.Info(); !errors.Is(err, ErrClosed) {
		t.Fatalf("the other input is consumed too: %v", err)
	}
	if _, _, err := c.Split(second, 1); !errors.Is(err, ErrClosed) {
		t.Fatalf("a split of a consumed snapshot: %v", err)
	}
	tail, _ := c.Snapshot(2)
	if m, err := c.Merge(nil, tail); m != nil || err != nil {
		t.Fatalf("nil in, nil out (as in C): %v %v", m, err)
	}
}

func TestScheduledCapturesAndListsPastTheFirstBuffer(t *testing.T) {
	c, _ := NewKVCache()
	defer c.Close()
	if err := c.PrepareSnapshots(0, 2, 4); err != nil {
		t.Fatal(err)
	}
	write(t, c, 0, []int32{1, 2, 3}).Close()
	if _, err := c.TakeSnapshots(); !errors.Is(err, ErrContract) {
		t.Errorf("take with offset 4 unreached: %v", err)
	}
	reached, err := c.TakeReachedSnapshots()
	if err != nil || len(reached) != 2 || reached[0] != nil {
		t.Fatalf("reached: %v %v (want a nil zero-width edge, then [0, 2))", reached, err)
	}
	if info, _ := reached[1].Info(); info.From != 0 || info.To != 2 {
		t.Errorf("reached[1] %+v", info)
	}
	reached[1].Close()
	if err := c.PrepareSnapshots(1); !errors.Is(err, ErrContract) {
		t.Errorf("a capture behind the offset: %v", err)
	}
	if err := c.PrepareSnapshots(5); err != nil {
		t.Fatal(err)
	}
	if err := c.CancelSnapshots(); err != nil {
		t.Fatal(err)
	}
	write(t, c, 0, []int32{4, 5}).Close()
	if got, err := c.TakeSnapshots(); err != nil || len(got) != 0 {
		t.Errorf("after cancel: %v %v", got, err)
	}

	r, _ := NewRecurrentCache(RecurrentOptions{1, 1, 1, 1, 1})
	defer r.Close()
	var at []int64
	for i := int64(1); i <= 20; i++ {
		at = append(at, i)
	}
	if err := r.PrepareSnapshots(at...); err != nil {
		t.Fatal(err)
	}
	if splits, err := r.SnapshotSplits(30); err != nil || len(splits) != 20 {
		t.Errorf("20 split points: %v %v", splits, err)
	}
	p, _ := NewPagedKVCache(2)
	defer p.Close()
	for s := int32(0); s < 20; s++ {
		write(t, p, s, []int32{1}).Close()
	}
	if seqs, err := p.Sequences(); err != nil || len(seqs) != 20 {
		t.Errorf("20 sequences: %v %v", seqs, err)
	}
}
