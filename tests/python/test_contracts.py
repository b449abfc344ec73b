"""Contracts of the Python bindings no other file tests: consuming snapshots another thread uses,
read-only views that stay read-only, zero-size inputs, shapes numpy would broadcast, objects
dropped on threads that did not make them, and fork() while another thread is inside a call.

Scripts that could deadlock run in a fresh interpreter with a timeout, so a deadlock fails the
test instead of hanging the run."""
import os
import threading
import time

import numpy as np
import pytest

import kvsnap
from conftest import kv, run_script

HEADS, DEPTH = 8, 64
LONG = 1 << 14  # tokens of a write that holds its cache's lock for 20 ms or more (32 MiB x 2)


# ---- 1. merge and split refuse a snapshot in use on another thread -----------------------------

def lazy_snapshots():
    """A fresh KVCache of 8 tokens; its keys; lazy snapshots whole [0, 8), parent [0, 4), child
    [4, 8) (whole is split from another snapshot of [0, 8), so all three are live)."""
    cache = kvsnap.KVCache()
    keys = np.random.default_rng(1).standard_normal((1, HEADS, 8, DEPTH)).astype(np.float32)
    cache.update(kvsnap.Batch.uniform(1, 8, 0), keys, keys)
    parent, child = cache.split(cache.snapshot(0), 4)
    snapshots = {"whole": cache.snapshot(0), "parent": parent, "child": child}
    assert all(s.is_lazy for s in snapshots.values())
    return cache, keys, snapshots


def refused_while_in_use(in_use, consume, attempts=50):
    """Per attempt, on fresh snapshots: a writer thread's long write holds the cache's lock,
    a reader thread's snapshots[in_use].size waits for that lock (the snapshot in use meanwhile),
    and consume(cache, snapshots) runs. Returns (cache, keys, snapshots, error) of the first
    attempt whose consume raised kvsnap.Error, or None when none did."""
    big = np.ones((1, HEADS, LONG, DEPTH), np.float32)
    for _ in range(attempts):
        cache, keys, snapshots = lazy_snapshots()
        writer = threading.Thread(target=cache.update,
                                  args=(kvsnap.Batch.uniform(1, LONG, 8), big, big))
        reader = threading.Thread(target=lambda: snapshots[in_use].size)
        writer.start()
        time.sleep(0.002)  # the writer is inside its update, holding the cache's lock
        reader.start()
        time.sleep(0.002)  # the reader waits for that lock inside Snapshot.size
        try:
            consume(cache, snapshots)
            error = None
        except kvsnap.Error as raised:
            error = raised
        reader.join(20)
        writer.join(20)
        assert not reader.is_alive() and not writer.is_alive(), "deadlock"
        assert cache.offset == 8 + LONG
        if error is not None:
            return cache, keys, snapshots, error
    return None


@pytest.mark.parametrize("in_use", ["parent", "child"])
def test_merge_refuses_while_either_snapshot_is_in_use_and_consumes_neither(in_use):
    refused = refused_while_in_use(in_use, lambda c, s: c.merge(s["parent"], s["child"]))
    assert refused is not None, "merge was never refused: the test proved nothing"
    cache, keys, snapshots, error = refused
    assert str(error) == ("Cache.merge: this snapshot is in use by a call running on another "
                          "thread; a snapshot is consumed only when no call uses it")
    parent, child = snapshots["parent"], snapshots["child"]
    assert not parent.consumed and not child.consumed  # refused before either was taken
    assert (parent.from_offset, child.to_offset) == (0, 8)
    merged = cache.merge(parent, child)  # nobody uses them now
    assert parent.consumed and child.consumed
    assert (merged.from_offset, merged.to_offset) == (0, 8)
    fresh = kvsnap.KVCache()
    assert fresh.restore(merged, 8)
    np.testing.assert_array_equal(fresh.state()[0], keys)


def test_split_refuses_while_its_snapshot_is_in_use_and_keeps_it():
    refused = refused_while_in_use("whole", lambda c, s: c.split(s["whole"], 4))
    assert refused is not None, "split was never refused: the test proved nothing"
    cache, keys, snapshots, error = refused
    assert str(error).startswith("Cache.split: this snapshot is in use by a call running on")
    whole = snapshots["whole"]
    assert not whole.consumed and (whole.from_offset, whole.to_offset) == (0, 8)
    fresh = kvsnap.KVCache()
    assert fresh.restore(whole, 8)  # still whole, still usable
    np.testing.assert_array_equal(fresh.state()[0], keys)


def test_merge_waits_for_a_cache_another_thread_is_writing():
    # The cache (not the snapshots) is in use: merge is not refused, it waits its turn. (Were
    # the writer not yet inside its update, merge would run first: not refused either.)
    cache, keys, snapshots = lazy_snapshots()
    big = np.ones((1, HEADS, LONG, DEPTH), np.float32)
    writer = threading.Thread(target=cache.update,
                              args=(kvsnap.Batch.uniform(1, LONG, 8), big, big))
    writer.start()
    time.sleep(0.002)
    merged = cache.merge(snapshots["parent"], snapshots["child"])
    writer.join(20)
    assert not writer.is_alive() and cache.offset == 8 + LONG
    assert (merged.from_offset, merged.to_offset) == (0, 8)
    fresh = kvsnap.KVCache()
    assert fresh.restore(merged, 8)
    np.testing.assert_array_equal(fresh.state()[0], keys)


# ---- 2. read-only views stay read-only ---------------------------------------------------------

def views_of_cache_data(rng):
    """(name, read-only numpy view of kvsnap's buffers) for every call that hands one out, with
    the caches kept alive by the views."""
    out = []
    for cache in (kvsnap.KVCache(), kvsnap.RotatingKVCache(4)):
        history = cache.update(kvsnap.Batch.uniform(1, 6, 0), kv(rng, 6), kv(rng, 6))
        name = type(cache).__name__
        out += [(f"{name} keys", history.keys), (f"{name} values", history.values)]
        out += [(f"{name} state", view) for view in cache.state()]
    paged = kvsnap.PagedKVCache(block_tokens=4)
    columns = paged.update(kvsnap.Batch.uniform(1, 6, 0), kv(rng, 6), kv(rng, 6)).paged_columns
    out += [("paged key chunk", columns.key_chunks[0]), ("paged value chunk",
                                                         columns.value_chunks[0])]
    out += [("paged state", paged.state()[0])]
    recurrent = kvsnap.RecurrentCache(2, 3, 1, 2, 2)
    batch = kvsnap.Batch.uniform(1, 1, 0)
    recurrent.get(batch)
    recurrent.put(batch, [rng.standard_normal((1, 2, 3)).astype(np.float32)],
                  [rng.standard_normal((1, 1, 2, 2)).astype(np.float32)])  # writable, adopted
    history = recurrent.get(kvsnap.Batch.uniform(1, 1, 1))
    out += [("conv_state", history.conv_state), ("delta_state", history.delta_state)]
    out += [("recurrent state", view) for view in recurrent.state()]
    out += [("Batch.input_ids", kvsnap.Batch([[1, 2, 3]], [0], [3]).input_ids)]
    rewrapped = kvsnap.Array(out[0][1])
    out += [("Array(view).numpy()", rewrapped.numpy()), ("asarray(Array(view))",
                                                         np.asarray(rewrapped))]
    out += [("view.base.numpy()", out[0][1].base.numpy())]
    return out


def test_read_only_views_refuse_setflags_write_and_every_other_way_to_write(rng):
    views = views_of_cache_data(rng)
    assert len(views) == 19
    for name, view in views:
        before = view.copy()
        assert not view.flags.writeable, name
        with pytest.raises(ValueError, match="cannot set WRITEABLE flag"):
            view.setflags(write=True)
        with pytest.raises(ValueError, match="cannot set WRITEABLE flag"):
            view[..., :1].setflags(write=True)  # a view of the view: its base is read-only too
        with pytest.raises(ValueError, match="read-only"):
            view[...] = 7
        assert not view.flags.writeable, name
        assert memoryview(view).readonly, name
        assert not np.lib.stride_tricks.as_strided(view, writeable=True).flags.writeable, name
        again = kvsnap.Array(view)
        assert again.read_only, name
        with pytest.raises(ValueError, match="cannot set WRITEABLE flag"):
            again.numpy().setflags(write=True)
        np.testing.assert_array_equal(view, before, err_msg=name)


def test_dlpack_gives_no_writable_alias_of_a_read_only_view(rng):
    cache = kvsnap.KVCache()
    view = cache.update(kvsnap.Batch.uniform(1, 3, 0), kv(rng, 3), kv(rng, 3)).keys
    before = view.copy()
    try:  # numpy refuses to export a read-only array over unversioned DLPack
        imported = kvsnap.Array.from_dlpack(view)
    except BufferError:
        imported = None
    if imported is not None:  # else it must be a copy
        assert not np.shares_memory(np.asarray(imported), view)
    copied = kvsnap.Array.from_dlpack(view.base)  # the kvsnap.Array exports a copy
    assert not copied.read_only and not np.shares_memory(copied.numpy(), view)
    copied.numpy()[...] = 5
    np.testing.assert_array_equal(view, before)


# ---- 3. zero-size inputs ----------------------------------------------------------------------

ATTENTION_KINDS = [kvsnap.KVCache, lambda: kvsnap.PagedKVCache(block_tokens=4),
                   lambda: kvsnap.RotatingKVCache(8)]
NO_TOKENS = np.zeros((1, 2, 0, 4), np.float32)


def contiguous(history):
    return history.contiguous() if history.paged else history


@pytest.mark.parametrize("make", ATTENTION_KINDS, ids=["kv", "paged", "rotating"])
def test_a_zero_token_update_works_and_changes_nothing(make, rng):
    cache = make()
    keys = kv(rng, 3)
    cache.update(kvsnap.Batch.uniform(1, 3, 0), keys, keys + 1)
    snapshot = cache.snapshot(0)
    stats, sequences, size = cache.copy_stats(), cache.sequences(), snapshot.size
    for batch in (kvsnap.Batch.single([], 3), kvsnap.Batch.uniform(1, 0, 3)):
        history = contiguous(cache.update(batch, NO_TOKENS, NO_TOKENS))
        assert history.length == 3 and cache.offset == 3
        np.testing.assert_array_equal(history.keys, keys)
        np.testing.assert_array_equal(history.values, keys + 1)
    assert cache.sequences() == sequences
    assert vars_of(cache.copy_stats()) == vars_of(stats)
    assert snapshot.size == size and snapshot.to_offset == 3  # nothing copied out of the cache
    assert cache.restore(None, 0) and cache.restore(snapshot, 3)
    np.testing.assert_array_equal(contiguous(cache.view(kvsnap.Batch())).keys, keys)


def vars_of(stats):
    return {name: getattr(stats, name) for name in dir(stats) if name.endswith("_bytes")}


@pytest.mark.parametrize("make", ATTENTION_KINDS[:2], ids=["kv", "paged"])
def test_a_zero_token_update_of_an_absent_sequence_creates_none(make, rng):
    cache = make()
    cache.update(kvsnap.Batch.uniform(1, 2, 0), kv(rng, 2), kv(rng, 2))
    cache.update(kvsnap.Batch([], [0], [0], [5]), NO_TOKENS, NO_TOKENS)  # sequence 5, no tokens
    assert cache.sequences() == [0]


@pytest.mark.parametrize("make", ATTENTION_KINDS, ids=["kv", "paged", "rotating"])
def test_zero_row_batches_and_empty_arrays_raise_kvsnap_error_changing_nothing(make, rng):
    cache = make()
    keys = kv(rng, 2)
    cache.update(kvsnap.Batch.uniform(1, 2, 0), keys, keys)
    no_rows = np.zeros((0, 2, 2, 4), np.float32)
    refusals = [
        ((kvsnap.Batch.uniform(0, 2, 2), no_rows, no_rows), "batch has no rows"),
        ((kvsnap.Batch(), no_rows, no_rows), "batch has no rows"),
        ((kvsnap.Batch.uniform(1, 0, 2), [], []), r"must be 4-d \[B, H, L, D\]"),
        ((kvsnap.Batch.uniform(1, 0, 2), np.zeros(0, np.float32), np.zeros(0, np.float32)),
         "must be 4-d"),
        ((kvsnap.Batch.uniform(1, 2, 2), np.zeros((1, 0, 2, 4), np.float32),
          np.zeros((1, 0, 2, 4), np.float32)), "heads and depths must be >= 1"),
        ((kvsnap.Batch.uniform(1, 2, 2), np.zeros((1, 2, 2, 0), np.float32),
          np.zeros((1, 2, 2, 0), np.float32)), "heads and depths must be >= 1"),
    ]
    for arguments, rule in refusals:
        with pytest.raises(kvsnap.Error, match=rf"^\w+::update: .*{rule}"):
            cache.update(*arguments)
        assert cache.offset == 2 and cache.sequences() == [0]
    np.testing.assert_array_equal(contiguous(cache.view(kvsnap.Batch())).keys, keys)
    fresh = make()  # a refused first write fixes no layout and makes no sequence
    with pytest.raises(kvsnap.Error):
        fresh.update(kvsnap.Batch.uniform(1, 2, 0), np.zeros((1, 0, 2, 4), np.float32),
                     np.zeros((1, 0, 2, 4), np.float32))
    assert fresh.sequences() == [] and fresh.offset == 0
    fresh.update(kvsnap.Batch.uniform(1, 2, 0), kv(rng, 2, heads=3), kv(rng, 2, heads=3))
    assert fresh.offset == 2


def test_recurrent_zero_rows_and_empty_state_lists_raise_kvsnap_error(rng):
    cache = kvsnap.RecurrentCache(2, 3, 1, 2, 2)
    batch = kvsnap.Batch.uniform(1, 2, 0)
    cache.get(batch)
    conv = rng.standard_normal((1, 2, 3)).astype(np.float32)
    delta = rng.standard_normal((1, 1, 2, 2)).astype(np.float32)
    cache.put(batch, [conv], [delta])
    for zero_rows in (kvsnap.Batch.uniform(0, 1, 2), kvsnap.Batch()):
        with pytest.raises(kvsnap.Error, match=r"^RecurrentCache::get: batch has no rows"):
            cache.get(zero_rows)
        with pytest.raises(kvsnap.Error, match=r"^RecurrentCache::put: batch has no rows"):
            cache.put_rows(zero_rows, [])
    with pytest.raises(kvsnap.Error, match=r"^RecurrentCache::put: got 0 conv and 0 delta states"):
        cache.put(kvsnap.Batch.uniform(1, 0, 2), [], [])
    assert cache.offset == 2 and cache.sequences() == [0]
    history = cache.get(kvsnap.Batch.uniform(1, 0, 2))  # zero tokens: the live state
    np.testing.assert_array_equal(history.conv_state, conv)
    np.testing.assert_array_equal(history.delta_state, delta)
    assert cache.snapshot_splits(0) == [] and cache.offset == 2


def test_empty_prompts_and_empty_schedules(rng):
    cache = kvsnap.KVCache()
    prefix = kvsnap.PrefixCache([cache])
    for empty in ([], np.zeros(0, np.int32), ()):
        with pytest.raises(kvsnap.Error, match=r"^PrefixCache::begin: the prompt is empty"):
            prefix.begin(empty)
        assert prefix.match(empty) == 0 and prefix.match(empty, slot=0) == 0
    assert prefix.stats().lookups == 0 and prefix.node_count == 0
    with prefix.begin([1, 2, 3]) as session:  # the slot is free: no refused begin held it
        session.schedule_snapshots([])
        session.schedule_branch_points([])
        remaining = session.remaining()
        cache.update(kvsnap.Batch.single(remaining, 0), kv(rng, 3), kv(rng, 3))
        session.prefill_done()
        session.retract_outputs(0)
    assert prefix.check_invariants() == "" and prefix.match([1, 2, 3, 9]) == 3
    fresh = kvsnap.KVCache()
    fresh.prepare_snapshots([])  # schedules nothing, makes no sequence
    assert fresh.sequences() == [] and fresh.take_snapshots() == []


# ---- 4. shapes numpy would broadcast are refused -----------------------------------------------

CONV, DELTA = (1, 2, 3), (1, 2, 2, 2)  # RecurrentCache(2, 3, 2, 2, 2)
BROADCASTABLE = [  # (conv shape, delta shape): each broadcasts to (CONV, DELTA) in numpy
    ((2, 3), DELTA), ((1, 1, 3), DELTA), ((1, 2, 1), DELTA), ((3,), DELTA), ((), DELTA),
    (CONV, (2, 2, 2)), (CONV, (1, 1, 2, 2)), (CONV, (1, 2, 1, 2)),
    (CONV, (1, 2, 2, 1)), (CONV, ()),
]


@pytest.mark.parametrize("conv_shape, delta_shape", BROADCASTABLE)
def test_recurrent_put_refuses_states_numpy_would_broadcast(conv_shape, delta_shape):
    assert np.broadcast_shapes(conv_shape, CONV) == CONV
    assert np.broadcast_shapes(delta_shape, DELTA) == DELTA
    conv, delta = np.ones(conv_shape, np.float32), np.ones(delta_shape, np.float32)
    for rows in (1, 2):
        cache = kvsnap.RecurrentCache(2, 3, 2, 2, 2)
        batch = kvsnap.Batch.uniform(rows, 1, 0)
        cache.get(batch)
        wrong = "conv" if conv_shape != CONV else "delta"
        with pytest.raises(kvsnap.Error, match=rf"^RecurrentCache::put: {wrong} state f32\["):
            if rows == 1:
                cache.put(batch, [conv], [delta])
            else:  # row 1 wrong: row 0 is not put either
                good = ([np.ones(CONV, np.float32)], [np.ones(DELTA, np.float32)])
                cache.put_rows(batch, [good, ([conv], [delta])])
        assert cache.offset == 0
        for row in range(rows):
            state = cache.get(batch).row(row)
            assert state.conv_state.shape == CONV and not state.conv_state.any()
            assert state.delta_state.shape == DELTA and not state.delta_state.any()


def test_recurrent_put_rows_refuses_one_stacked_array_for_several_rows():
    cache = kvsnap.RecurrentCache(2, 3, 2, 2, 2)
    batch = kvsnap.Batch.uniform(2, 1, 0)
    cache.get(batch)
    stacked = ([np.ones((2,) + CONV[1:], np.float32)], [np.ones((2,) + DELTA[1:], np.float32)])
    with pytest.raises(kvsnap.Error, match=r"^RecurrentCache::put: conv state f32\[2, 2, 3\] must"):
        cache.put_rows(batch, [stacked, stacked])
    assert cache.offset_of(0) == 0 and cache.offset_of(1) == 0


def test_attention_update_refuses_keys_numpy_would_broadcast(rng):
    for make in ATTENTION_KINDS:
        cache = make()
        for batch, keys, values in (
                (kvsnap.Batch.uniform(2, 3, 0), kv(rng, 3), kv(rng, 3)),  # B = 1 for 2 rows
                (kvsnap.Batch.uniform(1, 3, 0), kv(rng, 1), kv(rng, 1)),  # L = 1 for 3
                (kvsnap.Batch.uniform(1, 3, 0), kv(rng, 3), kv(rng, 3, heads=1)),  # values H = 1
                (kvsnap.Batch.uniform(1, 3, 0), kv(rng, 3)[0], kv(rng, 3)[0])):  # no B axis
            with pytest.raises(kvsnap.Error, match=r"^\w+::update: keys f32\["):
                cache.update(batch, keys, values)
        assert cache.sequences() == [] and cache.offset == 0


# ---- 5. sessions and tiers dropped on a thread that did not make them ---------------------------

def test_a_session_dropped_on_another_thread_closes_while_other_threads_serve():
    done = run_script("""
        import queue, threading, weakref
        import numpy as np, kvsnap
        layers = [kvsnap.PagedKVCache(block_tokens=4), kvsnap.KVCache(), None]
        prefix = kvsnap.PrefixCache(layers, slots=3)
        def forward(session, slot):
            todo = session.remaining()
            batch = kvsnap.Batch(None, [session.cached], [len(todo)], [slot])
            for layer in layers[:2]:
                x = np.full((1, 2, len(todo), 4), slot, np.float32)
                layer.update(batch, x, x)
            session.prefill_done()
        failures, stop = [], threading.Event()
        def serve(slot):  # other threads use the prefix cache all along
            try:
                turn = 0
                while not stop.is_set():
                    with prefix.begin([9, 9, slot, turn % 5], slot=slot) as session:
                        forward(session, slot)
                    turn += 1
            except Exception as error:
                failures.append(repr(error))
        handoff, dropped = queue.Queue(), []
        def drop():  # gets the only reference to each session and lets go of it here
            for _ in range(20):
                session, alive = handoff.get()
                del session
                dropped.append(alive() is None)
                handoff.task_done()
        threads = [threading.Thread(target=serve, args=(slot,), daemon=True) for slot in (1, 2)]
        threads.append(threading.Thread(target=drop, daemon=True))
        for thread in threads:
            thread.start()
        for i in range(20):
            session = prefix.begin([1, 2, 3, 4, 5, i], slot=0)  # made on the main thread
            forward(session, 0)
            handoff.put((session, weakref.ref(session)))
            del session
            handoff.join()  # dropped (closed) there: slot 0 is free for the next begin
        stop.set()
        for thread in threads:
            thread.join(20)
            assert not thread.is_alive(), "a thread did not finish"
        assert not failures, failures
        assert dropped == [True] * 20, dropped
        assert prefix.check_invariants() == ""
        assert [prefix.match([1, 2, 3, 4, 5, i, 99]) for i in range(20)] == [6] * 20
        print("ok")
        """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr + done.stdout


def test_a_tier_dropped_on_another_thread_waits_for_its_writes(tmp_path):
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    done = run_script(f"""
        import threading, weakref
        import numpy as np, kvsnap
        def open_process():
            cache = kvsnap.KVCache()
            tier = kvsnap.Tier("dir:{folder}", [cache], model_fingerprint="m", chunk_tokens=4,
                               log_to_stderr=False, lookup_timeout=5.0)
            return cache, tier, kvsnap.PrefixCache([cache], tier=tier)
        def serve(cache, prefix, prompt):
            with prefix.begin(prompt) as session:
                cached, todo = session.cached, list(session.remaining())
                x = np.zeros((1, 2, len(todo), 4), np.float32)
                x[0, :, :, 0] = todo
                cache.update(kvsnap.Batch.single(todo, cached), x, x)
                session.prefill_done()
                return cached
        prompt = list(range(100, 120))
        busy_cache, busy_tier, busy_prefix = open_process()
        failures, stop = [], threading.Event()
        def busy():  # another prefix cache over the same store, in use all along
            try:
                turn = 0
                while not stop.is_set():
                    serve(busy_cache, busy_prefix, [5, 6, 7, 8, 9, turn % 7])
                    turn += 1
            except Exception as error:
                failures.append(repr(error))
        box = list(open_process())  # made on the main thread
        alive = weakref.ref(box[1])
        def work():  # serves, then lets go of the last references: the tier goes here
            cache, tier, prefix = box
            box.clear()
            serve(cache, prefix, prompt)
            del cache, tier, prefix
        threads = [threading.Thread(target=busy, daemon=True),
                   threading.Thread(target=work, daemon=True)]
        for thread in threads:
            thread.start()
        threads[1].join(20)
        assert not threads[1].is_alive() and alive() is None, "the tier was not dropped"
        stop.set()
        threads[0].join(20)
        assert not threads[0].is_alive() and not failures, failures
        assert busy_prefix.check_invariants() == ""
        cache, tier, prefix = open_process()  # a restart finds what the dropped tier wrote
        assert serve(cache, prefix, prompt + [1]) == 20
        print("ok")
        """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr + done.stdout


# ---- 6. fork() while another thread is inside a call holding a cache's lock ---------------------

FORK_WHILE_WRITING = """
    import os, sys, threading, time
    import numpy as np, kvsnap
    LONG = 1 << 14
    def fork_while_writing(child, attempts):
        # Forks while another thread's long write holds a cache's lock; the child runs
        # child(held), held = {"cache": ..., "snapshot": a lazy snapshot of it} (the only
        # references), then os._exit (1 when it raised). Returns how many children had not exited
        # after 3 s
        # (stopping at the first). Checks that the parent is unaffected.
        big = np.ones((1, 8, LONG, 64), np.float32)
        small = np.arange(8 * 4 * 64, dtype=np.float32).reshape(1, 8, 4, 64)
        for _ in range(attempts):
            held = {"cache": kvsnap.KVCache()}
            held["cache"].update(kvsnap.Batch.uniform(1, 4, 0), small, small)
            held["snapshot"] = held["cache"].snapshot(0)
            writer = threading.Thread(target=held["cache"].update,
                                      args=(kvsnap.Batch.uniform(1, LONG, 4), big, big))
            writer.start()
            time.sleep(0.003)  # inside the update: the cache's lock is held
            pid = os.fork()
            if pid == 0:
                try:
                    child(held)
                except BaseException:
                    os._exit(1)  # a failed check in the child fails the test
                os._exit(0)
            deadline = time.monotonic() + 3
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    return 1
                time.sleep(0.01)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
            writer.join(20)
            assert not writer.is_alive()
            cache, snapshot = held["cache"], held["snapshot"]
            assert cache.offset == 4 + LONG and snapshot.is_lazy
            fresh = kvsnap.KVCache()
            assert fresh.restore(snapshot, 4) and np.array_equal(fresh.state()[0], small)
        return 0
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
def test_a_child_forked_while_another_thread_holds_a_cache_lock_runs_and_exits():
    # README ("Threads"): the child must leave what it inherited alone (a lock held at the
    # fork stays held); new caches work, it exits, and the parent is unaffected.
    done = run_script(FORK_WHILE_WRITING + """
    def child(held):
        own = kvsnap.KVCache()
        keys = np.ones((1, 2, 3, 4), np.float32)
        own.update(kvsnap.Batch.uniform(1, 3, 0), keys, keys)
        mine = own.snapshot(0)
        assert own.restore(None, 0) and own.restore(mine, 3)
        del mine, own
        kvsnap.Array(np.zeros(4, np.float32))
    print("hung", fork_while_writing(child, attempts=3))
    """)
    assert done.returncode == 0 and done.stdout.strip() == "hung 0", done.stderr + done.stdout
