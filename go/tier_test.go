package kvsnap

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// tierProcess is one process's layer, tier and prefix cache over a shared store.
type tierProcess struct {
	cache  *Cache
	tier   *Tier
	prefix *PrefixCache
	mu     sync.Mutex
	lines  []string
}

func openTierProcess(t *testing.T, address string, key []byte) *tierProcess {
	t.Helper()
	p := &tierProcess{}
	var err error
	if p.cache, err = NewKVCache(); err != nil {
		t.Fatal(err)
	}
	p.tier, err = OpenTier(address, []*Cache{p.cache, nil}, TierOptions{
		ModelFingerprint: []byte("test model"), ChunkTokens: 4, Key: key,
		LookupTimeout: 5 * time.Second,
		Log: func(line string) { // the tier's writer thread logs too
			p.mu.Lock()
			defer p.mu.Unlock()
			p.lines = append(p.lines, line)
		}})
	if err != nil {
		t.Fatal(err)
	}
	if p.prefix, err = NewPrefixCache([]*Cache{p.cache, nil}, &PrefixOptions{Tier: p.tier}); err != nil {
		t.Fatal(err)
	}
	return p
}

func (p *tierProcess) close() {
	p.prefix.Close()
	p.tier.Close()
	p.cache.Close()
}

// serve runs prompt through a session (its keys the tokens' own, by position) and returns the
// tokens restored; the tier's writes are flushed before it returns (when the handle is open).
func (p *tierProcess) serve(t *testing.T, prompt []int32) int64 {
	t.Helper()
	session, err := p.prefix.Begin(prompt)
	if err != nil {
		t.Fatal(err)
	}
	cached, _ := session.Cached()
	remaining, _ := session.Remaining()
	write(t, p.cache, 0, remaining).Close()
	if err := session.PrefillDone(); err != nil {
		t.Fatal(err)
	}
	if err := session.Close(); err != nil {
		t.Fatal(err)
	}
	if drained, err := p.tier.Flush(10 * time.Second); err == nil && !drained {
		t.Fatal("the tier's writes did not drain")
	}
	return cached
}

// holds checks that the cache holds prompt's keys at their positions.
func (p *tierProcess) holds(t *testing.T, prompt []int32) {
	t.Helper()
	h, err := p.cache.View(UniformBatch(1, 1, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	read, done := keyReader(t, h)
	defer done()
	if h.Length != int64(len(prompt)) {
		t.Fatalf("the cache holds %d tokens, want %d", h.Length, len(prompt))
	}
	for c, tok := range prompt {
		if got, want := read(0, int64(c), 0), key(tok, int64(c), 0, 0); got != want {
			t.Fatalf("column %d holds %v, want %v", c, got, want)
		}
	}
}

func tierFolder(t *testing.T) string {
	folder := filepath.Join(t.TempDir(), "store")
	if err := os.Mkdir(folder, 0o700); err != nil {
		t.Fatal(err)
	}
	return "dir:" + folder
}

func TestASecondProcessRestoresThroughTheTier(t *testing.T) {
	address := tierFolder(t)
	prompt := make([]int32, 24)
	for i := range prompt {
		prompt[i] = int32(100 + i)
	}
	first := openTierProcess(t, address, nil)
	if got := first.serve(t, prompt[:20]); got != 0 {
		t.Fatalf("the first process restored %d tokens", got)
	}
	if first.tier.Address() != address || first.tier.Authenticated() {
		t.Fatalf("address %q, authenticated %v", first.tier.Address(), first.tier.Authenticated())
	}
	first.mu.Lock()
	if len(first.lines) != 1 || !strings.Contains(first.lines[0], "trusted") {
		t.Fatalf("log: %q", first.lines)
	}
	first.mu.Unlock()
	first.close()

	second := openTierProcess(t, address, nil)
	cached := second.serve(t, prompt[:22])
	if cached < 16 {
		t.Fatalf("restored %d tokens, want a restore point of the first process's (>= 16)", cached)
	}
	second.holds(t, prompt[:22])
	stats, err := second.tier.Stats()
	if err != nil || stats.Hits != 1 || stats.RestoredTokens != cached || stats.Rejected != 0 {
		t.Fatalf("stats %+v, %v", stats, err)
	}
	second.close()

	// A prefix cache holds the tier it was given, its log included: the Tier closed first, the
	// writes still go (flushed when the prefix cache closes), and a third process finds them.
	third := openTierProcess(t, address, nil)
	third.tier.Close()
	if _, err := third.tier.Stats(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Stats of a closed tier: %v", err)
	}
	if err := third.cache.Close(); err == nil {
		t.Fatal("a layer closed under the prefix cache holding it")
	}
	third.serve(t, prompt)
	third.close()
	fourth := openTierProcess(t, address, nil)
	if got := fourth.serve(t, prompt); got < 20 {
		t.Fatalf("restored %d tokens of what the third evaluated", got)
	}
	fourth.close()
}

func TestTierKeysAddressesAndRefusals(t *testing.T) {
	dir := t.TempDir()
	keyPath := filepath.Join(dir, "tier.key")
	if err := os.WriteFile(keyPath, []byte("0123456789abcdef0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	key, err := LoadTierKey(keyPath)
	if err != nil || string(key) != "0123456789abcdef0123456789abcdef" {
		t.Fatalf("key %q, %v", key, err)
	}
	keyed := openTierProcess(t, tierFolder(t), key)
	if !keyed.tier.Authenticated() {
		t.Fatal("a keyed tier is not authenticated")
	}
	keyed.close()
	if err := os.Chmod(keyPath, 0o644); err != nil {
		t.Fatal(err)
	}
	if refused, err := LoadTierKey(keyPath); !errors.Is(err, ErrContract) || !strings.Contains(err.Error(), "tier.key") || refused != nil {
		t.Fatalf("a key others may read: %q, %v", refused, err)
	}
	addressPath := filepath.Join(dir, "tier.address")
	if err := os.WriteFile(addressPath, []byte("redis://:s3cret@127.0.0.1:1/0\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	address, err := LoadTierAddress(addressPath)
	if err != nil || address != "redis://:s3cret@127.0.0.1:1/0" {
		t.Fatalf("address %q, %v", address, err)
	}
	unreachable := openTierProcess(t, address, nil) // port 1: refused
	if got := unreachable.tier.Address(); got != "redis://:***@127.0.0.1:1/0" {
		t.Fatalf("address %q", got)
	}
	unreachable.serve(t, []int32{1, 2, 3, 4, 5, 6}) // a failing store costs restores only
	unreachable.tier.Close()
	unreachable.tier.Close() // twice is fine
	unreachable.prefix.Close()
	unreachable.mu.Lock()
	if len(unreachable.lines) == 0 || strings.Contains(strings.Join(unreachable.lines, "\n"), "s3cret") {
		t.Fatalf("log: %q", unreachable.lines)
	}
	unreachable.mu.Unlock()
	unreachable.cache.Close()
	cache, _ := NewKVCache()
	defer cache.Close()
	if _, err := OpenTier(address, []*Cache{cache}, TierOptions{}); !errors.Is(err, ErrContract) ||
		!strings.Contains(err.Error(), "model fingerprint is empty") {
		t.Fatalf("no fingerprint: %v", err)
	}
	for _, d := range []time.Duration{-time.Millisecond, -time.Microsecond} {
		if _, err := OpenTier(address, []*Cache{cache}, TierOptions{ModelFingerprint: []byte("m"),
			LookupTimeout: d}); !errors.Is(err, ErrInvalidArgument) {
			t.Fatalf("a negative timeout %v: %v", d, err)
		}
	}
	// An empty key (an unset variable's) is refused: only nil opens a trusted store.
	if _, err := OpenTier(address, []*Cache{cache}, TierOptions{ModelFingerprint: []byte("m"),
		Key: []byte(os.Getenv("KVSNAP_NO_SUCH_VARIABLE"))}); !errors.Is(err, ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "Key is empty") {
		t.Fatalf("an empty key: %v", err)
	}
	if _, err := OpenTier("http://nowhere", []*Cache{cache}, TierOptions{ModelFingerprint: []byte("m")}); !errors.Is(err, ErrContract) {
		t.Fatalf("a malformed address: %v", err)
	}
	tier, _ := OpenTier(tierFolder(t), []*Cache{cache}, TierOptions{ModelFingerprint: []byte("m"), Log: func(string) {}})
	defer tier.Close()
	other, _ := NewKVCache()
	defer other.Close()
	if _, err := NewPrefixCache([]*Cache{other}, &PrefixOptions{Tier: tier}); !errors.Is(err, ErrContract) ||
		!strings.Contains(err.Error(), "other layers") {
		t.Fatalf("a tier of other layers: %v", err)
	}
}

func TestTierDurationsRoundUpToTheCUnit(t *testing.T) {
	for _, c := range []struct {
		d, unit time.Duration
		want    int64
	}{{500 * time.Microsecond, time.Millisecond, 1}, {0, time.Millisecond, 0},
		{-time.Millisecond, time.Millisecond, -1}, {-500 * time.Microsecond, time.Millisecond, -1},
		{-1500 * time.Millisecond, time.Second, -2}, {1500 * time.Millisecond, time.Second, 2},
		{time.Hour, time.Second, 3600}} {
		if got := units(c.d, c.unit); got != c.want {
			t.Errorf("units(%v, %v) = %d, want %d", c.d, c.unit, got, c.want)
		}
	}
	cache, _ := NewKVCache()
	defer cache.Close()
	if _, err := OpenTier(tierFolder(t), []*Cache{cache}, TierOptions{ModelFingerprint: []byte("m"),
		Tenant: "a\x00b"}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a tenant holding NUL: %v", err)
	}
}
