package kvsnap

/*
#include "batch.h"

static kvsnap_status go_sdpa(KVSNAP_GO_BATCH_ARGS, const kvsnap_array* q,
                             const kvsnap_history* history, bool masked, bool causal,
                             int64_t lookback, const kvsnap_array* mask_array, float scale,
                             kvsnap_array** out) {
  KVSNAP_GO_BATCH;
  const kvsnap_attention_mask mask = {.causal = causal, .lookback = lookback, .array = mask_array};
  return kvsnap_sdpa(&batch, q, history, masked ? &mask : NULL, scale, out);
}
*/
import "C"

import (
	"fmt"
	"math"
	"runtime"
	"sync"
	"unsafe"
)

// HistoryForm is how a history holds its keys and values (kvsnap_history_form).
type HistoryForm int

const (
	// Contiguous: Keys [B, H, K, D] and Values [B, H, K, Dv], views of the cache's buffers.
	Contiguous HistoryForm = C.KVSNAP_HISTORY_CONTIGUOUS
	// Paged: one sequence's columns in the blocks of a paged cache (Paged, PagedChunk).
	Paged HistoryForm = C.KVSNAP_HISTORY_PAGED
	// Ragged: one history per batch row, for a batch of several rows (Row).
	Ragged HistoryForm = C.KVSNAP_HISTORY_RAGGED
)

func (f HistoryForm) String() string {
	switch f {
	case Contiguous:
		return "Contiguous"
	case Paged:
		return "Paged"
	case Ragged:
		return "Ragged"
	}
	return fmt.Sprintf("HistoryForm(%d)", int(f))
}

// History is what an attention cache hands back, as the cache holds it: nothing is copied. It
// shows the cache as it was at the call: read it before the next write to that cache, which may
// reuse a block or wrap a window's ring. Column c holds position FirstPosition + (c -
// OldestColumn) mod Length; Window > 0 hides keys Window or more positions before a query.
// SDPA attends over any form; Contiguous gives plain arrays (a copy of a paged history). A
// History may be read from several goroutines at once; Close waits for them.
type History struct {
	Form         HistoryForm
	Keys, Values *Array // the Contiguous form's keys and values (views); nil for the others, and when the cache has no layout yet (nothing written)
	Length       int64  // key columns (Ragged: the longest row's)
	Rows         int64  // Ragged: the batch's rows; otherwise 1
	// FirstPosition, OldestColumn and Window describe one sequence's columns: 0 for the Ragged
	// form, whose rows each have their own (SDPA applies them; do not build a mask from these).
	FirstPosition int64
	OldestColumn  int64
	Window        int64

	mu  sync.RWMutex
	ptr *C.kvsnap_history
}

// newHistory adopts a C history (freeing it on failure), its contiguous arrays taken as views.
func newHistory(call string, ptr *C.kvsnap_history) (*History, error) {
	var info C.kvsnap_history_info
	if err := check(func() C.kvsnap_status { return C.kvsnap_history_get_info(ptr, &info) }); err != nil {
		C.kvsnap_history_destroy(ptr)
		return nil, err
	}
	h := &History{Form: HistoryForm(info.form), Length: int64(info.length), Rows: int64(info.rows),
		FirstPosition: int64(info.first_position), OldestColumn: int64(info.oldest_column),
		Window: int64(info.window), ptr: ptr}
	if h.Form == Contiguous {
		var plain C.kvsnap_kv_history
		if err := handOut(call, func() C.kvsnap_status { return C.kvsnap_history_arrays(ptr, &plain) }); err != nil {
			C.kvsnap_history_destroy(ptr)
			return nil, err
		}
		h.Keys, h.Values = newArray(plain.keys), newArray(plain.values)
	}
	runtime.SetFinalizer(h, (*History).free)
	return h, nil
}

// Close releases the history and its Keys and Values. Safe to call twice.
func (h *History) Close() {
	if h == nil {
		return
	}
	h.free()
	// Outside the history's lock: a call holding an array's lock that waits for the history's
	// (SDPA with q = h.Keys) would otherwise deadlock against this.
	h.Keys.Close()
	h.Values.Close()
}

// free releases the C history only (the finalizer's part): Keys and Values the caller took out
// live on, closed by their own Close or finalizers.
func (h *History) free() {
	h.mu.Lock()
	defer h.mu.Unlock()
	C.kvsnap_history_destroy(h.ptr)
	h.ptr = nil
}

func (h *History) use(call string, f func(*C.kvsnap_history) error) error {
	if h == nil {
		return closedError(call, "history")
	}
	h.mu.RLock()
	defer h.mu.RUnlock()
	if h.ptr == nil {
		return closedError(call, "history")
	}
	return f(h.ptr)
}

// Row is a Ragged history's row b as a history of its own (another form's row 0 is itself, as
// a new History).
func (h *History) Row(b int64) (*History, error) {
	call := "History.Row"
	var out *C.kvsnap_history
	err := h.use(call, func(p *C.kvsnap_history) error {
		return check(func() C.kvsnap_status { return C.kvsnap_history_row(p, C.int64_t(b), &out) })
	})
	if err != nil {
		return nil, err
	}
	return newHistory(call, out)
}

// split is the history's rows, each its own History; h is closed.
func (h *History) split(call string) ([]*History, error) {
	if h.Form != Ragged {
		return []*History{h}, nil
	}
	defer h.Close()
	rows := make([]*History, h.Rows)
	for b := range rows {
		row, err := h.Row(int64(b))
		if err != nil {
			for _, r := range rows[:b] {
				r.Close()
			}
			return nil, err
		}
		rows[b] = row
	}
	return rows, nil
}

// Contiguous is the history in Contiguous form (plain Keys and Values): itself, as a new
// History, for a Contiguous one; a copy of a Paged one (its columns gathered); a Ragged one is
// refused (take its rows).
func (h *History) Contiguous() (*History, error) {
	call := "History.Contiguous"
	var out *C.kvsnap_history
	err := h.use(call, func(p *C.kvsnap_history) error {
		return check(func() C.kvsnap_status { return C.kvsnap_history_contiguous(p, &out) })
	})
	if err != nil {
		return nil, err
	}
	return newHistory(call, out)
}

// PagedInfo is a Paged history's blocks: column k of the sequence is in slot k % BlockTokens of
// block Table[k / BlockTokens]; block i holds columns [r*T, (r+1)*T) of chunk
// i / BlocksPerChunk, where r = i % BlocksPerChunk and T = BlockTokens (PagedChunk).
type PagedInfo struct {
	BlockTokens    int64
	BlocksPerChunk int64
	Length         int64   // columns; the last block may be partly used
	Table          []int32 // block ids in position order (a copy)
	Chunks         int     // the pool's chunks the table may name
}

// Paged is a Paged history's block table, for an engine's own paged attention.
func (h *History) Paged() (PagedInfo, error) {
	var info PagedInfo
	err := h.use("History.Paged", func(p *C.kvsnap_history) error {
		var c C.kvsnap_paged_info
		if err := check(func() C.kvsnap_status { return C.kvsnap_history_get_paged(p, &c) }); err != nil {
			return err
		}
		info = PagedInfo{BlockTokens: int64(c.block_tokens), BlocksPerChunk: int64(c.blocks_per_chunk),
			Length: int64(c.length), Table: make([]int32, c.table_size), Chunks: int(c.chunks)}
		if c.table_size > 0 {
			copy(info.Table, unsafe.Slice((*int32)(unsafe.Pointer(c.table)), c.table_size))
		}
		return nil
	})
	return info, err
}

// PagedChunk is chunk i of a Paged history's pool: keys [1, H, BlocksPerChunk*T, D] and values
// [1, H, BlocksPerChunk*T, Dv] (views, read-only).
func (h *History) PagedChunk(i int) (keys, values *Array, err error) {
	if i < 0 {
		return nil, nil, invalid("History.PagedChunk", "chunk %d is negative", i)
	}
	var k, v *C.kvsnap_array
	err = h.use("History.PagedChunk", func(p *C.kvsnap_history) error {
		return check(func() C.kvsnap_status { return C.kvsnap_history_paged_chunk(p, C.size_t(i), &k, &v) })
	})
	return newArray(k), newArray(v), err
}

// Mask says which keys each query may see: every rule set applies; the zero Mask shows every
// key. Positions are absolute.
type Mask struct {
	Causal   bool   // no key after the query
	Lookback int64  // > 0: no key Lookback or more positions before the query
	Array    *Array // or nil: [B|1, Hq|1, L, P] by batch row, query head, query and key position;
	// I32 is boolean (nonzero: visible), a float array an additive bias (-Inf: hidden)
}

// SDPA is reference scaled-dot-product attention in f32: q [B, Hq, L, D] over h in any form (a
// paged history read in place), grouped-query when Hq is a multiple of the history's H. The
// result is f32 [B, Hq, L, Dv]: softmax(scale * q·keys + mask) · values, the mask being m with
// the history's own window; a query that sees no key gets zeros. Bitwise the same for every
// SetThreads count.
func SDPA(b *Batch, q *Array, h *History, m Mask, scale float32) (*Array, error) {
	call := "SDPA"
	if h == nil { // a missing history, as a missing q is (not a closed one)
		return nil, invalid(call, "the history is nil")
	}
	cb, err := b.c(call)
	if err != nil {
		return nil, err
	}
	arrays, unlock, err := cArrays(call, q, m.Array)
	if err != nil {
		return nil, err
	}
	defer unlock()
	var out *C.kvsnap_array
	err = h.use(call, func(p *C.kvsnap_history) error {
		return check(func() C.kvsnap_status {
			return C.go_sdpa(cb.rows, cb.length, cb.ids, cb.offsets, cb.lens, cb.seqs, arrays[0], p,
				C.bool(m != Mask{}), C.bool(m.Causal), C.int64_t(m.Lookback), arrays[1], C.float(scale), &out)
		})
	})
	if err != nil {
		return nil, err
	}
	return newArray(out), nil
}

// SetThreads sets the threads SDPA runs on, the calling one included (1 to 256; 1 by default).
// Process-wide.
func SetThreads(n int) error {
	if n < math.MinInt32 || n > math.MaxInt32 {
		return contract("SetThreads", "%d threads outside [1, 256]", n)
	}
	return check(func() C.kvsnap_status { return C.kvsnap_set_threads(C.int(n)) })
}

// Threads is the threads SDPA runs on.
func Threads() int { return int(C.kvsnap_threads()) }
