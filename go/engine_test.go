package kvsnap

import (
	"errors"
	"fmt"
	"math/rand"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// A toy engine over the three layer kinds a hybrid model has — paged attention, a recurrent
// layer and a sliding window — driven through a PrefixCache as a serving engine drives it.
// Every forward checks what the caches hand it against recomputation from the sequence's full
// token history: the attention histories column by column, the recurrent state exactly.

const convTail, window = 2, 5

type engine struct {
	attention, recurrent, windowed *Cache
	prefix                         *PrefixCache
}

func newEngine(t testing.TB, slots int32, budget int64) *engine {
	t.Helper()
	attention, err := NewPagedKVCache(4)
	if err != nil {
		t.Fatal(err)
	}
	recurrent, err := NewRecurrentCache(RecurrentOptions{ConvTail: convTail, ConvDim: 2, NumVHeads: 1, HeadVDim: 1, HeadKDim: 1})
	if err != nil {
		t.Fatal(err)
	}
	windowed, err := NewRotatingKVCache(window)
	if err != nil {
		t.Fatal(err)
	}
	prefix, err := NewPrefixCache([]*Cache{attention, nil, recurrent, windowed}, &PrefixOptions{Slots: slots, MaxPagedOutBytes: budget})
	if err != nil {
		t.Fatal(err)
	}
	return &engine{attention, recurrent, windowed, prefix}
}

func (e *engine) close(t testing.TB) {
	e.prefix.Close()
	for _, c := range []*Cache{e.attention, e.recurrent, e.windowed} {
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// convInput is the recurrent layer's input row for position pos of toks (zeros before 0).
func convInput(toks []int32, pos int64) [2]float32 {
	if pos < 0 {
		return [2]float32{}
	}
	return [2]float32{float32(toks[pos]), float32(pos)}
}

// memory after toks[:n]: halved, plus each token in turn — order-dependent and rounded, so a
// state restored from the wrong point, or twice applied, differs.
func memoryAfter(toks []int32, n int64) float32 {
	m := float32(0)
	for _, tok := range toks[:n] {
		m = m*0.5 + float32(tok)/3
	}
	return m
}

// forward evaluates toks[offset:] of slot's sequence (toks: its whole history) in all layers.
func (e *engine) forward(t testing.TB, slot int32, toks []int32, offset int64) {
	t.Helper()
	chunk := toks[offset:]
	length := int64(len(chunk))
	batch := SingleBatch(chunk, offset)
	batch.SeqIDs = []int32{slot}
	for _, c := range []*Cache{e.attention, e.windowed} {
		keys, values := kv(t, chunk, offset, 1), kv(t, chunk, offset, -1)
		h, err := c.Update(batch, keys, values)
		keys.Close()
		values.Close()
		if err != nil {
			t.Fatalf("slot %d, %v update at %d: %v", slot, c.Kind(), offset, err)
		}
		checkHistory(t, h, toks, offset+length)
		h.Close()
	}

	splits, err := e.recurrent.Seq(slot).SnapshotSplits(length)
	if err != nil {
		t.Fatal(err)
	}
	conv, delta, err := e.recurrent.RecurrentGet(batch, F32)
	if err != nil {
		t.Fatal(err)
	}
	convData, convStrides, _ := conv.Float32s()
	for i := int64(0); i < convTail; i++ {
		want := convInput(toks, offset-convTail+i)
		for d := int64(0); d < 2; d++ {
			if got := convData[i*convStrides[1]+d*convStrides[2]]; got != want[d] {
				t.Fatalf("slot %d at %d: conv state row %d = %v, want %v", slot, offset, i, got, want[d])
			}
		}
	}
	deltaData, _, _ := delta.Float32s()
	if want := memoryAfter(toks, offset); deltaData[0] != want {
		t.Fatalf("slot %d at %d: recurrent memory %v, recomputed %v", slot, offset, deltaData[0], want)
	}
	conv.Close()
	delta.Close()
	var convs, deltas []*Array
	for _, b := range append(splits, length) {
		at := offset + b
		rows := make([]float32, 0, 2*convTail)
		for i := int64(0); i < convTail; i++ {
			in := convInput(toks, at-convTail+i)
			rows = append(rows, in[:]...)
		}
		c, _ := FromFloat32([]int64{1, convTail, 2}, rows)
		d, _ := FromFloat32([]int64{1, 1, 1, 1}, []float32{memoryAfter(toks, at)})
		convs, deltas = append(convs, c), append(deltas, d)
	}
	if err := e.recurrent.RecurrentPut(batch, convs, deltas); err != nil {
		t.Fatal(err)
	}
	for i := range convs {
		convs[i].Close()
		deltas[i].Close()
	}
}

// serve runs one request on slot: restore, prefill the rest, generate `replies` tokens (each
// fed back but the last), close. Returns the tokens restored and the reply.
func (e *engine) serve(t testing.TB, slot int32, prompt []int32, replies int, rng *rand.Rand) (int64, []int32) {
	t.Helper()
	session, err := e.prefix.BeginSlot(slot, prompt)
	if err != nil {
		t.Fatal(err)
	}
	defer session.Close()
	cached, _ := session.Cached()
	remaining, _ := session.Remaining()
	if int64(len(remaining))+cached != int64(len(prompt)) {
		t.Fatalf("cached %d + remaining %d != prompt %d", cached, len(remaining), len(prompt))
	}
	if int64(len(prompt)) > cached+1 && rng.Intn(2) == 0 { // a restore point of the caller's own
		at := cached + 1 + rng.Int63n(int64(len(prompt))-cached-1)
		schedule := session.ScheduleSnapshots
		if rng.Intn(2) == 0 { // a guess: an ordinary node, not a user one
			schedule = session.ScheduleBranchPoints
		}
		if err := schedule(at); err != nil {
			t.Fatal(err)
		}
	}
	toks := append([]int32{}, prompt...)
	e.forward(t, slot, toks, cached)
	if err := session.PrefillDone(); err != nil {
		t.Fatal(err)
	}
	var reply []int32
	for i := 0; i < replies; i++ {
		tok := int32(rng.Intn(50))
		reply = append(reply, tok)
		if err := session.AppendOutput(tok); err != nil {
			t.Fatal(err)
		}
		if i+1 < replies {
			toks = append(toks, tok)
			e.forward(t, slot, toks, int64(len(toks)-1))
		}
	}
	if err := session.Close(); err != nil {
		t.Fatal(err)
	}
	return cached, reply
}

// conversation: a system prompt shared by all users, then turns that continue the last one.
type conversation struct{ history []int32 }

func (c *conversation) next(system []int32, rng *rand.Rand) []int32 {
	if c.history == nil {
		c.history = append([]int32{}, system...)
	}
	turn := make([]int32, 1+rng.Intn(6))
	for i := range turn {
		turn[i] = int32(rng.Intn(50))
	}
	return append(append([]int32{}, c.history...), turn...)
}

func TestSessionsEqualRecomputationOverRandomConversations(t *testing.T) {
	for _, budget := range []int64{0, 2048} { // the default budget, and one that evicts
		t.Run(fmt.Sprintf("budget %d", budget), func(t *testing.T) {
			runtime.GC()
			base := LiveBytes()
			e := newEngine(t, 3, budget)
			defer func() {
				e.close(t)
				if !gcUntil(func() bool { return LiveBytes() == base }) {
					t.Errorf("LiveBytes %d after closing the engine, was %d", LiveBytes(), base)
				}
			}()
			rng := rand.New(rand.NewSource(7))
			system := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}
			users := make([]conversation, 5)
			reused := int64(0)
			for request := 0; request < 60; request++ {
				u := &users[rng.Intn(len(users))]
				prompt := u.next(system, rng)
				if rng.Intn(5) == 0 && len(u.history) > 0 { // a regeneration: the same prompt again
					prompt = append([]int32{}, u.history...)
				}
				cached, reply := e.serve(t, int32(rng.Intn(3)), prompt, 1+rng.Intn(4), rng)
				reused += cached
				u.history = append(prompt, reply...)
				if err := e.prefix.Check(); err != nil {
					t.Fatal(err)
				}
			}
			stats, _ := e.prefix.Stats()
			if stats.Lookups != 60 || stats.ReusedTokens != reused || reused == 0 {
				t.Fatalf("stats %+v, reused %d", stats, reused)
			}
			if budget > 0 && (stats.EvictedNodes == 0 || stats.PagedOutBytes > budget+1024) {
				t.Fatalf("a %d-byte budget: %+v", budget, stats)
			}
		})
	}
}

func TestMatchChangesNothingAndSlotsRestoreFromEachOther(t *testing.T) {
	e := newEngine(t, 2, 0)
	defer e.close(t)
	rng := rand.New(rand.NewSource(1))
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	if cached, _ := e.serve(t, 0, prompt, 2, rng); cached != 0 {
		t.Fatalf("a first request restored %d tokens", cached)
	}
	// A hybrid model restores where whole states were captured: one is just before the prompt's
	// last token (which a request evaluates for its logits).
	followUp := append(append([]int32{}, prompt...), 40, 41)
	before, _ := e.prefix.Stats()
	match, err := e.prefix.Match(1, followUp)
	if err != nil || match != int64(len(prompt))-1 {
		t.Fatalf("match on slot 1: %d %v, want %d", match, err, len(prompt)-1)
	}
	after, _ := e.prefix.Stats()
	if after != before {
		t.Fatalf("Match changed the stats: %+v -> %+v", before, after)
	}
	if cached, _ := e.serve(t, 1, followUp, 1, rng); cached != match {
		t.Fatalf("slot 1 restored %d tokens, Match said %d", cached, match)
	}
	session, err := e.prefix.BeginSlot(0, prompt)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.prefix.BeginSlot(0, prompt); !errors.Is(err, ErrContract) {
		t.Fatalf("a second session on a busy slot: %v", err)
	}
	if err := session.RetractOutputs(1); !errors.Is(err, ErrContract) {
		t.Fatalf("retracting before decoding: %v", err)
	}
	if err := session.Close(); err != nil {
		t.Fatal(err)
	}
	if err := session.PrefillDone(); !errors.Is(err, ErrClosed) {
		t.Fatalf("a call after Close: %v", err)
	}
	if _, err := e.prefix.BeginSlot(5, prompt); !errors.Is(err, ErrContract) {
		t.Fatalf("a slot past the prefix cache's: %v", err)
	}
	if _, err := e.prefix.Begin(nil); !errors.Is(err, ErrContract) {
		t.Fatalf("an empty prompt: %v", err)
	}
}

// inGoroutine reports a failure from a goroutine other than the test's: Errorf is safe there,
// FailNow is not, so a fatal failure records itself and ends only that goroutine.
type inGoroutine struct{ testing.TB }

func (g inGoroutine) Fatal(args ...any) { g.Error(args...); runtime.Goexit() }
func (g inGoroutine) Fatalf(format string, args ...any) {
	g.Errorf(format, args...)
	runtime.Goexit()
}
func (g inGoroutine) FailNow() { g.Fail(); runtime.Goexit() }

func TestConcurrentSessionsFromGoroutines(t *testing.T) {
	const slots = 4
	e := newEngine(t, slots, 1<<14)
	defer e.close(t)
	system := []int32{9, 8, 7, 6, 5, 4, 3, 2, 1}
	var wg sync.WaitGroup
	for slot := int32(0); slot < slots; slot++ {
		wg.Add(1)
		go func(slot int32) {
			defer wg.Done()
			t := inGoroutine{t}
			rng := rand.New(rand.NewSource(int64(slot)))
			var c conversation
			for turn := 0; turn < 15; turn++ {
				prompt := c.next(system, rng)
				_, reply := e.serve(t, slot, prompt, 1+rng.Intn(3), rng)
				c.history = append(prompt, reply...)
				if _, err := e.prefix.Match(-1, prompt); err != nil {
					t.Error(err)
				}
			}
		}(slot)
	}
	wg.Wait()
	if err := e.prefix.Check(); err != nil {
		t.Fatal(err)
	}
	stats, _ := e.prefix.Stats()
	if stats.Lookups != slots*15 || stats.ReusedTokens == 0 {
		t.Fatalf("stats %+v", stats)
	}
}

func TestAPrefixCacheSurvivesARestart(t *testing.T) {
	dir := t.TempDir() + "/cache"
	e := newEngine(t, 1, 0)
	rng := rand.New(rand.NewSource(3))
	prompt := []int32{5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6}
	e.serve(t, 0, prompt, 2, rng)
	if err := e.prefix.Save(dir, "toy"); err != nil {
		t.Fatal(err)
	}
	e.close(t)
	if !SavedIn(dir) {
		t.Fatal("SavedIn is false for the folder just saved")
	}
	restarted := newEngine(t, 1, 0)
	defer restarted.close(t)
	if err := restarted.prefix.Load(dir, "another model"); !errors.Is(err, ErrContract) {
		t.Fatalf("a trie saved for another model: %v", err)
	}
	// The C API reads a string up to a NUL byte: "toy\x00B" would reach it as "toy", the model
	// saved. Refused, as are such paths.
	if err := restarted.prefix.Load(dir, "toy\x00B"); !errors.Is(err, ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "NUL") {
		t.Fatalf("a model id with a NUL byte: %v", err)
	}
	if err := restarted.prefix.Save(dir+"\x00x", "toy"); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a folder with a NUL byte: %v", err)
	}
	if SavedIn(dir + "\x00x") {
		t.Fatal("SavedIn is true for a folder name with a NUL byte")
	}
	if err := restarted.prefix.Load(dir, "toy"); err != nil {
		t.Fatal(err)
	}
	loaded, err := restarted.prefix.Stats()
	if err != nil || loaded.LoadedNodes == 0 || loaded.LoadedNodes != loaded.NodeCount {
		t.Fatalf("after the load: %+v", loaded)
	}
	if cached, _ := restarted.serve(t, 0, prompt, 1, rng); cached != int64(len(prompt))-1 {
		t.Fatalf("after a restart: %d tokens restored, want %d", cached, len(prompt)-1)
	}
	if stats, err := restarted.prefix.Stats(); err != nil || stats.PeakPagedOutBytes < stats.PagedOutBytes {
		t.Fatalf("the peak below what is held: %+v", stats)
	}
	if err := restarted.prefix.ResetPeak(); err != nil {
		t.Fatal(err)
	}
	if stats, err := restarted.prefix.Stats(); err != nil || stats.PeakPagedOutBytes != stats.PagedOutBytes {
		t.Fatalf("after ResetPeak: %+v", stats)
	}
	// Under a budget that keeps nothing: every node found in the file, none read, none held.
	small := newEngine(t, 1, 1)
	defer small.close(t)
	if err := small.prefix.Load(dir, "toy"); err != nil {
		t.Fatal(err)
	}
	if stats, err := small.prefix.Stats(); err != nil || stats.LoadedNodes != loaded.LoadedNodes ||
		stats.NodeCount != 0 || stats.EvictedNodes == 0 || stats.PeakPagedOutBytes > 1 {
		t.Fatalf("under a budget of one byte: %+v", stats)
	}
}

func TestAPrefixCacheInASharedFolder(t *testing.T) {
	dir := t.TempDir() + "/shared"
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o777); err != nil { // its users' folder: any of them may write it
		t.Fatal(err)
	}
	e := newEngine(t, 1, 0)
	rng := rand.New(rand.NewSource(5))
	prompt := []int32{9, 8, 7, 6, 5, 4, 3}
	e.serve(t, 0, prompt, 2, rng)
	if err := e.prefix.Save(dir, "toy"); !errors.Is(err, ErrContract) ||
		!strings.Contains(err.Error(), "SaveOptions::shared") {
		t.Fatalf("a private save into a folder others can write: %v", err)
	}
	if _, err := os.Stat(dir + "/prefix_cache.safetensors"); !os.IsNotExist(err) {
		t.Fatalf("a refused save wrote a file: %v", err)
	}
	if err := e.prefix.SaveWith(dir, "toy", SaveOptions{Shared: true}); err != nil {
		t.Fatal(err)
	}
	e.close(t)
	info, err := os.Stat(dir + "/prefix_cache.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	if info.Mode().Perm() != 0o644 {
		t.Fatalf("a shared save: mode %v", info.Mode())
	}
	restarted := newEngine(t, 1, 0)
	defer restarted.close(t)
	if SavedIn(dir) || !SavedInWith(dir, LoadOptions{AllowShared: true}) {
		t.Fatal("SavedIn trusts a folder others can write, or SavedInWith does not")
	}
	if err := restarted.prefix.Load(dir, "toy"); !errors.Is(err, ErrContract) ||
		!strings.Contains(err.Error(), "allow_shared") {
		t.Fatalf("a folder others can write: %v", err)
	}
	if err := restarted.prefix.LoadWith(dir, "toy", LoadOptions{AllowShared: true}); err != nil {
		t.Fatal(err)
	}
	if cached, _ := restarted.serve(t, 0, prompt, 1, rng); cached != int64(len(prompt))-1 {
		t.Fatalf("from the shared folder: %d tokens restored, want %d", cached, len(prompt)-1)
	}
}
