// A Go program outside the kvsnap tree, built against an installed kvsnap (ctest go_consumer):
// a second request over a shared prefix restores it instead of recomputing it.
package main

import (
	"fmt"
	"os"

	"kvsnap.dev/kvsnap"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
}

func run() error {
	layer, err := kvsnap.NewPagedKVCache(4)
	if err != nil {
		return err
	}
	defer layer.Close()
	prefix, err := kvsnap.NewPrefixCache([]*kvsnap.Cache{layer}, nil)
	if err != nil {
		return err
	}
	defer prefix.Close()
	restored := []int64{}
	for _, prompt := range [][]int32{{1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 3, 4, 5, 6, 9}} {
		session, err := prefix.Begin(prompt)
		if err != nil {
			return err
		}
		cached, _ := session.Cached()
		n := int64(len(prompt)) - cached
		keys, err := kvsnap.Zeros(kvsnap.F32, 1, 1, n, 8)
		if err != nil {
			return err
		}
		err = layer.Append(&kvsnap.Batch{Rows: 1, Length: n, Offsets: []int32{int32(cached)}}, keys, keys)
		keys.Close()
		if err != nil {
			return err
		}
		if err := session.PrefillDone(); err != nil {
			return err
		}
		if err := session.Close(); err != nil {
			return err
		}
		restored = append(restored, cached)
	}
	if restored[0] != 0 || restored[1] != 6 {
		return fmt.Errorf("restored %v tokens, want [0 6]", restored)
	}
	fmt.Println("go consumer: the second request restored 6 tokens")
	return nil
}
