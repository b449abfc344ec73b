package kvsnap

/*
#include <stdint.h>
#include <stdlib.h>
#include <kvsnap/kvsnap_c_tier.h>

extern void kvsnapGoTierLog(uintptr_t handle, char* line);
static void kvsnap_go_tier_log(void* context, const char* line) {
	kvsnapGoTierLog((uintptr_t)context, (char*)line);
}
static void kvsnap_go_set_log(kvsnap_tier_options* options, uintptr_t handle) {
	options->log = kvsnap_go_tier_log;
	options->log_context = (void*)handle;
}
*/
import "C"

import (
	"runtime"
	"runtime/cgo"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// TierOptions configure a Tier (TierOptions in kvsnap/tier.h says what each does). Zero values
// take the library's defaults, except ModelFingerprint, which is required; a duration shorter
// than the C API's unit (a millisecond, a second for TTL) counts as one unit, a negative one is
// refused.
type TierOptions struct {
	// What makes stored state valid for this model: its configuration and weights, or a hash.
	ModelFingerprint []byte
	// The operator's isolation boundary; never take it from a request.
	Tenant string
	// MAC key (LoadTierKey), at least 16 bytes; nil: trusted-store mode.
	Key []byte
	// Tokens per KV chunk object (processes must agree to share).
	ChunkTokens int64
	// The largest object written, and the most object bytes one lookup holds.
	MaxObjectBytes, MaxLookupBytes int64
	// The most a lookup waits for the store; how long a write batch may take; how long a failed
	// store is left alone; the lifetime of stored keys (Redis).
	LookupTimeout, WriteTimeout, RetryInterval, TTL time.Duration
	// Write batches, and their bytes, waiting for the writer; more are dropped (counted).
	WriteQueue, WriteQueueBytes int64
	// One line per event worth an operator's attention, called from any thread: the tier's
	// writer thread, and the goroutine of a call that looks up, flushes or closes (which may
	// wait for the writer). It must not call the Tier or its prefix caches, nor wait for a
	// lock such a caller may hold; a panic loses its line only. nil: "kvsnap tier: ..." on
	// stderr.
	Log func(line string)
}

// TierStats are a Tier's counters since it opened (TierStats in kvsnap/tier.h).
type TierStats struct {
	Lookups, Hits, RestoredTokens, BytesRead, BytesWritten, Timeouts, Rejected, Unauthenticated,
	ObjectsWritten, DroppedBatches, StoreErrors, CallerMicroseconds int64
}

// Tier is a store of restore points shared by processes — "dir:PATH" or
// "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]" — below a PrefixCache (PrefixOptions.Tier),
// which asks it on a miss and writes what sessions evaluate behind them. A slow, failing or
// hostile store costs restores, never a request. Its calls may come from several goroutines.
type Tier struct {
	mu     sync.RWMutex
	ptr    *C.kvsnap_tier
	layers []*Cache
	log    *tierLog // nil: the library logs to stderr
}

// tierLog is what the C tier's log callback reaches through a cgo.Handle. The handle goes when
// the last of its holders (the Tier and the prefix caches given it) has let go of the C tier,
// which then no longer exists to call it.
type tierLog struct {
	handle  cgo.Handle
	f       func(string)
	holders atomic.Int64
}

func (l *tierLog) hold() {
	if l != nil {
		l.holders.Add(1)
	}
}

func (l *tierLog) release() {
	if l != nil && l.holders.Add(-1) == 0 {
		l.handle.Delete()
	}
}

// OpenTier opens the store at address for layers (the PrefixCache's own, borrowed: they cannot
// be closed while the tier or a prefix cache holding it lives). It fails for a malformed address
// or options, never because the store is unreachable (lookups miss until it answers).
func OpenTier(address string, layers []*Cache, o TierOptions) (*Tier, error) {
	call := "OpenTier"
	caddress, err := cString(call, "address", address)
	if err != nil {
		return nil, err
	}
	defer C.free(unsafe.Pointer(caddress))
	options, free, err := o.toC()
	if err != nil {
		return nil, err
	}
	defer free()
	var log *tierLog
	if o.Log != nil {
		log = &tierLog{f: o.Log}
		log.holders.Store(1)
		log.handle = cgo.NewHandle(log)
		C.kvsnap_go_set_log(options, C.uintptr_t(log.handle))
	}
	ptrs, release, err := borrow(call, layers)
	if err != nil {
		log.release()
		return nil, err
	}
	var out *C.kvsnap_tier
	err = check(func() C.kvsnap_status {
		return C.kvsnap_tier_open(caddress, &ptrs[0], C.size_t(len(layers)), options, &out)
	})
	if err != nil {
		release(true)
		log.release()
		return nil, err
	}
	release(false)
	t := &Tier{ptr: out, layers: append([]*Cache{}, layers...), log: log}
	runtime.SetFinalizer(t, (*Tier).Close)
	return t, nil
}

// toC is o as the C API's options, in C memory (cgo passes no Go pointers inside a C struct);
// free releases it.
func (o TierOptions) toC() (*C.kvsnap_tier_options, func(), error) {
	if strings.IndexByte(o.Tenant, 0) >= 0 {
		return nil, nil, invalid("OpenTier", "the tenant %q holds a NUL byte, which the C API cannot pass", o.Tenant)
	}
	// An empty key would open the tier unauthenticated (the C API gets NULL for it): only nil
	// asks for that. (An unset environment variable's []byte("") must not.)
	if o.Key != nil && len(o.Key) == 0 {
		return nil, nil, invalid("OpenTier", "Key is empty; a MAC key holds at least 16 bytes (nil: a trusted store)")
	}
	options := (*C.kvsnap_tier_options)(C.malloc(C.sizeof_kvsnap_tier_options))
	*options = C.kvsnap_tier_options_default()
	var owned []unsafe.Pointer
	bytes := func(b []byte) unsafe.Pointer {
		if len(b) == 0 {
			return nil
		}
		p := C.CBytes(b)
		owned = append(owned, p)
		return p
	}
	options.model_fingerprint = bytes(o.ModelFingerprint)
	options.model_fingerprint_size = C.size_t(len(o.ModelFingerprint))
	options.key = bytes(o.Key)
	options.key_size = C.size_t(len(o.Key))
	options.tenant = (*C.char)(bytes(append([]byte(o.Tenant), 0)))
	set := func(field *C.int64_t, value int64) {
		if value != 0 {
			*field = C.int64_t(value)
		}
	}
	set(&options.chunk_tokens, o.ChunkTokens)
	set(&options.max_object_bytes, o.MaxObjectBytes)
	set(&options.max_lookup_bytes, o.MaxLookupBytes)
	set(&options.lookup_timeout_ms, units(o.LookupTimeout, time.Millisecond))
	set(&options.write_timeout_ms, units(o.WriteTimeout, time.Millisecond))
	set(&options.retry_interval_ms, units(o.RetryInterval, time.Millisecond))
	set(&options.ttl_seconds, units(o.TTL, time.Second))
	set(&options.write_queue, o.WriteQueue)
	set(&options.write_queue_bytes, o.WriteQueueBytes)
	return options, func() {
		for _, p := range owned {
			C.free(p)
		}
		C.free(unsafe.Pointer(options))
	}, nil
}

// units is d in whole units, a remainder rounded away from zero (so that 500µs is not 0, the
// default, and -500µs not 0 either: it stays negative, which the C API refuses).
func units(d, unit time.Duration) int64 {
	n := int64(d / unit)
	if d%unit > 0 {
		n++
	}
	if d%unit < 0 {
		n--
	}
	return n
}

// Close lets go of the tier: it goes (waiting for its queued writes, at most WriteTimeout) once
// no PrefixCache holds it either. Safe to call twice.
func (t *Tier) Close() {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ptr == nil {
		return
	}
	C.kvsnap_tier_destroy(t.ptr)
	t.ptr = nil
	unborrow(t.layers)
	t.layers = nil
	t.log.release()
}

func (t *Tier) use(call string, f func(*C.kvsnap_tier) error) error {
	if t == nil {
		return closedError(call, "tier")
	}
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.ptr == nil {
		return closedError(call, "tier")
	}
	return f(t.ptr)
}

// Stats are the tier's counters since it opened.
func (t *Tier) Stats() (TierStats, error) {
	var s C.kvsnap_tier_stats
	err := t.use("Tier.Stats", func(ptr *C.kvsnap_tier) error {
		return check(func() C.kvsnap_status { return C.kvsnap_tier_get_stats(ptr, &s) })
	})
	return TierStats{int64(s.lookups), int64(s.hits), int64(s.restored_tokens),
		int64(s.bytes_read), int64(s.bytes_written), int64(s.timeouts), int64(s.rejected),
		int64(s.unauthenticated), int64(s.objects_written), int64(s.dropped_batches),
		int64(s.store_errors), int64(s.caller_microseconds)}, err
}

// Flush waits until every queued write has been tried, at most timeout; true when drained.
func (t *Tier) Flush(timeout time.Duration) (bool, error) {
	var drained C.bool
	err := t.use("Tier.Flush", func(ptr *C.kvsnap_tier) error {
		return check(func() C.kvsnap_status {
			return C.kvsnap_tier_flush(ptr, C.int64_t(units(timeout, time.Millisecond)), &drained)
		})
	})
	return bool(drained), err
}

// Address is the store's address, any password replaced by "***" ("" once closed).
func (t *Tier) Address() string {
	var out string
	_ = t.use("Tier.Address", func(ptr *C.kvsnap_tier) error {
		out = C.GoString(C.kvsnap_tier_address(ptr))
		return nil
	})
	return out
}

// Authenticated says whether objects carry a MAC (a Key was given).
func (t *Tier) Authenticated() bool {
	var out bool
	_ = t.use("Tier.Authenticated", func(ptr *C.kvsnap_tier) error {
		out = bool(C.kvsnap_tier_authenticated(ptr))
		return nil
	})
	return out
}

// LoadTierKey reads a MAC key from a private file: this user's, mode 0600, in a folder others
// cannot write, 16 bytes to 1 MiB (trailing whitespace dropped).
func LoadTierKey(path string) ([]byte, error) {
	out, err := loadPrivate("LoadTierKey", path, false)
	if err != nil {
		return nil, err // nil, not an empty key
	}
	return []byte(out), nil
}

// LoadTierAddress reads a tier address (which may hold a Redis password) from a file checked as
// key files are.
func LoadTierAddress(path string) (string, error) {
	return loadPrivate("LoadTierAddress", path, true)
}

func loadPrivate(call, path string, address bool) (string, error) {
	cpath, err := cString(call, "path", path)
	if err != nil {
		return "", err
	}
	defer C.free(unsafe.Pointer(cpath))
	load := func(buffer unsafe.Pointer, capacity C.size_t, size *C.size_t) C.kvsnap_status {
		if address {
			return C.kvsnap_load_tier_address(cpath, (*C.char)(buffer), capacity, size)
		}
		return C.kvsnap_load_tier_key(cpath, buffer, capacity, size)
	}
	const most = 1<<20 + 1 // a key's limit, and its NUL
	buffer := C.malloc(most)
	defer C.free(buffer)
	var size C.size_t
	if err := check(func() C.kvsnap_status { return load(buffer, most, &size) }); err != nil {
		return "", err
	}
	return C.GoStringN((*C.char)(buffer), C.int(size)), nil
}
