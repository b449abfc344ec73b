"""Every cache kind's snapshot, restore, merge and split from Python, and zero-copy histories."""
import numpy as np
import pytest

import kvsnap
from conftest import kv


def append(cache, keys, values=None):
    """Writes keys [1, H, L, D] (values default to keys + 1) at the cache's offset."""
    values = keys + 1 if values is None else values
    batch = kvsnap.Batch.uniform(1, keys.shape[2], cache.offset)
    return cache.update(batch, keys, values)


# ---- KVCache ---------------------------------------------------------------------------------

def test_kv_history_is_a_read_only_view_of_the_cache_buffer(rng):
    cache = kvsnap.KVCache()
    keys = kv(rng, 5)
    history = append(cache, keys)
    assert np.shares_memory(history.keys, cache.state()[0])
    assert not history.keys.flags.writeable
    np.testing.assert_array_equal(history.keys, keys)
    with pytest.raises(ValueError):
        history.keys[0, 0, 0, 0] = 1


def test_kv_lazy_snapshot_restores_after_a_rewind_and_overwrite(rng):
    cache = kvsnap.KVCache()
    first = kv(rng, 8)
    append(cache, first)
    snapshot = cache.snapshot(0)
    assert snapshot.is_lazy and snapshot.size == 0
    assert (snapshot.from_offset, snapshot.to_offset) == (0, 8)
    assert cache.restore(None, 5)  # a live rewind (e.g. rejected draft tokens)
    append(cache, kv(rng, 3))  # overwrites slots 5..7: copied out of the snapshot first
    assert snapshot.size > 0
    assert cache.restore(snapshot, 8)
    np.testing.assert_array_equal(cache.view(kvsnap.Batch.uniform(1, 1, 8)).keys, first)
    assert not cache.restore(snapshot, 9)  # unreachable: False, nothing changed
    assert cache.offset == 8


def test_kv_merge_and_split_are_arithmetic_on_lazy_snapshots(rng):
    cache = kvsnap.KVCache()
    append(cache, kv(rng, 10))
    whole = cache.snapshot(2)
    before, after = cache.split(whole, 6)
    assert (before.from_offset, before.to_offset, after.from_offset, after.to_offset) == (2, 6, 6, 10)
    assert before.is_lazy and after.is_lazy and before.size == after.size == 0
    joined = cache.merge(before, after)
    assert (joined.from_offset, joined.to_offset) == (2, 10)
    assert cache.merge(None, None) is None


def test_consumed_snapshots_raise_a_clear_error(rng):
    cache = kvsnap.KVCache()
    append(cache, kv(rng, 4))
    snapshot = cache.snapshot(0)
    cache.split(snapshot, 2)
    assert snapshot.consumed
    with pytest.raises(kvsnap.Error, match=r"^Cache.restore: this snapshot was consumed by "
                                           r"Cache.split; use the snapshot it returned$"):
        cache.restore(snapshot, 4)
    with pytest.raises(kvsnap.Error, match="consumed by Cache.split"):
        cache.merge(snapshot, None)


def test_a_failed_merge_still_consumes_its_inputs(rng):
    cache = kvsnap.KVCache()
    append(cache, kv(rng, 6))
    late, early = cache.snapshot(4), cache.snapshot(0)  # [4, 6) then [0, 6): not adjacent
    with pytest.raises(kvsnap.Error, match=r"^KVCache::merge"):
        cache.merge(late, early)
    assert late.consumed and early.consumed  # as in C++: merge takes ownership


def test_merging_a_snapshot_with_itself_is_refused_and_consumes_nothing(rng):
    cache = kvsnap.KVCache()
    append(cache, kv(rng, 6))
    snapshot = cache.snapshot(0)
    with pytest.raises(kvsnap.Error, match=r"^Cache.merge: parent and child are the same snapshot"):
        cache.merge(snapshot, snapshot)
    assert not snapshot.consumed
    cache.restore(None, 0)
    cache.restore(snapshot, 6)
    assert cache.offset == 6


def test_scheduled_capture_inside_one_write(rng):
    cache = kvsnap.KVCache()
    cache.prepare_snapshots([3, 7])
    append(cache, kv(rng, 10))
    edges = cache.take_snapshots()
    assert [(s.from_offset, s.to_offset) for s in edges] == [(0, 3), (3, 7)]


def test_errors_carry_the_cpp_message(rng):
    cache = kvsnap.KVCache()
    append(cache, kv(rng, 5))
    with pytest.raises(kvsnap.Error) as error:
        cache.prepare_snapshots([4, 9])
    assert str(error.value) == "KVCache::prepare_snapshots: offset 4 in [4, 9] is already passed (cache offset 5)"
    assert cache.offset == 5
    with pytest.raises(kvsnap.Error, match=r"^KVCache::update"):
        append(cache, kv(rng, 2, heads=3))  # another head count than the cache holds


# ---- RotatingKVCache -------------------------------------------------------------------------

def test_rotating_snapshot_is_the_whole_window(rng):
    cache = kvsnap.RotatingKVCache(4)
    append(cache, kv(rng, 6))
    history = cache.view(kvsnap.Batch.uniform(1, 1, 6))
    assert history.window == 4
    snapshot = cache.snapshot(0)
    assert snapshot.from_offset == snapshot.to_offset == 6
    append(cache, kv(rng, 2))
    assert not cache.restore(snapshot, 5)  # the window evicted what offset 5 needs
    assert cache.restore(snapshot, 6) and cache.offset == 6


def test_rotating_merge_keeps_the_child_and_split_keeps_the_window_later(rng):
    cache = kvsnap.RotatingKVCache(4)
    append(cache, kv(rng, 3))
    parent = cache.snapshot(0)
    append(cache, kv(rng, 2))
    child = cache.snapshot(0)
    merged = cache.merge(parent, child)
    assert merged.to_offset == 5 and parent.consumed and child.consumed
    before, after = cache.split(merged, 2)
    assert before is None and after.to_offset == 5


# ---- RecurrentCache --------------------------------------------------------------------------

def recurrent_states(rng, count, dtype=np.float32):
    conv = [rng.standard_normal((1, 2, 3)).astype(dtype) for _ in range(count)]
    delta = [rng.standard_normal((1, 1, 2, 2)).astype(np.float32) for _ in range(count)]
    return conv, delta


def test_recurrent_put_adopts_numpy_states_without_a_copy(rng):
    cache = kvsnap.RecurrentCache(conv_tail=2, conv_dim=3, num_v_heads=1, head_v_dim=2,
                                  head_k_dim=2)
    batch = kvsnap.Batch.uniform(1, 4, 0)
    before = kvsnap.live_bytes()
    state = cache.get(batch, "f32")
    assert not state.conv_state.any()  # zero-initialized
    del state
    conv, delta = recurrent_states(rng, 1)
    cache.put(batch, conv, delta)
    assert kvsnap.live_bytes() == before  # the zeros went, the numpy states came in
    assert np.shares_memory(cache.state()[0], conv[0])
    assert np.shares_memory(cache.state()[1], delta[0])


def test_recurrent_snapshots_restore_exact_offsets(rng):
    cache = kvsnap.RecurrentCache(2, 3, 1, 2, 2)
    cache.prepare_snapshots([3])
    batch = kvsnap.Batch.uniform(1, 5, 0)
    assert cache.snapshot_splits(5) == [3]
    cache.get(batch)
    conv, delta = recurrent_states(rng, 2)
    cache.put(batch, conv, delta)  # the state at 3, then at 5
    [at_three] = cache.take_snapshots()
    assert at_three.from_offset == at_three.to_offset == 3
    assert not cache.restore(at_three, 4)
    assert cache.restore(at_three, 3)
    np.testing.assert_array_equal(cache.state()[0], conv[0])
    at_end = cache.snapshot(0)  # the state at 3, again
    parent_child = cache.merge(at_three, at_end)
    assert parent_child.to_offset == 3
    before, after = cache.split(parent_child, 1)
    assert before is None and after.to_offset == 3


def test_recurrent_errors_carry_the_cpp_message(rng):
    cache = kvsnap.RecurrentCache(2, 3, 1, 2, 2)
    batch = kvsnap.Batch.uniform(1, 4, 0)
    conv, delta = recurrent_states(rng, 2)
    with pytest.raises(kvsnap.Error, match=r"^RecurrentCache::put: got 2 conv and 2 delta states for row 0; "
                                           r"expected 1 \(0 scheduled split points"):
        cache.put(batch, conv, delta)
    assert cache.offset == 0
    with pytest.raises(kvsnap.Error, match=r'^RecurrentCache.get: activation dtype "f64"'):
        cache.get(batch, "f64")
    # States are a list, one array each: a stacked array is not split along its first axis.
    with pytest.raises(kvsnap.Error, match=r"conv_states: a list of arrays \(one per state\) is "
                                           r"required, not numpy.ndarray"):
        cache.put(batch, np.stack(conv[:1]), delta[:1])
    assert cache.offset == 0


def test_a_snapshot_of_another_kind_is_refused(rng):
    window = kvsnap.RotatingKVCache(4)
    append(window, kv(rng, 2))
    cache = kvsnap.KVCache()
    with pytest.raises(kvsnap.Error, match=r"^KVCache::restore"):
        cache.restore(window.snapshot(0), 2)


def test_recurrent_states_come_back_read_only(rng):
    cache = kvsnap.RecurrentCache(2, 3, 1, 2, 2)
    batch = kvsnap.Batch.uniform(1, 1, 0)
    conv, delta = recurrent_states(rng, 1)
    cache.get(batch)
    cache.put(batch, conv, delta)  # adopted: the caller must not write them from now on
    history = cache.get(kvsnap.Batch.uniform(1, 1, 1))
    views = [history.conv_state, history.delta_state] + cache.state()
    for view in views + [np.asarray(kvsnap.Array(v)) for v in views]:
        assert not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view[...] = 0
    assert np.shares_memory(history.delta_state, delta[0])


def test_lazy_bytes_is_what_a_write_over_lazy_slots_copies(rng):
    cache = kvsnap.KVCache()
    keys = kv(rng, 8)  # [1, 2, 8, 4] f32: 32 bytes of keys and 32 of values per token
    append(cache, keys)
    assert cache.lazy_bytes(0, 8) == 0  # nothing names the slots yet
    whole = cache.snapshot(0)
    tail = cache.snapshot(6)
    assert whole.is_lazy and whole.size == 0
    assert cache.lazy_bytes(5, 8) == 3 * 64 + 2 * 64  # slots 6, 7 are named twice
    before = cache.copy_stats().materialized_bytes
    assert cache.restore(None, 5)
    cache.update(kvsnap.Batch.uniform(1, 3, 5), keys[:, :, :3], keys[:, :, :3])
    assert cache.copy_stats().materialized_bytes - before == 320
    assert (whole.size, tail.size, cache.lazy_bytes(5, 8)) == (192, 128, 0)
    fresh = kvsnap.KVCache()
    assert fresh.restore(whole, 8)
    np.testing.assert_array_equal(fresh.state()[0][:, :, :8], keys)


def test_a_forward_cut_short_keeps_the_captures_it_reached(rng):
    cache = kvsnap.KVCache()
    cache.prepare_snapshots([2, 4, 6])
    keys = kv(rng, 5)
    append(cache, keys)  # reaches 2 and 4, not 6
    with pytest.raises(kvsnap.Error, match=r"^KVCache::restore: captures at \[2, 4, 6\] are"):
        cache.restore(None, 1)
    with pytest.raises(kvsnap.Error, match=r"^KVCache::take_snapshots: scheduled offset 6 not"):
        cache.take_snapshots()
    reached = cache.take_reached_snapshots()
    assert [(s.from_offset, s.to_offset) for s in reached] == [(0, 2), (2, 4)]
    assert cache.take_reached_snapshots() == [] and cache.take_snapshots() == []  # dropped
    assert cache.restore(None, 1)  # no schedule left
    fresh = kvsnap.KVCache()
    assert fresh.restore(cache.merge(*reached), 4)
    np.testing.assert_array_equal(fresh.state()[0][:, :, :4], keys[:, :, :4])

    recurrent = kvsnap.RecurrentCache(2, 3, 1, 2, 2)
    recurrent.prepare_snapshots([2, 5])
    batch = kvsnap.Batch.uniform(1, 3, 0)
    assert recurrent.snapshot_splits(3) == [2]
    recurrent.get(batch)
    conv, delta = recurrent_states(rng, 2)
    recurrent.put(batch, conv, delta)  # the state at 2, then at 3
    [at_two] = recurrent.take_reached_snapshots()
    assert at_two.from_offset == at_two.to_offset == 2


def test_cancel_snapshots_drops_the_schedule_and_its_captures(rng):
    cache = kvsnap.KVCache()
    cache.prepare_snapshots([2, 6])
    append(cache, kv(rng, 4))  # captured 2
    cache.cancel_snapshots()
    assert cache.take_snapshots() == [] and cache.take_reached_snapshots() == []
    cache.update(kvsnap.Batch.uniform(1, 3, 4), kv(rng, 3), kv(rng, 3))  # passes 6: nothing
    assert cache.take_snapshots() == [] and cache.offset == 7
    cache.cancel_snapshots()  # no schedule: a no-op
    cache.prepare_snapshots([8], seq=1)
    cache.cancel_snapshots(seq=1)
    assert cache.take_snapshots(seq=1) == []
