package kvsnap

import (
	"fmt"
	"testing"
)

// A decode step's write to one paged layer at a long context, the history taken in place (what
// Update hands back) or gathered into plain arrays (what Contiguous makes, and what the C
// API's kvsnap_cache_update hands back for a paged cache): the first is independent of the
// context, the second copies all of it.
//
//	go test -run XX -bench PagedDecodeStep .
func BenchmarkPagedDecodeStep(b *testing.B) {
	for _, context := range []int64{1024, 8192} {
		for _, gathered := range []bool{false, true} {
			name := fmt.Sprintf("context=%d/in-place", context)
			if gathered {
				name = fmt.Sprintf("context=%d/gathered", context)
			}
			b.Run(name, func(b *testing.B) { benchmarkDecodeStep(b, context, gathered) })
		}
	}
}

func benchmarkDecodeStep(b *testing.B, context int64, gathered bool) {
	const kvHeads, headDim = 8, 128
	c, err := NewPagedKVCache(16)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	prompt, _ := Zeros(F32, 1, kvHeads, context, headDim)
	defer prompt.Close()
	if err := c.Append(UniformBatch(1, context, 0), prompt, prompt); err != nil {
		b.Fatal(err)
	}
	prefix, err := c.Seq(0).Snapshot(0)
	if err != nil {
		b.Fatal(err)
	}
	defer prefix.Close()
	token, _ := Zeros(F32, 1, kvHeads, 1, headDim)
	defer token.Close()
	batch := UniformBatch(1, 1, context)
	b.ReportAllocs()
	if gathered { // MB/s: the copy's speed, against a memcpy's on the same machine
		b.SetBytes(context * kvHeads * headDim * 2 * 4) // the history's keys and values
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		h, err := c.Update(batch, token, token)
		if err != nil {
			b.Fatal(err)
		}
		if gathered {
			plain, err := h.Contiguous()
			if err != nil {
				b.Fatal(err)
			}
			plain.Close()
		}
		h.Close()
		b.StopTimer()
		if ok, err := c.Seq(0).Restore(prefix, context); !ok || err != nil { // back to the context
			b.Fatal(ok, err)
		}
		b.StartTimer()
	}
}
