package kvsnap_test

import (
	"fmt"

	"kvsnap.dev/kvsnap"
)

// An engine's attention layer behind a prefix cache: the second request shares the first's
// prefix and evaluates only what is new.
func Example() {
	layer, _ := kvsnap.NewKVCache()
	defer layer.Close()
	prefix, _ := kvsnap.NewPrefixCache([]*kvsnap.Cache{layer}, nil)
	defer prefix.Close()

	for _, prompt := range [][]int32{{1, 2, 3, 4, 5, 6}, {1, 2, 3, 4, 9}} {
		session, err := prefix.Begin(prompt)
		if err != nil {
			panic(err)
		}
		cached, _ := session.Cached()
		remaining, _ := session.Remaining()
		// The model's forward over the remaining tokens writes each layer's keys and values
		// [batch, heads, tokens, depth], filled in place in C memory.
		n := int64(len(remaining))
		keys, _ := kvsnap.Zeros(kvsnap.F32, 1, 2, n, 4)
		data, _, _ := keys.Float32s()
		for i := range data {
			data[i] = float32(i)
		}
		history, err := layer.Update(&kvsnap.Batch{Rows: 1, Length: n, Offsets: []int32{int32(cached)}}, keys, keys)
		if err != nil {
			panic(err)
		}
		fmt.Printf("prompt of %d: %d restored, %d evaluated, attending to %d keys\n",
			len(prompt), cached, n, history.Keys.Shape()[2])
		history.Close()
		keys.Close()
		session.PrefillDone()
		session.AppendOutput(42) // the model's reply token
		session.Close()
	}
	// Output:
	// prompt of 6: 0 restored, 6 evaluated, attending to 6 keys
	// prompt of 5: 4 restored, 1 evaluated, attending to 5 keys
}

// Errors carry the library's message: the call, the values and the rule. Nothing changes.
func ExampleError() {
	cache, _ := kvsnap.NewKVCache()
	defer cache.Close()
	keys, _ := kvsnap.Zeros(kvsnap.F32, 1, 1, 1, 4)
	defer keys.Close()
	err := cache.Append(&kvsnap.Batch{Rows: 1, Length: 1, Offsets: []int32{5}}, keys, keys)
	fmt.Println(err)
	offset, _ := cache.Offset()
	fmt.Println("offset:", offset)
	// Output:
	// KVCache::update: row 0 starts at 5 with 1 tokens; its sequence 0 is at offset 0 (every row must start at its sequence's offset)
	// offset: 0
}
