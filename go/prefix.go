package kvsnap

/*
#include <stdlib.h>
#include <kvsnap/kvsnap_c_tier.h>
*/
import "C"

import (
	"runtime"
	"sync"
	"unsafe"
)

// PrefixOptions configure a PrefixCache.
type PrefixOptions struct {
	// Budget for the bytes the trie's snapshots own; <= 0: the library's default.
	MaxPagedOutBytes int64
	// Sequences of the layers served at once, one session each; <= 0: 1.
	Slots int32
	// A Tier opened for the same layers, asked on a miss and written behind; nil: none. The
	// prefix cache holds it until it is closed.
	Tier *Tier
}

// PrefixStats count what a PrefixCache did.
type PrefixStats struct {
	Lookups          int64 // Begin calls that opened a session
	MatchedTokens    int64 // prompt tokens found in the trie
	ReusedTokens     int64 // tokens restored instead of evaluated
	EvictedNodes     int64 // trie nodes evicted under the budget
	DroppedSnapshots int64 // whole-state snapshots dropped from the active path
	PagedOutBytes    int64 // bytes owned by snapshots in the trie
	NodeCount        int64 // trie nodes, the root excluded
	// Nodes the last Load found in the file, before its budget evicted any (EvictedNodes counts
	// those, never read); 0 before any load. This and PeakPagedOutBytes are read just after the
	// fields above (a Load or ResetPeak on another goroutine may come between).
	LoadedNodes int64
	// The most bytes the trie's snapshots held at any instant since the cache was made or
	// ResetPeak last ran: what MaxPagedOutBytes bounds.
	PeakPagedOutBytes int64
}

// PrefixCache is a compressed token trie whose nodes hold snapshots of a model's layers: a
// request that shares a prefix with an earlier one restores state instead of recomputing it,
// for every layer kind. It drives the layers' offsets from its creation on. Begin, BeginSlot,
// Match, Stats and ResetPeak may be called from several goroutines at once; each slot runs one
// session at a time.
type PrefixCache struct {
	mu     sync.RWMutex
	ptr    *C.kvsnap_prefix_cache
	layers []*Cache // held: they must outlive the C object (and Close refuses while held)
	// The log of the Tier given (nil: none, or it logs to stderr), held while the C object
	// holds the C tier.
	tierLog *tierLog
}

// NewPrefixCache is a prefix cache over the model's layers, in order (a nil entry is a
// stateless layer). The layers cannot be closed until the prefix cache is. options may be nil.
func NewPrefixCache(layers []*Cache, options *PrefixOptions) (*PrefixCache, error) {
	call := "NewPrefixCache"
	ptrs, release, err := borrow(call, layers)
	if err != nil {
		return nil, err
	}
	var opts *C.kvsnap_prefix_options
	var tier *Tier
	if options != nil {
		opts = &C.kvsnap_prefix_options{max_paged_out_bytes: C.int64_t(options.MaxPagedOutBytes),
			slots: C.int32_t(options.Slots)}
		tier = options.Tier
	}
	var out *C.kvsnap_prefix_cache
	create := func(t *C.kvsnap_tier) error {
		return check(func() C.kvsnap_status {
			return C.kvsnap_prefix_cache_create_with_tier(&ptrs[0], C.size_t(len(layers)), opts, t, &out)
		})
	}
	var log *tierLog
	if tier != nil {
		err = tier.use(call, func(t *C.kvsnap_tier) error {
			if err := create(t); err != nil {
				return err
			}
			log = tier.log
			log.hold() // the C prefix cache holds the C tier, which may log, until it goes
			return nil
		})
	} else {
		err = create(nil)
	}
	if err != nil {
		release(true)
		return nil, err
	}
	release(false)
	p := &PrefixCache{ptr: out, layers: append([]*Cache{}, layers...), tierLog: log}
	runtime.SetFinalizer(p, (*PrefixCache).Close)
	return p, nil
}

// borrow marks the layers as held (Cache.Close refuses) and returns their handles (one extra
// nil entry, so the slice is never empty); release(true) undoes the marks.
func borrow(call string, layers []*Cache) ([]*C.kvsnap_cache, func(undo bool), error) {
	held := distinct(layers)
	for _, c := range held {
		c.mu.RLock() // Close takes the write lock: no cache closes while it is being marked
	}
	defer func() {
		for _, c := range held {
			c.mu.RUnlock()
		}
	}()
	ptrs := make([]*C.kvsnap_cache, len(layers)+1)
	for i, c := range layers {
		if c == nil {
			continue
		}
		if c.ptr == nil {
			return nil, nil, closedError(call, "cache")
		}
		ptrs[i] = c.ptr
	}
	for _, c := range held {
		c.borrowers.Add(1)
	}
	return ptrs, func(undo bool) {
		if undo {
			unborrow(held)
		}
	}, nil
}

func unborrow(layers []*Cache) {
	for _, c := range distinct(layers) {
		c.borrowers.Add(-1)
	}
}

// Close frees the prefix cache, after the calls in flight on it and its sessions; its open
// sessions are detached (their calls then fail with ErrContract). Safe to call twice. No
// forward over an open session's Remaining may still run (Cache calls are not waited for, and
// detaching cancels the session's captures on the layers).
func (p *PrefixCache) Close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ptr == nil {
		return
	}
	C.kvsnap_prefix_cache_destroy(p.ptr)
	p.ptr = nil
	unborrow(p.layers)
	p.layers = nil
	p.tierLog.release()
	p.tierLog = nil
}

func (p *PrefixCache) use(call string, f func(*C.kvsnap_prefix_cache) error) error {
	if p == nil {
		return closedError(call, "prefix cache")
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.ptr == nil {
		return closedError(call, "prefix cache")
	}
	return f(p.ptr)
}

func tokens(prompt []int32) *C.int32_t { return int32s(prompt) }

// Begin starts a request for prompt (at least one token) on slot 0: the layers are restored to
// the longest cached prefix, and the Session says which tokens the model must still evaluate.
func (p *PrefixCache) Begin(prompt []int32) (*Session, error) { return p.BeginSlot(0, prompt) }

// BeginSlot starts a request on slot (the layers' sequence slot), restoring from the trie or
// from another slot's live state, whichever holds more of the prompt.
func (p *PrefixCache) BeginSlot(slot int32, prompt []int32) (*Session, error) {
	var out *C.kvsnap_session
	err := p.use("PrefixCache.BeginSlot", func(ptr *C.kvsnap_prefix_cache) error {
		return check(func() C.kvsnap_status {
			return C.kvsnap_prefix_cache_begin_slot(ptr, C.int32_t(slot), tokens(prompt), C.size_t(len(prompt)), &out)
		})
	})
	if err != nil {
		return nil, err
	}
	s := &Session{ptr: out, prefix: p}
	runtime.SetFinalizer(s, (*Session).free)
	return s, nil
}

// Match is how many prompt tokens BeginSlot would restore on slot as things stand (slot < 0:
// from the trie alone). It changes nothing: for schedulers choosing where to run a request.
func (p *PrefixCache) Match(slot int32, prompt []int32) (int64, error) {
	var out C.int64_t
	err := p.use("PrefixCache.Match", func(ptr *C.kvsnap_prefix_cache) error {
		return check(func() C.kvsnap_status {
			return C.kvsnap_prefix_cache_match(ptr, C.int32_t(slot), tokens(prompt), C.size_t(len(prompt)), &out)
		})
	})
	return int64(out), err
}

// Stats counts what the prefix cache did.
func (p *PrefixCache) Stats() (PrefixStats, error) {
	var s C.kvsnap_prefix_stats
	var loaded, peak C.int64_t
	// Three reads, each at one instant (the C struct cannot grow): the peak last, so that it is at
	// least PagedOutBytes unless a ResetPeak runs in between.
	err := p.use("PrefixCache.Stats", func(ptr *C.kvsnap_prefix_cache) error {
		return check(func() C.kvsnap_status {
			if status := C.kvsnap_prefix_cache_get_stats(ptr, &s); status != C.KVSNAP_OK {
				return status
			}
			if status := C.kvsnap_prefix_cache_loaded_nodes(ptr, &loaded); status != C.KVSNAP_OK {
				return status
			}
			return C.kvsnap_prefix_cache_peak_paged_out_bytes(ptr, &peak)
		})
	})
	if err != nil {
		return PrefixStats{}, err
	}
	return PrefixStats{int64(s.lookups), int64(s.matched_tokens), int64(s.reused_tokens),
		int64(s.evicted_nodes), int64(s.dropped_snapshots), int64(s.paged_out_bytes), int64(s.node_count),
		int64(loaded), int64(peak)}, nil
}

// ResetPeak starts a new measurement of PrefixStats.PeakPagedOutBytes from the bytes held now.
func (p *PrefixCache) ResetPeak() error {
	return p.use("PrefixCache.ResetPeak", func(ptr *C.kvsnap_prefix_cache) error {
		return check(func() C.kvsnap_status { return C.kvsnap_prefix_cache_reset_peak(ptr) })
	})
}

// Check returns nil when the trie's invariants hold, else an error naming the first violation.
func (p *PrefixCache) Check() error {
	return p.use("PrefixCache.Check", func(ptr *C.kvsnap_prefix_cache) error {
		return check(func() C.kvsnap_status { return C.kvsnap_prefix_cache_check(ptr) })
	})
}

// SaveOptions say how a save writes its file.
type SaveOptions struct {
	// Shared writes mode 0644 instead of 0600, so the other users of a shared folder can load
	// it (with LoadOptions.AllowShared) — and read what it holds. The folders a save creates
	// stay 0700: make a shared folder yourself. Without it, a save refuses (writing nothing) a
	// folder that another user owns or that group or others can write, as a load would.
	Shared bool
}

// LoadOptions say which files a load trusts.
type LoadOptions struct {
	// AllowShared trusts a file, or the folder holding it, that another user owns or that group
	// or others can write — and every user who can write it. By default those are refused:
	// whoever can write them can plant state the model then continues from.
	AllowShared bool
}

func (o SaveOptions) flags() C.uint32_t {
	if o.Shared {
		return C.KVSNAP_SAVE_SHARED
	}
	return C.KVSNAP_FILE_PRIVATE
}

func (o LoadOptions) flags() C.uint32_t {
	if o.AllowShared {
		return C.KVSNAP_LOAD_ALLOW_SHARED
	}
	return C.KVSNAP_FILE_PRIVATE
}

// Save writes the trie and its snapshots to folder dir with modelID, atomically, private to
// this user (mode 0600). It refuses, writing nothing, a dir that Load would refuse (another user
// owns it, group or others can write it): SaveWith with SaveOptions.Shared saves there.
func (p *PrefixCache) Save(dir, modelID string) error {
	return p.SaveWith(dir, modelID, SaveOptions{})
}

// SaveWith is Save with options (a file other users can read: SaveOptions.Shared).
func (p *PrefixCache) SaveWith(dir, modelID string, opts SaveOptions) error {
	cdir, cmodel, err := dirAndModel("PrefixCache.Save", dir, modelID)
	if err != nil {
		return err
	}
	defer C.free(unsafe.Pointer(cdir))
	defer C.free(unsafe.Pointer(cmodel))
	return p.use("PrefixCache.Save", func(ptr *C.kvsnap_prefix_cache) error {
		return check(func() C.kvsnap_status {
			return C.kvsnap_prefix_cache_save_with(ptr, cdir, cmodel, opts.flags())
		})
	})
}

// Load replaces the trie by the one saved in dir for the same layers and modelID. It refuses a
// dir or file that is not private to this user.
func (p *PrefixCache) Load(dir, modelID string) error {
	return p.LoadWith(dir, modelID, LoadOptions{})
}

// LoadWith is Load with options (a shared folder: LoadOptions.AllowShared).
func (p *PrefixCache) LoadWith(dir, modelID string, opts LoadOptions) error {
	cdir, cmodel, err := dirAndModel("PrefixCache.Load", dir, modelID)
	if err != nil {
		return err
	}
	defer C.free(unsafe.Pointer(cdir))
	defer C.free(unsafe.Pointer(cmodel))
	return p.use("PrefixCache.Load", func(ptr *C.kvsnap_prefix_cache) error {
		return check(func() C.kvsnap_status {
			return C.kvsnap_prefix_cache_load_with(ptr, cdir, cmodel, opts.flags())
		})
	})
}

// SavedIn says whether dir holds a saved trie that Load would not refuse as not private (Load
// then says why); the load still checks the model id and the layers.
func SavedIn(dir string) bool {
	return SavedInWith(dir, LoadOptions{})
}

// SavedInWith says whether dir holds a saved trie that LoadWith with opts would not refuse as
// not private (the load still checks the model id and the layers).
func SavedInWith(dir string, opts LoadOptions) bool {
	cdir, err := cString("SavedIn", "folder", dir)
	if err != nil {
		return false // no folder's name holds a NUL byte
	}
	defer C.free(unsafe.Pointer(cdir))
	return bool(C.kvsnap_prefix_cache_saved_in_with(cdir, opts.flags()))
}

// dirAndModel are Save's and Load's strings for the C API; a NUL byte in either is refused
// (cString): a model id cut there could match another model's.
func dirAndModel(call, dir, modelID string) (*C.char, *C.char, error) {
	cdir, err := cString(call, "folder", dir)
	if err != nil {
		return nil, nil, err
	}
	cmodel, err := cString(call, "model id", modelID)
	if err != nil {
		C.free(unsafe.Pointer(cdir))
		return nil, nil, err
	}
	return cdir, cmodel, nil
}

// Session is one request on a slot: Remaining tokens to prefill, then PrefillDone, an
// AppendOutput per generated token, and Close, which pages the evaluated tokens out into the
// trie. Use it from one goroutine at a time.
type Session struct {
	mu     sync.Mutex
	ptr    *C.kvsnap_session
	prefix *PrefixCache // kept reachable while the session is
}

func (s *Session) use(call string, f func(*C.kvsnap_session) error) error {
	if s == nil {
		return closedError(call, "session")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return closedError(call, "session")
	}
	s.prefix.mu.RLock() // PrefixCache.Close waits for the call
	defer s.prefix.mu.RUnlock()
	return f(s.ptr)
}

// Remaining is the prompt tokens the model must still evaluate (a copy).
func (s *Session) Remaining() ([]int32, error) {
	var out []int32
	err := s.use("Session.Remaining", func(p *C.kvsnap_session) error {
		var toks *C.int32_t
		var count C.size_t
		if err := check(func() C.kvsnap_status { return C.kvsnap_session_remaining(p, &toks, &count) }); err != nil {
			return err
		}
		out = make([]int32, count)
		if count > 0 {
			copy(out, unsafe.Slice((*int32)(unsafe.Pointer(toks)), count))
		}
		return nil
	})
	return out, err
}

// Cached is the tokens restored from the cache: the live layers stand at this offset.
func (s *Session) Cached() (int64, error) {
	var out C.int64_t
	err := s.use("Session.Cached", func(p *C.kvsnap_session) error {
		return check(func() C.kvsnap_status { return C.kvsnap_session_cached(p, &out) })
	})
	return int64(out), err
}

// Slot is the slot (the layers' sequence) the session runs on.
func (s *Session) Slot() (int32, error) {
	var out C.int32_t
	err := s.use("Session.Slot", func(p *C.kvsnap_session) error {
		return check(func() C.kvsnap_status { return C.kvsnap_session_slot(p, &out) })
	})
	return int32(out), err
}

// ScheduleSnapshots adds restore points (absolute offsets in [Cached, prompt size]) before the
// prefill.
func (s *Session) ScheduleSnapshots(offsets ...int64) error {
	var at *C.int64_t
	if len(offsets) > 0 {
		at = (*C.int64_t)(unsafe.Pointer(&offsets[0]))
	}
	return s.use("Session.ScheduleSnapshots", func(p *C.kvsnap_session) error {
		return check(func() C.kvsnap_status { return C.kvsnap_session_schedule_snapshots(p, at, C.size_t(len(offsets))) })
	})
}

// ScheduleBranchPoints adds restore points that are guesses — where other requests' prompts may
// leave this one — before the prefill: ordinary nodes, evicted and merged like any other, where
// ScheduleSnapshots' are user nodes, evicted last.
func (s *Session) ScheduleBranchPoints(offsets ...int64) error {
	var at *C.int64_t
	if len(offsets) > 0 {
		at = (*C.int64_t)(unsafe.Pointer(&offsets[0]))
	}
	return s.use("Session.ScheduleBranchPoints", func(p *C.kvsnap_session) error {
		return check(func() C.kvsnap_status {
			return C.kvsnap_session_schedule_branch_points(p, at, C.size_t(len(offsets)))
		})
	})
}

// PrefillDone is called after the prefill forward over the remaining tokens.
func (s *Session) PrefillDone() error {
	return s.use("Session.PrefillDone", func(p *C.kvsnap_session) error {
		return check(func() C.kvsnap_status { return C.kvsnap_session_prefill_done(p) })
	})
}

// AppendOutput records a generated token (before the forward that feeds it back).
func (s *Session) AppendOutput(token int32) error {
	return s.use("Session.AppendOutput", func(p *C.kvsnap_session) error {
		return check(func() C.kvsnap_status { return C.kvsnap_session_append_output(p, C.int32_t(token)) })
	})
}

// RetractOutputs takes back the last count generated tokens (drafts the verification
// rejected). Fails, changing nothing, unless decoding, 0 <= count <= the tokens generated so
// far, and the layers stand at or past the prompt's end.
func (s *Session) RetractOutputs(count int64) error {
	return s.use("Session.RetractOutputs", func(p *C.kvsnap_session) error {
		return check(func() C.kvsnap_status { return C.kvsnap_session_retract_outputs(p, C.int64_t(count)) })
	})
}

// Close pages the evaluated tokens out into the trie, ends the session and frees it. A second
// Close does nothing.
func (s *Session) Close() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return nil
	}
	s.prefix.mu.RLock() // PrefixCache.Close waits for the page-out
	defer s.prefix.mu.RUnlock()
	err := check(func() C.kvsnap_status { return C.kvsnap_session_close(s.ptr) })
	C.kvsnap_session_destroy(s.ptr)
	s.ptr = nil
	return err
}

// free: a session forgotten open is closed (a failure to page out is dropped), then freed.
func (s *Session) free() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.prefix.mu.RLock()
	defer s.prefix.mu.RUnlock()
	C.kvsnap_session_destroy(s.ptr)
	s.ptr = nil
}
