package kvsnap

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const heads, depth = 2, 2

// key is the key element [head, d] of token tok at position pos (values are its negation):
// exact in f32, so any misplaced column shows.
func key(tok int32, pos int64, head, d int) float32 {
	return float32(int64(tok)*1000 + pos*4 + int64(head)*2 + int64(d))
}

// kv is keys or values [1, heads, len(toks), depth] for toks from position offset.
func kv(t testing.TB, toks []int32, offset int64, sign float32) *Array {
	t.Helper()
	data := make([]float32, heads*len(toks)*depth)
	for h := 0; h < heads; h++ {
		for c, tok := range toks {
			for d := 0; d < depth; d++ {
				data[(h*len(toks)+c)*depth+d] = sign * key(tok, offset+int64(c), h, d)
			}
		}
	}
	a, err := FromFloat32([]int64{1, heads, int64(len(toks)), depth}, data)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func write(t testing.TB, c *Cache, seq int32, toks []int32) *History {
	t.Helper()
	offset, err := c.Seq(seq).Offset()
	if err != nil {
		t.Fatal(err)
	}
	keys, values := kv(t, toks, offset, 1), kv(t, toks, offset, -1)
	defer keys.Close()
	defer values.Close()
	h, err := c.Update(&Batch{Rows: 1, Length: int64(len(toks)), Offsets: []int32{int32(offset)}, SeqIDs: []int32{seq}}, keys, values)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// keyReader reads key [head, column, d] of h's row 0: through its Keys, or for a Paged history
// through its block table and its pool's chunks, in place. done releases what it took.
func keyReader(t testing.TB, h *History) (read func(head, column, d int64) float32, done func()) {
	t.Helper()
	if h.Form != Paged {
		data, strides, err := h.Keys.Float32s()
		if err != nil {
			t.Fatal(err)
		}
		return func(head, column, d int64) float32 {
			return data[head*strides[1]+column*strides[2]+d*strides[3]]
		}, func() {}
	}
	info, err := h.Paged()
	if err != nil {
		t.Fatal(err)
	}
	if want := (h.Length + info.BlockTokens - 1) / info.BlockTokens; int64(len(info.Table)) != want || info.Length != h.Length {
		t.Fatalf("paged history of %d columns: %+v", h.Length, info)
	}
	type chunk struct {
		keys    *Array
		data    []float32
		strides []int64
	}
	chunks := map[int32]chunk{}
	return func(head, column, d int64) float32 {
			block := info.Table[column/info.BlockTokens]
			at := block / int32(info.BlocksPerChunk)
			if int(at) >= info.Chunks {
				t.Fatalf("block %d is in chunk %d of %d", block, at, info.Chunks)
			}
			c, ok := chunks[at]
			if !ok {
				keys, values, err := h.PagedChunk(int(at))
				if err != nil {
					t.Fatal(err)
				}
				values.Close()
				data, strides, err := keys.Float32s()
				if err != nil {
					t.Fatal(err)
				}
				c = chunk{keys, data, strides}
				chunks[at] = c
			}
			slot := int64(block%int32(info.BlocksPerChunk))*info.BlockTokens + column%info.BlockTokens
			return c.data[head*c.strides[1]+slot*c.strides[2]+d*c.strides[3]]
		}, func() {
			for _, c := range chunks {
				c.keys.Close()
			}
		}
}

// checkHistory: every key column of h holds the token at its position, and the positions the
// last of `length` tokens may see (the window's, or all) are present.
func checkHistory(t testing.TB, h *History, toks []int32, length int64) {
	t.Helper()
	read, done := keyReader(t, h)
	defer done()
	columns := h.Length
	seen := map[int64]bool{}
	for c := int64(0); c < columns; c++ {
		pos := h.FirstPosition + ((c-h.OldestColumn)%columns+columns)%columns
		if pos < 0 || pos >= length {
			continue
		}
		seen[pos] = true
		for head := 0; head < heads; head++ {
			for d := 0; d < depth; d++ {
				got := read(int64(head), c, int64(d))
				if want := key(toks[pos], pos, head, d); got != want {
					t.Fatalf("key column %d (position %d) head %d d %d = %v, want %v", c, pos, head, d, got, want)
				}
			}
		}
	}
	from := int64(0)
	if h.Window > 0 && length > h.Window {
		from = length - h.Window
	}
	for pos := from; pos < length; pos++ {
		if !seen[pos] {
			t.Fatalf("position %d missing from a history of %d columns", pos, columns)
		}
	}
}

func TestKVCacheSnapshotRestoreAndRefusals(t *testing.T) {
	c, err := NewKVCache()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.Kind() != KVCache {
		t.Fatalf("kind %v", c.Kind())
	}
	toks := []int32{5, 6, 7, 8, 9, 10}
	write(t, c, 0, toks[:4]).Close()
	s, err := c.Snapshot(0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if info, _ := s.Info(); !info.Lazy || info.Size != 0 || info.From != 0 || info.To != 4 {
		t.Fatalf("a fresh snapshot: %+v, want lazy [0, 4) owning nothing", info)
	}
	h := write(t, c, 0, toks[4:])
	checkHistory(t, h, toks, 6)
	h.Close()

	// A batch at the wrong offset is refused, and nothing changes.
	keys := kv(t, []int32{1}, 3, 1)
	defer keys.Close()
	err = c.Append(&Batch{Rows: 1, Length: 1, Offsets: []int32{3}}, keys, keys)
	if !errors.Is(err, ErrContract) || !strings.Contains(err.Error(), "offset") {
		t.Fatalf("a write at offset 3 of a cache at 6: %v", err)
	}
	if off, _ := c.Offset(); off != 6 {
		t.Fatalf("offset %d after a refused write", off)
	}
	// A batch whose slices are shorter than its rows never reaches C.
	err = c.Append(&Batch{Rows: 2, Length: 1, Offsets: []int32{6}}, keys, keys)
	if !errors.Is(err, ErrInvalidArgument) || err.Error() != "kvsnap.Cache.Append: Batch.Offsets holds 1 entries for 2 rows" {
		t.Fatalf("two rows, one offset: %v", err)
	}
	err = c.Append(&Batch{Rows: 1, Length: 1, Offsets: []int32{6}, InputIDs: []int32{1, 2}}, keys, keys)
	if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "InputIDs holds 2 entries, not 1") {
		t.Fatalf("two ids for one token: %v", err)
	}

	// Back to 4 with the snapshot (its data was never overwritten: appends past it keep it).
	if ok, err := c.Restore(s, 4); !ok || err != nil {
		t.Fatalf("restore to 4: %v %v", ok, err)
	}
	if ok, err := c.Restore(nil, 9); ok || err != nil {
		t.Fatalf("a rewind forward must report false: %v %v", ok, err)
	}
	h = write(t, c, 0, []int32{42})
	checkHistory(t, h, []int32{5, 6, 7, 8, 42}, 5)
	h.Close()

	// Merge and split consume their snapshots.
	tail, err := c.Snapshot(4)
	if err != nil {
		t.Fatal(err)
	}
	head, err := c.Snapshot(0)
	if err != nil {
		t.Fatal(err)
	}
	before, after, err := c.Split(head, 2)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := head.Info(); !errors.Is(err, ErrClosed) {
		t.Fatalf("a split snapshot must be consumed: %v", err)
	}
	if info, _ := after.Info(); info.From != 2 || info.To != 5 {
		t.Fatalf("after the split: %+v", info)
	}
	whole, err := c.Merge(before, after)
	if err != nil {
		t.Fatal(err)
	}
	defer whole.Close()
	defer tail.Close()
	if info, _ := whole.Info(); info.From != 0 || info.To != 5 {
		t.Fatalf("merged: %+v", info)
	}
}

func TestPagedSequencesShareBlocks(t *testing.T) {
	c, err := NewPagedKVCache(4)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	write(t, c, 0, prompt).Close()
	prefix, err := c.Seq(0).Snapshot(0)
	if err != nil {
		t.Fatal(err)
	}
	defer prefix.Close()
	for _, seq := range []int32{1, 2} {
		if ok, err := c.Seq(seq).Restore(prefix, 10+2*int64(seq-1)); !ok || err != nil {
			t.Fatalf("restore into sequence %d: %v %v", seq, ok, err)
		}
	}
	stats, err := c.PoolStats()
	if err != nil || stats.LiveBlocks != 3 || stats.BlocksCopied != 0 {
		t.Fatalf("three sequences over one prefix: %+v %v (want 3 live blocks, none copied)", stats, err)
	}
	if seqs, _ := c.Sequences(); len(seqs) != 3 || seqs[2] != 2 {
		t.Fatalf("sequences %v", seqs)
	}
	if exposed, _ := c.Seq(1).ExposedBytes(); exposed != 4*heads*depth*2*4 {
		t.Fatalf("sequence 1 stands mid-block: exposed %d, want one block", exposed)
	}

	// Sequence 1 (at 10) decodes a token while sequence 2 (at 12) prefills two: one batch.
	rows := RowsBatch(Row{Seq: 1, Offset: 10, Tokens: []int32{77}}, Row{Seq: 2, Offset: 12, Tokens: []int32{88, 89}})
	if rows.Length != 2 || rows.InputIDs[1] != 0 || rows.QueryLens[0] != 1 || rows.SeqIDs[1] != 2 {
		t.Fatalf("RowsBatch: %+v", rows)
	}
	keysData := make([]float32, 2*heads*2*depth)
	for h := 0; h < heads; h++ {
		for d := 0; d < depth; d++ {
			keysData[(0*heads+h)*2*depth+0*depth+d] = key(77, 10, h, d)
			keysData[(1*heads+h)*2*depth+0*depth+d] = key(88, 12, h, d)
			keysData[(1*heads+h)*2*depth+1*depth+d] = key(89, 13, h, d)
		}
	}
	keys, _ := FromFloat32([]int64{2, heads, 2, depth}, keysData)
	defer keys.Close()
	histories, err := c.UpdateRows(rows, keys, keys)
	if err != nil {
		t.Fatal(err)
	}
	checkHistory(t, histories[0], append(append([]int32{}, prompt[:10]...), 77), 11)
	checkHistory(t, histories[1], append(append([]int32{}, prompt...), 88, 89), 14)
	for _, h := range histories {
		h.Close()
	}
	if stats, _ := c.PoolStats(); stats.BlocksCopied != 1 {
		t.Fatalf("sequence 1 wrote into the shared third block: %d blocks copied, want 1", stats.BlocksCopied)
	}
	if err := c.Seq(2).Reset(); err != nil {
		t.Fatal(err)
	}
	if off, _ := c.Seq(2).Offset(); off != 0 {
		t.Fatalf("offset %d after reset", off)
	}
	if _, err := NewPagedKVCache(0); !errors.Is(err, ErrContract) || !strings.HasPrefix(err.Error(), "PagedKVCache: block_tokens 0") {
		t.Fatalf("zero-token blocks: %v", err)
	}
}

func TestRotatingCacheKeepsItsWindow(t *testing.T) {
	c, err := NewRotatingKVCache(4)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var toks []int32
	for i := int32(0); i < 11; i++ {
		toks = append(toks, 100+i)
		h := write(t, c, 0, toks[len(toks)-1:])
		if h.Window != 4 {
			t.Fatalf("window %d", h.Window)
		}
		checkHistory(t, h, toks, int64(len(toks)))
		h.Close()
	}
	state, err := c.State()
	if err != nil || len(state) != 2 {
		t.Fatalf("state: %d arrays, %v", len(state), err)
	}
	for _, a := range state {
		a.Close()
	}
}

func TestSnapshotFilesRoundTripAndRefuseOthersWrites(t *testing.T) {
	c, _ := NewKVCache()
	defer c.Close()
	toks := []int32{3, 1, 4, 1, 5, 9}
	write(t, c, 0, toks).Close()
	s, _ := c.Snapshot(0)
	defer s.Close()
	dir := t.TempDir()
	path := filepath.Join(dir, "turn.safetensors")
	if err := SaveSnapshots(path, 6, []*Snapshot{s, nil, s}); err != nil {
		t.Fatal(err)
	}
	offset, loaded, err := LoadSnapshots(path)
	if err != nil || offset != 6 || len(loaded) != 3 || loaded[1] != nil {
		t.Fatalf("load: %d %v %v", offset, loaded, err)
	}
	fresh, _ := NewKVCache()
	defer fresh.Close()
	if ok, err := fresh.Restore(loaded[0], 6); !ok || err != nil {
		t.Fatalf("restore from the file: %v %v", ok, err)
	}
	h, err := fresh.View(UniformBatch(1, 1, 6))
	if err != nil {
		t.Fatal(err)
	}
	checkHistory(t, h, toks, 6)
	h.Close()
	for _, l := range loaded {
		l.Close()
	}

	if err := os.Chmod(path, 0o666); err != nil {
		t.Fatal(err)
	}
	if _, _, err := LoadSnapshots(path); !errors.Is(err, ErrContract) || !strings.Contains(err.Error(), "refusing the file") {
		t.Fatalf("a file others can write: %v", err)
	}
	if offset, shared, err := LoadSnapshotsWith(path, LoadOptions{AllowShared: true}); err != nil || offset != 6 || len(shared) != 3 {
		t.Fatalf("a file others can write, trusted: %d %v %v", offset, shared, err)
	} else {
		for _, l := range shared {
			l.Close()
		}
	}
	// Into a folder others can write: refused unless shared (0644), which a load then allows.
	folder := filepath.Join(t.TempDir(), "shared")
	if err := os.Mkdir(folder, 0o700); err != nil || os.Chmod(folder, 0o777) != nil {
		t.Fatal(err)
	}
	inShared := filepath.Join(folder, "turn.safetensors")
	if err := SaveSnapshots(inShared, 6, []*Snapshot{nil}); !errors.Is(err, ErrContract) ||
		!strings.Contains(err.Error(), "save_snapshots: refusing the folder") {
		t.Fatalf("a private save into a folder others can write: %v", err)
	}
	if err := SaveSnapshotsWith(inShared, 6, []*Snapshot{nil}, SaveOptions{Shared: true}); err != nil {
		t.Fatal(err)
	}
	if info, err := os.Stat(inShared); err != nil || info.Mode().Perm() != 0o644 {
		t.Fatalf("a shared save: %v %v", info, err)
	}
	if offset, none, err := LoadSnapshotsWith(inShared, LoadOptions{AllowShared: true}); err != nil || offset != 6 || len(none) != 1 || none[0] != nil {
		t.Fatalf("the shared file: %d %v %v", offset, none, err)
	}
	if err := os.WriteFile(path, []byte("not a snapshot file"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := LoadSnapshots(path); !errors.Is(err, ErrContract) {
		t.Fatalf("a corrupt file: %v", err)
	}
}

func TestBorrowedCachesCannotBeClosed(t *testing.T) {
	c, _ := NewKVCache()
	// A cache listed twice is refused, and that refusal borrows nothing (Close works below).
	if _, err := NewPrefixCache([]*Cache{c, nil, c}, nil); !errors.Is(err, ErrContract) ||
		!strings.Contains(err.Error(), "layers 0 and 2 are the same Cache object") {
		t.Fatalf("a cache listed twice: %v", err)
	}
	p, err := NewPrefixCache([]*Cache{c, nil}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); !errors.Is(err, ErrContract) || !strings.Contains(err.Error(), "still hold this cache") {
		t.Fatalf("closing a borrowed cache: %v", err)
	}
	p.Close()
	p.Close()
	if _, err := p.Begin([]int32{1}); !errors.Is(err, ErrClosed) {
		t.Fatalf("Begin after Close: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("closing the cache once the prefix cache is closed: %v", err)
	}
	if _, err := c.Offset(); !errors.Is(err, ErrClosed) || err.Error() != "kvsnap.Sequence.Offset: the cache is closed" {
		t.Fatalf("Offset after Close: %v", err)
	}
	if _, err := NewPrefixCache([]*Cache{c}, nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("a prefix cache over a closed cache: %v", err)
	}
	var none *Cache
	if none.Kind() != Kind(-1) || none.Close() != nil {
		t.Fatalf("a nil Cache: kind %v", none.Kind())
	}
}

// Values a batch holds as int32 that do not fit: the batch is refused by every call, naming the
// value, instead of wrapping (an offset of 2^32 would write at position 0).
func TestBatchValuesThatDoNotFitInt32AreRefused(t *testing.T) {
	c, err := NewKVCache()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	keys := kv(t, []int32{1}, 0, 1)
	defer keys.Close()
	for _, b := range []*Batch{SingleBatch([]int32{1}, 1<<32), UniformBatch(1, 1, -1<<33),
		RowsBatch(Row{Seq: 0, Offset: 1 << 40, Tokens: []int32{1}}), UniformBatch(1<<40, 1, 0)} {
		err := c.Append(b, keys, keys)
		if !errors.Is(err, ErrContract) || !strings.Contains(err.Error(), "does not fit a batch's int32") {
			t.Fatalf("a batch whose offset or row count does not fit int32: %v", err)
		}
	}
	if offset, _ := c.Offset(); offset != 0 {
		t.Fatalf("offset %d after refused writes", offset)
	}
	// Refused here (C cannot hold them) with the sentinel the library's own refusal has.
	if err := SetThreads(1 << 32); !errors.Is(err, ErrContract) {
		t.Fatalf("SetThreads(2^32): %v", err)
	}
	if _, err := keys.Slice(1<<32, 0, 1); !errors.Is(err, ErrContract) {
		t.Fatalf("Slice along axis 2^32: %v", err)
	}
	if _, err := NewRecurrentCache(RecurrentOptions{ConvTail: 1 << 32, ConvDim: 1, NumVHeads: 1,
		HeadVDim: 1, HeadKDim: 1}); !errors.Is(err, ErrContract) || !strings.Contains(err.Error(), "ConvTail") {
		t.Fatalf("a recurrent option past a C int: %v", err)
	}
}

// A fresh cache's history holds no key: no Keys or Values (nil), not arrays without storage; a
// recurrent state is read one sequence a call; one snapshot as both halves of a merge is an
// invalid argument (consumed once).
func TestEmptyHistoriesRowsOfStateAndSelfMerges(t *testing.T) {
	c, err := NewKVCache()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h, err := c.View(SingleBatch([]int32{1}, 0))
	if err != nil {
		t.Fatal(err)
	}
	if h.Form != Contiguous || h.Length != 0 || h.Keys != nil || h.Values != nil {
		t.Fatalf("a fresh cache's history: form %v, length %d, keys %v", h.Form, h.Length, h.Keys)
	}
	if _, _, err := h.Keys.Float32s(); err == nil {
		t.Fatal("reading the nil keys of an empty history succeeded")
	}
	h.Close()

	r, err := NewRecurrentCache(RecurrentOptions{ConvTail: 2, ConvDim: 3, NumVHeads: 1, HeadVDim: 2, HeadKDim: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, _, err := r.RecurrentGet(UniformBatch(2, 1, 0), F32); !errors.Is(err, ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "a batch of 2 rows") {
		t.Fatalf("RecurrentGet of two rows: %v", err)
	}

	write(t, c, 0, []int32{1, 2, 3}).Close()
	s, err := c.Snapshot(0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Merge(s, s); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "same snapshot") {
		t.Fatalf("Merge(s, s): %v", err)
	}
	if _, err := s.Info(); !errors.Is(err, ErrClosed) {
		t.Fatalf("the snapshot after Merge(s, s): %v, want consumed", err)
	}
}

// An error from handing a call's result to Go after its change took place is marked Applied
// (do not repeat the call) and still matches its status.
func TestAppliedErrorsKeepTheirStatusAndSayWhatTookPlace(t *testing.T) {
	err := applied(&Error{Status: StatusOutOfMemory, Message: "kvsnap_history_arrays: out of memory"},
		"kvsnap.Cache.Update: the batch was written")
	var e *Error
	if !errors.As(err, &e) || !e.Applied || !errors.Is(err, ErrOutOfMemory) {
		t.Fatalf("applied error %#v", err)
	}
	if want := "kvsnap_history_arrays: out of memory (kvsnap.Cache.Update: the batch was written)"; e.Message != want {
		t.Fatalf("message %q, want %q", e.Message, want)
	}
	// A failure before the change is not Applied.
	cache, err := NewKVCache()
	if err != nil {
		t.Fatal(err)
	}
	defer cache.Close()
	_, err = cache.Update(nil, nil, nil)
	if !errors.As(err, &e) || e.Applied {
		t.Fatalf("a refused Update: %#v", err)
	}
	// Handing the history's arrays to Go fails after the write: Applied, and the write stands.
	keys := kv(t, []int32{1, 2, 3}, 0, 1)
	defer keys.Close()
	oom := func(string) error { return &Error{Status: StatusOutOfMemory, Message: "out of memory"} }
	failHandOut = oom
	_, err = cache.Update(UniformBatch(1, 3, 0), keys, keys)
	failHandOut = nil
	if !errors.As(err, &e) || !e.Applied || !errors.Is(err, ErrOutOfMemory) {
		t.Fatalf("Update whose history could not be handed out: %#v", err)
	}
	if offset, err := cache.Offset(); err != nil || offset != 3 {
		t.Fatalf("after an Applied Update the cache is at %d (%v), not 3", offset, err)
	}
	// Taking captures whose snapshots cannot be handed out: Applied, the schedule consumed.
	if err := cache.PrepareSnapshots(4, 5); err != nil {
		t.Fatal(err)
	}
	if h, err := cache.Update(UniformBatch(1, 3, 3), keys, keys); err != nil {
		t.Fatal(err)
	} else {
		h.Close()
	}
	failHandOut = oom
	_, err = cache.TakeSnapshots()
	failHandOut = nil
	if !errors.As(err, &e) || !e.Applied {
		t.Fatalf("TakeSnapshots whose snapshots could not be handed out: %#v", err)
	}
	if taken, err := cache.TakeSnapshots(); err != nil || len(taken) != 0 {
		t.Fatalf("the schedule was not consumed: %d snapshots (%v)", len(taken), err)
	}
}
