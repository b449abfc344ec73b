package kvsnap

import (
	"errors"
	"math"
	"runtime"
	"testing"
	"time"
)

// attend is attention computed here: q [Hq, depth] of a query at position query over a
// sequence's keys and values key(toks[p], p, ...) and its negation, for p in [from, query].
func attend(q []float32, queryHeads int, toks []int32, from, query int64, scale float64) []float64 {
	out := make([]float64, queryHeads*depth)
	for h := 0; h < queryHeads; h++ {
		kh := h / (queryHeads / heads)
		scores := make([]float64, query+1)
		top := math.Inf(-1)
		for p := from; p <= query; p++ {
			s := 0.0
			for d := 0; d < depth; d++ {
				s += float64(q[h*depth+d]) * float64(key(toks[p], p, kh, d))
			}
			scores[p] = scale * s
			top = math.Max(top, scores[p])
		}
		sum := 0.0
		for p := from; p <= query; p++ {
			sum += math.Exp(scores[p] - top)
		}
		for p := from; p <= query; p++ {
			for d := 0; d < depth; d++ {
				out[h*depth+d] += math.Exp(scores[p]-top) / sum * -float64(key(toks[p], p, kh, d))
			}
		}
	}
	return out
}

func TestHistoriesInPlaceAndSDPA(t *testing.T) {
	c, err := NewPagedKVCache(4)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	prompt := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14}
	h := write(t, c, 0, prompt)
	if h.Form != Paged || h.Keys != nil || h.Length != 14 || h.Rows != 1 {
		t.Fatalf("a paged cache's history: %v, keys %v, %d columns, %d rows", h.Form, h.Keys, h.Length, h.Rows)
	}
	h.Close()
	if _, err := h.Paged(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Paged after Close: %v", err)
	}

	// A view holds the blocks in place; its contiguous form is a copy of its 14 columns.
	before := LiveBytes()
	view, err := c.View(UniformBatch(1, 1, 14))
	if err != nil {
		t.Fatal(err)
	}
	defer view.Close()
	if LiveBytes() != before {
		t.Fatalf("a view allocated %d bytes", LiveBytes()-before)
	}
	info, err := view.Paged()
	if err != nil || info.BlockTokens != 4 || len(info.Table) != 4 || info.Length != 14 || info.Chunks < 1 {
		t.Fatalf("Paged: %+v %v", info, err)
	}
	if _, _, err := view.PagedChunk(info.Chunks); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a chunk past the pool's: %v", err)
	}
	plain, err := view.Contiguous()
	if err != nil {
		t.Fatal(err)
	}
	if grew := LiveBytes() - before; grew != 14*heads*depth*2*4 || plain.Form != Contiguous || plain.Keys.Shape()[2] != 14 {
		t.Fatalf("contiguous copy: %d bytes, %v %v", grew, plain.Form, plain.Keys.Shape())
	}
	checkHistory(t, plain, prompt, 14)
	if _, err := plain.Paged(); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Paged of a contiguous history: %v", err)
	}
	plain.Close()

	// Sequence 1 restores 10 tokens, then decodes one while sequence 0 takes two: a ragged
	// history, one paged row per sequence.
	prefix, err := c.Seq(0).Snapshot(0)
	if err != nil {
		t.Fatal(err)
	}
	if ok, err := c.Seq(1).Restore(prefix, 10); !ok || err != nil {
		t.Fatalf("restore: %v %v", ok, err)
	}
	prefix.Close()
	seqs := [][]int32{append(append([]int32{}, prompt...), 20, 21), append(append([]int32{}, prompt[:10]...), 30)}
	rows := RowsBatch(Row{Seq: 1, Offset: 10, Tokens: []int32{30}}, Row{Seq: 0, Offset: 14, Tokens: []int32{20, 21}})
	data := make([]float32, 2*heads*2*depth)
	for h := 0; h < heads; h++ {
		for d := 0; d < depth; d++ {
			data[(0*heads+h)*2*depth+d] = key(30, 10, h, d)
			data[(1*heads+h)*2*depth+d] = key(20, 14, h, d)
			data[(1*heads+h)*2*depth+depth+d] = key(21, 15, h, d)
		}
	}
	keys, _ := FromFloat32([]int64{2, heads, 2, depth}, data)
	for i := range data {
		data[i] = -data[i]
	}
	values, _ := FromFloat32([]int64{2, heads, 2, depth}, data)
	defer keys.Close()
	defer values.Close()
	ragged, err := c.Update(rows, keys, values)
	if err != nil {
		t.Fatal(err)
	}
	defer ragged.Close()
	if ragged.Form != Ragged || ragged.Rows != 2 || ragged.Length != 16 {
		t.Fatalf("ragged: %v, %d rows, %d columns", ragged.Form, ragged.Rows, ragged.Length)
	}
	if _, err := ragged.Contiguous(); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Contiguous of a ragged history: %v", err)
	}
	if _, err := ragged.Row(2); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("row 2 of 2: %v", err)
	}
	for b, want := range []int64{11, 16} {
		row, err := ragged.Row(int64(b))
		if err != nil || row.Form != Paged || row.Length != want {
			t.Fatalf("row %d: %v %v", b, row, err)
		}
		checkHistory(t, row, [][]int32{seqs[1], seqs[0]}[b], want)
		row.Close()
	}

	// Attention over it, causal, against attention computed here; two threads give the same bits.
	const queryHeads, scale = 4, 1e-4
	qData := make([]float32, 2*queryHeads*2*depth)
	for i := range qData {
		qData[i] = float32(math.Cos(0.3 * float64(i)))
	}
	q, _ := FromFloat32([]int64{2, queryHeads, 2, depth}, qData)
	defer q.Close()
	out, err := SDPA(rows, q, ragged, Mask{Causal: true}, scale)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	got, strides, _ := out.Float32s()
	for b, r := range []struct {
		toks          []int32
		offset, count int64
	}{{seqs[1], 10, 1}, {seqs[0], 14, 2}} {
		for l := int64(0); l < r.count; l++ {
			query := make([]float32, queryHeads*depth)
			for h := 0; h < queryHeads; h++ {
				for d := 0; d < depth; d++ {
					query[h*depth+d] = qData[((b*queryHeads+h)*2+int(l))*depth+d]
				}
			}
			want := attend(query, queryHeads, r.toks, 0, r.offset+l, scale)
			for h := 0; h < queryHeads; h++ {
				for d := 0; d < depth; d++ {
					g := float64(got[int64(b)*strides[0]+int64(h)*strides[1]+l*strides[2]+int64(d)*strides[3]])
					if w := want[h*depth+d]; math.Abs(g-w) > 1e-5*math.Abs(w)+1e-3 {
						t.Fatalf("row %d query %d head %d d %d: %v, recomputed %v", b, l, h, d, g, w)
					}
				}
			}
		}
	}
	if err := SetThreads(2); err != nil {
		t.Fatal(err)
	}
	two, err := SDPA(rows, q, ragged, Mask{Causal: true}, scale)
	if threads := Threads(); threads != 2 {
		t.Fatalf("Threads() = %d after SetThreads(2)", threads)
	}
	if err := SetThreads(1); err != nil {
		t.Fatal(err)
	}
	defer two.Close()
	again, _, _ := two.Float32s()
	for i := range got {
		if got[i] != again[i] {
			t.Fatalf("element %d: %v on one thread, %v on two", i, got[i], again[i])
		}
	}
	if err := SetThreads(0); !errors.Is(err, ErrContract) {
		t.Fatalf("SetThreads(0): %v", err)
	}
	if _, err := SDPA(rows, q, ragged, Mask{Lookback: -1}, scale); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a negative lookback: %v", err)
	}
	if _, err := SDPA(rows, q, nil, Mask{}, scale); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("SDPA over a nil history: %v", err)
	}
	if _, err := SDPA(nil, q, ragged, Mask{}, scale); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a nil batch: %v", err)
	}
}

// Keys taken out of a history outlive it: the history's finalizer frees only the C history.
func TestKeysOutliveTheirHistory(t *testing.T) {
	c, err := NewKVCache()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	keys := func() *Array {
		h := write(t, c, 0, []int32{1, 2, 3})
		return h.Keys // h unreachable from here on
	}()
	for i := 0; i < 10; i++ { // finalizers run on their own goroutine, after a collection
		runtime.GC()
		time.Sleep(10 * time.Millisecond)
	}
	data, _, err := keys.Float32s()
	if err != nil || data[0] != key(1, 0, 0, 0) {
		t.Fatalf("keys after their history was collected: %v %v", err, data)
	}
	keys.Close()
}

// SDPA with the history's own keys as queries, racing the history's Close: one order of locks.
func TestSDPARacingCloseDoesNotDeadlock(t *testing.T) {
	c, err := NewKVCache()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	write(t, c, 0, []int32{1, 2, 3}).Close()
	batch := UniformBatch(1, 3, 0)
	for i := 0; i < 20000; i++ {
		h, err := c.View(batch)
		if err != nil {
			t.Fatal(err)
		}
		start, done := make(chan struct{}), make(chan struct{}, 2)
		go func() {
			<-start
			if out, err := SDPA(batch, h.Keys, h, Mask{Causal: true}, 0.5); err == nil {
				out.Close()
			}
			done <- struct{}{}
		}()
		go func() {
			<-start
			h.Close()
			done <- struct{}{}
		}()
		close(start)
		for k := 0; k < 2; k++ {
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				t.Fatalf("round %d: SDPA and Close deadlocked", i)
			}
		}
	}
}
