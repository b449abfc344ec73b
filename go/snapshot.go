package kvsnap

/*
#include <stdlib.h>
#include <kvsnap/kvsnap_c.h>
*/
import "C"

import (
	"runtime"
	"sync"
	"unsafe"
)

// Snapshot is state that lets a cache return to an offset: a range of tokens (attention kinds)
// or the whole state at an offset (recurrent). Lazy while it shares the live cache's data
// (Info().Lazy, no bytes owned); a write that would overwrite that data copies it out first.
// Use it from one goroutine at a time.
type Snapshot struct {
	mu  sync.Mutex
	ptr *C.kvsnap_snapshot
}

func newSnapshot(ptr *C.kvsnap_snapshot) *Snapshot {
	if ptr == nil {
		return nil
	}
	s := &Snapshot{ptr: ptr}
	runtime.SetFinalizer(s, (*Snapshot).Close)
	return s
}

// use runs f with the snapshot's handle, locked; a nil snapshot passes a NULL handle.
func (s *Snapshot) use(call string, f func(*C.kvsnap_snapshot) error) error {
	if s == nil {
		return f(nil)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return closedError(call, "snapshot")
	}
	return f(s.ptr)
}

// consume takes the handle out of the snapshot, which is closed from then on; ok is false for a
// snapshot closed before (a nil one gives a NULL handle, ok).
func (s *Snapshot) consume() (p *C.kvsnap_snapshot, ok bool) {
	if s == nil {
		return nil, true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	p, s.ptr = s.ptr, nil
	return p, p != nil
}

// SnapshotInfo describes a snapshot.
type SnapshotInfo struct {
	From, To int64 // attention kinds: [From, To) of tokens held; whole states: both the offset
	Size     int64 // bytes owned: 0 while wholly lazy
	Lazy     bool  // names live cache slots for some of its data
}

// Info describes the snapshot.
func (s *Snapshot) Info() (SnapshotInfo, error) {
	if s == nil {
		return SnapshotInfo{}, closedError("Snapshot.Info", "snapshot")
	}
	var info C.kvsnap_snapshot_info
	err := s.use("Snapshot.Info", func(p *C.kvsnap_snapshot) error {
		return check(func() C.kvsnap_status { return C.kvsnap_snapshot_get_info(p, &info) })
	})
	return SnapshotInfo{int64(info.from), int64(info.to), int64(info.size), bool(info.is_lazy)}, err
}

// Close frees the snapshot (a lazy one detaches from its cache). Safe to call twice.
func (s *Snapshot) Close() {
	p, _ := s.consume()
	C.kvsnap_snapshot_destroy(p)
}

// takeList moves a C snapshot list's entries into Go snapshots and frees the list.
func takeList(list *C.kvsnap_snapshot_list) ([]*Snapshot, error) {
	defer C.kvsnap_snapshot_list_destroy(list)
	n := int(C.kvsnap_snapshot_list_size(list))
	out := make([]*Snapshot, n)
	for i := range out {
		var p *C.kvsnap_snapshot
		if err := handOut("takeList", func() C.kvsnap_status { return C.kvsnap_snapshot_list_take(list, C.size_t(i), &p) }); err != nil {
			for _, s := range out[:i] {
				s.Close()
			}
			return nil, err
		}
		out[i] = newSnapshot(p)
	}
	return out, nil
}

// SaveSnapshots writes snapshots (nil entries allowed, e.g. one per layer) with offset to a
// safetensors file at path, atomically and private to this user (mode 0600). Lazy snapshots are
// read from their cache, not materialized. It refuses, writing nothing, a folder that
// LoadSnapshots would refuse (another user owns it, group or others can write it).
func SaveSnapshots(path string, offset int64, snapshots []*Snapshot) error {
	return SaveSnapshotsWith(path, offset, snapshots, SaveOptions{})
}

// SaveSnapshotsWith is SaveSnapshots with options (a shared folder: SaveOptions.Shared).
func SaveSnapshotsWith(path string, offset int64, snapshots []*Snapshot, opts SaveOptions) error {
	call := "SaveSnapshots"
	held := distinct(snapshots)
	for _, s := range held {
		s.mu.Lock()
	}
	defer func() {
		for _, s := range held {
			s.mu.Unlock()
		}
	}()
	ptrs := make([]*C.kvsnap_snapshot, len(snapshots)+1) // +1: never a zero-length slice to index
	for i, s := range snapshots {
		if s == nil {
			continue
		}
		if s.ptr == nil {
			return closedError(call, "snapshot")
		}
		ptrs[i] = s.ptr
	}
	cpath, err := cString(call, "path", path)
	if err != nil {
		return err
	}
	defer C.free(unsafe.Pointer(cpath))
	return check(func() C.kvsnap_status {
		return C.kvsnap_save_snapshots_with(cpath, C.int64_t(offset), &ptrs[0],
			C.size_t(len(snapshots)), opts.flags())
	})
}

// LoadSnapshots reads a file SaveSnapshots wrote: its offset and one entry per saved snapshot.
// It refuses a file, or a folder holding it, that another user owns or that group or others
// can write; a corrupt file is refused whole.
func LoadSnapshots(path string) (int64, []*Snapshot, error) {
	return LoadSnapshotsWith(path, LoadOptions{})
}

// LoadSnapshotsWith is LoadSnapshots with options (a shared file: LoadOptions.AllowShared).
func LoadSnapshotsWith(path string, opts LoadOptions) (int64, []*Snapshot, error) {
	cpath, err := cString("LoadSnapshots", "path", path)
	if err != nil {
		return 0, nil, err
	}
	defer C.free(unsafe.Pointer(cpath))
	var offset C.int64_t
	var list *C.kvsnap_snapshot_list
	if err := check(func() C.kvsnap_status {
		return C.kvsnap_load_snapshots_with(cpath, opts.flags(), &offset, &list)
	}); err != nil {
		return 0, nil, err
	}
	snapshots, err := takeList(list)
	return int64(offset), snapshots, err
}
