package kvsnap

/*
#include "batch.h"

static kvsnap_status go_cache_append(kvsnap_cache* cache, KVSNAP_GO_BATCH_ARGS,
                                     const kvsnap_array* keys, const kvsnap_array* values) {
  KVSNAP_GO_BATCH;
  return kvsnap_cache_update(cache, &batch, keys, values, NULL);
}
static kvsnap_status go_cache_update_history(kvsnap_cache* cache, KVSNAP_GO_BATCH_ARGS,
                                             const kvsnap_array* keys,
                                             const kvsnap_array* values, kvsnap_history** out) {
  KVSNAP_GO_BATCH;
  return kvsnap_cache_update_history(cache, &batch, keys, values, out);
}
static kvsnap_status go_cache_view_history(const kvsnap_cache* cache, KVSNAP_GO_BATCH_ARGS,
                                           kvsnap_history** out) {
  KVSNAP_GO_BATCH;
  return kvsnap_cache_view_history(cache, &batch, out);
}
static kvsnap_status go_recurrent_get(kvsnap_cache* cache, KVSNAP_GO_BATCH_ARGS,
                                      kvsnap_dtype dtype, kvsnap_array** conv,
                                      kvsnap_array** delta) {
  KVSNAP_GO_BATCH;
  return kvsnap_recurrent_get(cache, &batch, dtype, conv, delta);
}
static kvsnap_status go_recurrent_put(kvsnap_cache* cache, KVSNAP_GO_BATCH_ARGS,
                                      kvsnap_array** conv, kvsnap_array** delta, size_t count) {
  KVSNAP_GO_BATCH;
  return kvsnap_recurrent_put(cache, &batch, (const kvsnap_array* const*)conv,
                              (const kvsnap_array* const*)delta, count);
}
*/
import "C"

import (
	"fmt"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Kind is a cache's kind (kvsnap_cache_kind).
type Kind int

const (
	KVCache         Kind = C.KVSNAP_KV_CACHE          // append-only attention cache
	RotatingKVCache Kind = C.KVSNAP_ROTATING_KV_CACHE // sliding-window attention cache
	RecurrentCache  Kind = C.KVSNAP_RECURRENT_CACHE   // conv tail + gated-delta state
	PagedKVCache    Kind = C.KVSNAP_PAGED_KV_CACHE    // attention cache of shared, counted blocks
)

func (k Kind) String() string {
	switch k {
	case KVCache:
		return "KVCache"
	case RotatingKVCache:
		return "RotatingKVCache"
	case RecurrentCache:
		return "RecurrentCache"
	case PagedKVCache:
		return "PagedKVCache"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Batch is what one forward step processes: Rows rows of Length columns; row b holds
// QueryLens[b] real tokens (all Length when QueryLens is nil) from absolute position
// Offsets[b], of sequence SeqIDs[b] (row b is sequence b when SeqIDs is nil). InputIDs, when
// set, holds Rows*Length token ids row-major.
type Batch struct {
	Rows, Length int64
	InputIDs     []int32
	Offsets      []int32
	QueryLens    []int32
	SeqIDs       []int32

	unfit string // what a constructor could not hold in int32: every call refuses the batch
}

// fit is v as an int32 (positions and lengths are int32 in a batch); one that does not fit
// marks the batch, whose calls then fail with ErrContract naming it.
func (b *Batch) fit(what string, v int64) int32 {
	if v < math.MinInt32 || v > math.MaxInt32 {
		if b.unfit == "" {
			b.unfit = fmt.Sprintf("%s %d does not fit a batch's int32", what, v)
		}
		return 0
	}
	return int32(v)
}

// SingleBatch is one row of tokens from offset (sequence 0; SeqIDs set it otherwise).
func SingleBatch(tokens []int32, offset int64) *Batch {
	b := &Batch{Rows: 1, Length: int64(len(tokens)), InputIDs: append([]int32{}, tokens...)}
	b.Offsets = []int32{b.fit("offset", offset)}
	return b
}

// UniformBatch is rows rows of length placeholder tokens, all from offset (sequence b in row b).
func UniformBatch(rows, length, offset int64) *Batch {
	b := &Batch{Rows: rows, Length: length}
	if rows < 0 {
		return b // refused by every call (rows must be >= 0)
	}
	if b.fit("row count", rows); b.unfit != "" {
		return b // each row is its own sequence, whose id is an int32: refused by every call
	}
	b.Offsets = make([]int32, rows)
	for i := range b.Offsets {
		b.Offsets[i] = b.fit("offset", offset)
	}
	return b
}

// Row is one sequence's tokens in a batch of several: Tokens from Offset of sequence Seq.
type Row struct {
	Seq    int32
	Offset int64
	Tokens []int32
}

// RowsBatch is one row per Row, each at its own offset with its own length; shorter rows are
// padded with token 0 to the longest (their QueryLens say how many are real).
func RowsBatch(rows ...Row) *Batch {
	longest := 0
	for _, r := range rows {
		if len(r.Tokens) > longest {
			longest = len(r.Tokens)
		}
	}
	b := &Batch{Rows: int64(len(rows)), Length: int64(longest), InputIDs: make([]int32, len(rows)*longest),
		Offsets: make([]int32, len(rows)), QueryLens: make([]int32, len(rows)), SeqIDs: make([]int32, len(rows))}
	for i, r := range rows {
		copy(b.InputIDs[i*longest:], r.Tokens)
		b.Offsets[i], b.QueryLens[i], b.SeqIDs[i] = b.fit("offset", r.Offset), b.fit("row length", int64(len(r.Tokens))), r.Seq
	}
	return b
}

// cBatch: the batch's fields as the C shims take them, after checking the slices' lengths
// (C reads Rows entries of each: a shorter slice would be read past its end).
type cBatch struct {
	rows, length             C.int64_t
	ids, offsets, lens, seqs *C.int32_t
}

func int32s(s []int32) *C.int32_t {
	if len(s) == 0 {
		return nil
	}
	return (*C.int32_t)(unsafe.Pointer(&s[0]))
}

func (b *Batch) c(call string) (cBatch, error) {
	if b == nil {
		return cBatch{}, invalid(call, "the batch is nil")
	}
	if b.unfit != "" {
		return cBatch{}, contract(call, "%s", b.unfit)
	}
	if b.Rows < 0 || b.Length < 0 {
		return cBatch{}, invalid(call, "batch of %d rows and %d columns: both must be >= 0", b.Rows, b.Length)
	}
	if int64(len(b.Offsets)) != b.Rows {
		return cBatch{}, invalid(call, "Batch.Offsets holds %d entries for %d rows", len(b.Offsets), b.Rows)
	}
	for _, field := range []struct {
		name   string
		values []int32
		want   int64
	}{{"QueryLens", b.QueryLens, b.Rows}, {"SeqIDs", b.SeqIDs, b.Rows}, {"InputIDs", b.InputIDs, b.Rows * b.Length}} {
		if field.values != nil && int64(len(field.values)) != field.want {
			return cBatch{}, invalid(call, "Batch.%s holds %d entries, not %d (or nil)", field.name, len(field.values), field.want)
		}
	}
	return cBatch{C.int64_t(b.Rows), C.int64_t(b.Length), int32s(b.InputIDs), int32s(b.Offsets),
		int32s(b.QueryLens), int32s(b.SeqIDs)}, nil
}

// RecurrentOptions shape a recurrent cache's state: a conv tail [B, ConvTail, ConvDim] in the
// activation dtype and a delta state [B, NumVHeads, HeadVDim, HeadKDim] in f32.
type RecurrentOptions struct {
	ConvTail, ConvDim             int
	NumVHeads, HeadVDim, HeadKDim int
}

// PoolStats are a paged cache's blocks.
type PoolStats struct {
	Blocks       int64 // blocks the pool has allocated
	BlocksInUse  int64 // referenced by a sequence or a snapshot
	BytesInUse   int64 // their keys and values
	BlocksCopied int64 // copies on write and joins at restore
	LiveBlocks   int64 // used by sequences (a block shared by several counts once)
	LiveBytes    int64 // their keys and values
}

// Cache is one layer's state, serving one or many sequences (a sequence exists once a batch row
// or a restore names it). Its methods without a sequence address sequence 0; Seq(id) addresses
// another. A Cache may be used from several goroutines; the library runs one call at a time.
type Cache struct {
	mu        sync.RWMutex
	ptr       *C.kvsnap_cache
	kind      Kind
	borrowers atomic.Int32 // prefix caches and speculations holding it
}

func newCache(call string, create func(**C.kvsnap_cache) C.kvsnap_status) (*Cache, error) {
	var out *C.kvsnap_cache
	if err := check(func() C.kvsnap_status { return create(&out) }); err != nil {
		return nil, err
	}
	var kind C.kvsnap_cache_kind
	if err := check(func() C.kvsnap_status { return C.kvsnap_cache_get_kind(out, &kind) }); err != nil {
		C.kvsnap_cache_destroy(out)
		return nil, err
	}
	c := &Cache{ptr: out, kind: Kind(kind)}
	runtime.SetFinalizer(c, func(c *Cache) { c.destroy() })
	return c, nil
}

// NewKVCache is an append-only attention cache.
func NewKVCache() (*Cache, error) {
	return newCache("NewKVCache", func(out **C.kvsnap_cache) C.kvsnap_status { return C.kvsnap_kv_cache_create(out) })
}

// NewRotatingKVCache is a sliding-window attention cache of maxSize tokens (1 to 2^60).
func NewRotatingKVCache(maxSize int64) (*Cache, error) {
	return newCache("NewRotatingKVCache", func(out **C.kvsnap_cache) C.kvsnap_status {
		return C.kvsnap_rotating_kv_cache_create(C.int64_t(maxSize), out)
	})
}

// NewRecurrentCache is a cache of conv tail and gated-delta state.
func NewRecurrentCache(o RecurrentOptions) (*Cache, error) {
	for _, field := range []struct {
		name  string
		value int
	}{{"ConvTail", o.ConvTail}, {"ConvDim", o.ConvDim}, {"NumVHeads", o.NumVHeads},
		{"HeadVDim", o.HeadVDim}, {"HeadKDim", o.HeadKDim}} {
		if field.value < math.MinInt32 || field.value > math.MaxInt32 {
			return nil, contract("NewRecurrentCache", "RecurrentOptions.%s %d does not fit a C int", field.name, field.value)
		}
	}
	return newCache("NewRecurrentCache", func(out **C.kvsnap_cache) C.kvsnap_status {
		options := C.kvsnap_recurrent_options{conv_tail: C.int(o.ConvTail), conv_dim: C.int(o.ConvDim),
			num_v_heads: C.int(o.NumVHeads), head_v_dim: C.int(o.HeadVDim), head_k_dim: C.int(o.HeadKDim)}
		return C.kvsnap_recurrent_cache_create(&options, out)
	})
}

// NewPagedKVCache is an attention cache of blockTokens-token blocks: full blocks are shared by
// reference count between sequences and snapshots, a write into a shared block copies that
// block, a restore splices references. The pool grows by chunks of 64 blocks, each one array
// of at most 2^60 tokens: blockTokens is 1 to 2^54.
func NewPagedKVCache(blockTokens int64) (*Cache, error) {
	return newCache("NewPagedKVCache", func(out **C.kvsnap_cache) C.kvsnap_status {
		return C.kvsnap_paged_kv_cache_create(C.int64_t(blockTokens), out)
	})
}

// Kind is the cache's kind; Kind(-1), which names none, for a nil Cache.
func (c *Cache) Kind() Kind {
	if c == nil {
		return -1
	}
	return c.kind
}

func (c *Cache) destroy() {
	c.mu.Lock()
	defer c.mu.Unlock()
	C.kvsnap_cache_destroy(c.ptr)
	c.ptr = nil
}

// Close frees the cache (its lazy snapshots outlive it: their data is copied out first). It
// fails while a PrefixCache, Speculation or Tier still holds the cache: close those first. Safe
// to call twice.
func (c *Cache) Close() error {
	if c == nil {
		return nil
	}
	c.mu.Lock() // borrowing takes the read lock: the count cannot rise while this holds
	defer c.mu.Unlock()
	if n := c.borrowers.Load(); n > 0 {
		return &Error{Status: StatusContract,
			Message: fmt.Sprintf("kvsnap.Cache.Close: %d prefix cache(s), speculation(s) or tier(s) still hold this cache; close them first", n)}
	}
	C.kvsnap_cache_destroy(c.ptr)
	c.ptr = nil
	return nil
}

// use runs f with the cache's handle, read-locked (Close waits), or fails if closed.
func (c *Cache) use(call string, f func(*C.kvsnap_cache) error) error {
	if c == nil {
		return closedError(call, "cache")
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	if c.ptr == nil {
		return closedError(call, "cache")
	}
	return f(c.ptr)
}

// Offset is the tokens sequence 0 holds.
func (c *Cache) Offset() (int64, error) { return c.Seq(0).Offset() }

// Reset drops every sequence's state and schedule.
func (c *Cache) Reset() error {
	return c.use("Cache.Reset", func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status { return C.kvsnap_cache_reset(p) })
	})
}

// State is sequence 0's live state: see Sequence.State.
func (c *Cache) State() ([]*Array, error) { return c.Seq(0).State() }

// PoolStats is a paged cache's block accounting.
func (c *Cache) PoolStats() (PoolStats, error) {
	var s C.kvsnap_pool_stats
	err := c.use("Cache.PoolStats", func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status { return C.kvsnap_paged_kv_cache_get_stats(p, &s) })
	})
	return PoolStats{int64(s.blocks), int64(s.blocks_in_use), int64(s.bytes_in_use),
		int64(s.blocks_copied), int64(s.live_blocks), int64(s.live_bytes)}, err
}

// Sequences are the ids of the sequences the cache has made (written, restored or given a
// schedule; a reset one stays listed, at offset 0), ascending.
func (c *Cache) Sequences() ([]int32, error) {
	var out []int32
	err := c.use("Cache.Sequences", func(p *C.kvsnap_cache) error {
		seqs := make([]int32, 16)
		for {
			var count C.size_t
			err := check(func() C.kvsnap_status {
				return C.kvsnap_cache_sequences(p, int32s(seqs), C.size_t(len(seqs)), &count)
			})
			if err != nil && int(count) > len(seqs) { // more sequences than room: C says how many
				seqs = make([]int32, count)
				continue
			}
			if err == nil {
				out = seqs[:count]
			}
			return err
		}
	})
	return out, err
}

// Append writes the batch's keys [B, H, L, D] and values [B, H, L, Dv] (copied into the cache),
// each row to its sequence, without handing back a history.
func (c *Cache) Append(b *Batch, keys, values *Array) error {
	return c.write("Cache.Append", b, keys, values, func(p *C.kvsnap_cache, cb cBatch, k, v *C.kvsnap_array) C.kvsnap_status {
		return C.go_cache_append(p, cb.rows, cb.length, cb.ids, cb.offsets, cb.lens, cb.seqs, k, v)
	})
}

// Update writes as Append does and returns the history every query of the batch attends to,
// as the cache holds it (nothing copied): a one-row batch's is its sequence's (contiguous, or
// paged for a paged cache), a batch of several rows has one per row (Ragged).
func (c *Cache) Update(b *Batch, keys, values *Array) (*History, error) {
	call := "Cache.Update"
	var h *C.kvsnap_history
	err := c.write(call, b, keys, values, func(p *C.kvsnap_cache, cb cBatch, k, v *C.kvsnap_array) C.kvsnap_status {
		return C.go_cache_update_history(p, cb.rows, cb.length, cb.ids, cb.offsets, cb.lens, cb.seqs, k, v, &h)
	})
	if err != nil {
		return nil, err
	}
	history, err := newHistory(call, h)
	if err != nil {
		return nil, applied(err, "kvsnap.Cache.Update: the batch was written")
	}
	return history, nil
}

// write runs a write of keys and values: the batch checked, the arrays and the cache locked.
func (c *Cache) write(call string, b *Batch, keys, values *Array,
	f func(*C.kvsnap_cache, cBatch, *C.kvsnap_array, *C.kvsnap_array) C.kvsnap_status) error {
	cb, err := b.c(call)
	if err != nil {
		return err
	}
	arrays, unlock, err := cArrays(call, keys, values)
	if err != nil {
		return err
	}
	defer unlock()
	return c.use(call, func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status { return f(p, cb, arrays[0], arrays[1]) })
	})
}

// UpdateRows writes as Update does and returns row b's history in [b] (a batch of one row: its
// history; more: the rows of the ragged history, which is closed).
func (c *Cache) UpdateRows(b *Batch, keys, values *Array) ([]*History, error) {
	h, err := c.Update(b, keys, values)
	if err != nil {
		return nil, err
	}
	rows, err := h.split("Cache.UpdateRows")
	if err != nil {
		return nil, applied(err, "kvsnap.Cache.UpdateRows: the batch was written")
	}
	return rows, nil
}

// View is the history the batch's queries would attend to, without writing.
func (c *Cache) View(b *Batch) (*History, error) {
	call := "Cache.View"
	cb, err := b.c(call)
	if err != nil {
		return nil, err
	}
	var h *C.kvsnap_history
	err = c.use(call, func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status {
			return C.go_cache_view_history(p, cb.rows, cb.length, cb.ids, cb.offsets, cb.lens, cb.seqs, &h)
		})
	})
	if err != nil {
		return nil, err
	}
	return newHistory(call, h)
}

// RecurrentGet is a recurrent cache's live conv and delta state for the batch, zero on first
// use (the conv state in activation's dtype). They are views of state that snapshots share:
// read-only (a kernel that updates state in place works on a copy and puts that).
func (c *Cache) RecurrentGet(b *Batch, activation DType) (conv, delta *Array, err error) {
	call := "Cache.RecurrentGet"
	cb, err := b.c(call)
	if err != nil {
		return nil, nil, err
	}
	cactivation, err := activation.c(call)
	if err != nil {
		return nil, nil, err
	}
	var cv, dl *C.kvsnap_array
	err = c.use(call, func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status {
			return C.go_recurrent_get(p, cb.rows, cb.length, cb.ids, cb.offsets, cb.lens, cb.seqs,
				cactivation, &cv, &dl)
		})
	})
	return newArray(cv), newArray(dl), err
}

// RecurrentPut ends a forward of the batch's tokens with one conv and delta state per
// scheduled split point (SnapshotSplits), then the end state. The cache adopts the arrays
// without copying: do not write to them afterwards. A row of no tokens leaves its sequence as
// it is: its arrays are checked, not adopted.
func (c *Cache) RecurrentPut(b *Batch, conv, delta []*Array) error {
	call := "Cache.RecurrentPut"
	if len(conv) != len(delta) {
		return invalid(call, "%d conv states and %d delta states", len(conv), len(delta))
	}
	cb, err := b.c(call)
	if err != nil {
		return err
	}
	arrays, unlock, err := cArrays(call, append(append([]*Array{}, conv...), delta...)...)
	if err != nil {
		return err
	}
	defer unlock()
	arrays = append(arrays, nil) // never a zero-length slice to index
	n := len(conv)
	return c.use(call, func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status {
			return C.go_recurrent_put(p, cb.rows, cb.length, cb.ids, cb.offsets, cb.lens, cb.seqs,
				&arrays[0], &arrays[n], C.size_t(n))
		})
	})
}

// SnapshotSplits of sequence 0: see Sequence.SnapshotSplits.
func (c *Cache) SnapshotSplits(forwardLen int64) ([]int64, error) {
	return c.Seq(0).SnapshotSplits(forwardLen)
}

// Snapshot of sequence 0: see Sequence.Snapshot.
func (c *Cache) Snapshot(fromOffset int64) (*Snapshot, error) { return c.Seq(0).Snapshot(fromOffset) }

// PrepareSnapshots schedules captures of sequence 0: see Sequence.PrepareSnapshots.
func (c *Cache) PrepareSnapshots(offsets ...int64) error {
	return c.Seq(0).PrepareSnapshots(offsets...)
}

// TakeSnapshots of sequence 0: see Sequence.TakeSnapshots.
func (c *Cache) TakeSnapshots() ([]*Snapshot, error) { return c.Seq(0).TakeSnapshots() }

// TakeReachedSnapshots of sequence 0: see Sequence.TakeReachedSnapshots.
func (c *Cache) TakeReachedSnapshots() ([]*Snapshot, error) { return c.Seq(0).TakeReachedSnapshots() }

// CancelSnapshots of sequence 0: see Sequence.CancelSnapshots.
func (c *Cache) CancelSnapshots() error { return c.Seq(0).CancelSnapshots() }

// Restore sequence 0: see Sequence.Restore.
func (c *Cache) Restore(s *Snapshot, target int64) (bool, error) { return c.Seq(0).Restore(s, target) }

// Merge joins adjacent snapshots parent then child. It consumes both, also on failure: they are
// closed afterwards. A nil input gives a nil result (the other input is dropped, as in C); a
// closed or already consumed one fails with ErrClosed; the same snapshot as both fails with an
// invalid-argument error (consumed once).
func (c *Cache) Merge(parent, child *Snapshot) (*Snapshot, error) {
	call := "Cache.Merge"
	if parent != nil && parent == child { // consumed once, as C does
		p, ok := parent.consume()
		C.kvsnap_snapshot_destroy(p)
		if !ok {
			return nil, closedError(call, "snapshot")
		}
		return nil, invalid(call, "parent and child are the same snapshot (it is consumed)")
	}
	pp, pok := parent.consume()
	cp, cok := child.consume()
	if !pok || !cok {
		C.kvsnap_snapshot_destroy(pp)
		C.kvsnap_snapshot_destroy(cp)
		return nil, closedError(call, "snapshot")
	}
	var out *C.kvsnap_snapshot
	err := c.use(call, func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status { return C.kvsnap_cache_merge(p, pp, cp, &out) })
	})
	if isClosed(err) { // C never saw them
		C.kvsnap_snapshot_destroy(pp)
		C.kvsnap_snapshot_destroy(cp)
	}
	return newSnapshot(out), err
}

// Split cuts a snapshot at offset at into before and after (either may be nil: nothing to
// hold). It consumes s, also on failure; a closed or already consumed s fails with ErrClosed.
func (c *Cache) Split(s *Snapshot, at int64) (before, after *Snapshot, err error) {
	call := "Cache.Split"
	sp, ok := s.consume()
	if !ok {
		return nil, nil, closedError(call, "snapshot")
	}
	var b, a *C.kvsnap_snapshot
	err = c.use(call, func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status { return C.kvsnap_cache_split(p, sp, C.int64_t(at), &b, &a) })
	})
	if isClosed(err) { // C never saw it
		C.kvsnap_snapshot_destroy(sp)
	}
	return newSnapshot(b), newSnapshot(a), err
}

func isClosed(err error) bool {
	e, ok := err.(*Error)
	return ok && e.Status == StatusClosed
}

// Sequence addresses one sequence of a cache serving many.
type Sequence struct {
	cache *Cache
	id    int32
}

// Seq addresses sequence id of the cache.
func (c *Cache) Seq(id int32) Sequence { return Sequence{c, id} }

// ID is the sequence's id.
func (s Sequence) ID() int32 { return s.id }

// Offset is the tokens the sequence holds.
func (s Sequence) Offset() (int64, error) {
	var out C.int64_t
	err := s.cache.use("Sequence.Offset", func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status { return C.kvsnap_cache_offset_seq(p, C.int32_t(s.id), &out) })
	})
	return int64(out), err
}

// ExposedBytes bounds what the sequence's writes may still copy into snapshots already taken
// (the lazy data they would overwrite).
func (s Sequence) ExposedBytes() (int64, error) {
	var out C.int64_t
	err := s.cache.use("Sequence.ExposedBytes", func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status { return C.kvsnap_cache_exposed_bytes_seq(p, C.int32_t(s.id), &out) })
	})
	return int64(out), err
}

// Reset drops the sequence's state and schedule (lazy snapshots of it are copied out first).
func (s Sequence) Reset() error {
	return s.cache.use("Sequence.Reset", func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status { return C.kvsnap_cache_reset_seq(p, C.int32_t(s.id)) })
	})
}

// Snapshot is a snapshot of [fromOffset, offset) (attention kinds) or of the whole state at the
// offset (the others); nil when there is nothing to hold (an empty range, or offset 0). While
// it shares the live cache's data it is lazy and owns no bytes.
func (s Sequence) Snapshot(fromOffset int64) (*Snapshot, error) {
	var out *C.kvsnap_snapshot
	err := s.cache.use("Sequence.Snapshot", func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status {
			return C.kvsnap_cache_snapshot_seq(p, C.int32_t(s.id), C.int64_t(fromOffset), &out)
		})
	})
	return newSnapshot(out), err
}

// PrepareSnapshots schedules captures as writes reach each offset (ascending, unique, >= the
// offset), also inside one forward.
func (s Sequence) PrepareSnapshots(offsets ...int64) error {
	var at *C.int64_t
	if len(offsets) > 0 {
		at = (*C.int64_t)(unsafe.Pointer(&offsets[0]))
	}
	return s.cache.use("Sequence.PrepareSnapshots", func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status {
			return C.kvsnap_cache_prepare_snapshots_seq(p, C.int32_t(s.id), at, C.size_t(len(offsets)))
		})
	})
}

// TakeSnapshots hands back one entry per scheduled offset, in order (nil for zero-width
// edges), and clears the schedule. Fails if an offset is unreached.
func (s Sequence) TakeSnapshots() ([]*Snapshot, error) {
	return s.take("Sequence.TakeSnapshots", func(p *C.kvsnap_cache, out **C.kvsnap_snapshot_list) C.kvsnap_status {
		return C.kvsnap_cache_take_snapshots_seq(p, C.int32_t(s.id), out)
	})
}

// TakeReachedSnapshots is TakeSnapshots for a forward cut short: the entries for the scheduled
// offsets already reached.
func (s Sequence) TakeReachedSnapshots() ([]*Snapshot, error) {
	return s.take("Sequence.TakeReachedSnapshots", func(p *C.kvsnap_cache, out **C.kvsnap_snapshot_list) C.kvsnap_status {
		return C.kvsnap_cache_take_reached_snapshots_seq(p, C.int32_t(s.id), out)
	})
}

func (s Sequence) take(call string, f func(*C.kvsnap_cache, **C.kvsnap_snapshot_list) C.kvsnap_status) ([]*Snapshot, error) {
	var list *C.kvsnap_snapshot_list
	err := s.cache.use(call, func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status { return f(p, &list) })
	})
	if err != nil {
		return nil, err
	}
	snapshots, err := takeList(list)
	if err != nil {
		return nil, applied(err, "kvsnap."+call+": the captures were taken from the cache and are lost")
	}
	return snapshots, nil
}

// CancelSnapshots drops the schedule and what it captured.
func (s Sequence) CancelSnapshots() error {
	return s.cache.use("Sequence.CancelSnapshots", func(p *C.kvsnap_cache) error {
		return check(func() C.kvsnap_status { return C.kvsnap_cache_cancel_snapshots_seq(p, C.int32_t(s.id)) })
	})
}

// Restore returns the sequence to target using snapshot (nil: a live rewind). It reports false,
// and changes nothing, when the target is unreachable. A paged cache splices the snapshot's
// blocks without copying them.
func (s Sequence) Restore(snapshot *Snapshot, target int64) (bool, error) {
	var restored C.bool
	err := snapshot.use("Sequence.Restore", func(sp *C.kvsnap_snapshot) error {
		return s.cache.use("Sequence.Restore", func(p *C.kvsnap_cache) error {
			return check(func() C.kvsnap_status {
				return C.kvsnap_cache_restore_seq(p, C.int32_t(s.id), sp, C.int64_t(target), &restored)
			})
		})
	})
	return bool(restored), err
}

// State is the sequence's live state: views of keys and values, or of conv and delta state
// (none before its first write; a paged cache's are copies). Read-only; views show the cache
// until its next update, restore or reset.
func (s Sequence) State() ([]*Array, error) {
	var out []*Array
	err := s.cache.use("Sequence.State", func(p *C.kvsnap_cache) error {
		var arrays [8]*C.kvsnap_array
		var count C.size_t
		if err := check(func() C.kvsnap_status {
			return C.kvsnap_cache_state_seq(p, C.int32_t(s.id), &arrays[0], C.size_t(len(arrays)), &count)
		}); err != nil {
			return err
		}
		for _, a := range arrays[:count] {
			out = append(out, newArray(a))
		}
		return nil
	})
	return out, err
}

// SnapshotSplits are a recurrent cache's split points scheduled for this sequence strictly
// inside its next forward of forwardLen tokens, relative to its offset: the forward puts one
// state per point, then the end state (RecurrentPut).
func (s Sequence) SnapshotSplits(forwardLen int64) ([]int64, error) {
	var out []int64
	err := s.cache.use("Sequence.SnapshotSplits", func(p *C.kvsnap_cache) error {
		splits := make([]int64, 16)
		for {
			var count C.size_t
			err := check(func() C.kvsnap_status {
				return C.kvsnap_recurrent_snapshot_splits_seq(p, C.int32_t(s.id), C.int64_t(forwardLen),
					(*C.int64_t)(unsafe.Pointer(&splits[0])), C.size_t(len(splits)), &count)
			})
			if err != nil && int(count) > len(splits) { // more points than room: C says how many
				splits = make([]int64, count)
				continue
			}
			if err == nil {
				out = splits[:count]
			}
			return err
		}
	})
	return out, err
}
