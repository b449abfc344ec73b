package kvsnap

import (
	"errors"
	"math/rand"
	"testing"
)

// Speculative decoding on slot 1 of the toy engine: each round verifies the last accepted token
// and k drafts in one forward, accepts a random number of them, and the next forward checks
// every layer — paged attention rewound, the window and the recurrent state restored from the
// verify forward's captures — against recomputation of the accepted tokens alone.
func TestSpeculationRollsEveryLayerBackExactly(t *testing.T) {
	e := newEngine(t, 2, 0)
	defer e.close(t)
	const slot = 1
	round, err := NewSpeculation([]*Cache{e.attention, nil, e.recurrent, e.windowed}, slot)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewSource(11))
	prompt := []int32{3, 1, 4, 1, 5, 9, 2, 6}
	session, err := e.prefix.BeginSlot(slot, prompt)
	if err != nil {
		t.Fatal(err)
	}
	toks := append([]int32{}, prompt...)
	e.forward(t, slot, toks, 0)
	if err := session.PrefillDone(); err != nil {
		t.Fatal(err)
	}
	last := int32(7) // the model's token after the prompt
	if err := round.Accept(0); !errors.Is(err, ErrContract) {
		t.Fatalf("Accept without a round: %v", err)
	}
	if err := round.Begin(2); err != nil { // a round given up before its forward
		t.Fatal(err)
	}
	if err := round.Cancel(); err != nil {
		t.Fatal(err)
	}
	if open, _, _, _ := round.Round(); open {
		t.Fatal("a cancelled round is still open")
	}
	accepted := int64(0)
	for r := 0; r < 12; r++ {
		if err := session.AppendOutput(last); err != nil {
			t.Fatal(err)
		}
		k := int64(1 + rng.Intn(4))
		if err := round.Begin(k); err != nil {
			t.Fatal(err)
		}
		if open, start, drafts, _ := round.Round(); !open || start != int64(len(toks)) || drafts != k {
			t.Fatalf("round %v at %d of %d drafts, want open at %d of %d", open, start, drafts, len(toks), k)
		}
		verify := append(append([]int32{}, toks...), last)
		for i := int64(0); i < k; i++ {
			verify = append(verify, int32(20+rng.Intn(20)))
		}
		e.forward(t, slot, verify, int64(len(toks)))
		a := int64(rng.Intn(int(k) + 1))
		if err := round.Accept(k + 1); !errors.Is(err, ErrContract) {
			t.Fatalf("accepting %d of %d drafts: %v", k+1, k, err)
		}
		if err := round.Accept(a); err != nil {
			t.Fatal(err)
		}
		accepted += a
		toks = verify[:len(toks)+1+int(a)]
		for _, c := range []*Cache{e.attention, e.recurrent, e.windowed} {
			if off, _ := c.Seq(slot).Offset(); off != int64(len(toks)) {
				t.Fatalf("%v stands at %d after accepting %d of %d, want %d", c.Kind(), off, a, k, len(toks))
			}
		}
		for _, d := range toks[len(toks)-int(a):] {
			if err := session.AppendOutput(d); err != nil {
				t.Fatal(err)
			}
		}
		last = int32(40 + rng.Intn(10)) // the verify forward's token after the accepted drafts
	}
	if err := session.AppendOutput(last); err != nil {
		t.Fatal(err)
	}
	e.forward(t, slot, append(toks, last), int64(len(toks))) // checks the state the last round left
	stats, _ := round.Stats()
	if stats.Rounds != 12 || stats.Accepted != accepted || stats.Restores == 0 || stats.Rewinds == 0 {
		t.Fatalf("stats %+v, accepted %d", stats, accepted)
	}
	if err := session.Close(); err != nil {
		t.Fatal(err)
	}
	round.Close()
	round.Close()
	if err := round.Begin(1); !errors.Is(err, ErrClosed) {
		t.Fatalf("Begin after Close: %v", err)
	}
}
