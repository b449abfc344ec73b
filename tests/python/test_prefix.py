"""The prefix cache, its sessions and snapshot files from Python; the engine example."""
import importlib.util
import os
import sys

import numpy as np
import pytest

import kvsnap
from conftest import ROOT, kv


def load_engine():
    spec = importlib.util.spec_from_file_location("engine", ROOT / "examples/python/engine.py")
    engine = importlib.util.module_from_spec(spec)
    sys.modules["engine"] = engine  # its dataclasses look their module up
    spec.loader.exec_module(engine)
    return engine


def test_the_engine_example_equals_recomputation():
    rows = load_engine().run(verbose=False)  # raises if any logit differs from recomputation
    assert [row["request"] for row in rows][:3] == ["turn 1", "turn 2", "regenerate 2"]
    assert rows[0]["cached"] == 0
    assert all(row["cached"] > 0 for row in rows[1:])
    assert rows[2]["evaluated"] == 1  # a regeneration evaluates one token
    assert all(row["max_error"] < 1e-4 for row in rows)


def serve(prefix, cache, prompt, rng):
    with prefix.begin(prompt) as session:
        remaining = session.remaining()
        batch = kvsnap.Batch.single(remaining, session.cached)
        cache.update(batch, kv(rng, len(remaining)), kv(rng, len(remaining)))
        session.prefill_done()
        session.append_output(7)
        return session.cached


def test_sessions_reuse_a_shared_prefix(rng):
    cache = kvsnap.KVCache()
    prefix = kvsnap.PrefixCache([cache, None])
    assert serve(prefix, cache, list(range(1, 9)), rng) == 0
    assert serve(prefix, cache, list(range(1, 6)) + [40, 41], rng) == 5
    stats = prefix.stats()
    assert stats.lookups == 2 and stats.reused_tokens == 5
    assert prefix.check_invariants() == ""


def test_a_guessed_branch_point_is_a_restore_point(rng):
    window = kvsnap.RotatingKVCache(8)  # restores only where its state was captured
    prefix = kvsnap.PrefixCache([window])

    def run(prompt, guesses=()):
        with prefix.begin(prompt) as session:
            if guesses:
                session.schedule_branch_points(list(guesses))
            remaining = session.remaining()
            batch = kvsnap.Batch.single(remaining, session.cached)
            window.update(batch, kv(rng, len(remaining)), kv(rng, len(remaining)))
            session.prefill_done()
            return session.cached

    assert run(list(range(1, 13)), guesses=[6]) == 0
    assert run(list(range(1, 7)) + [40, 41]) == 6
    with prefix.begin([1, 2, 3]) as session:
        with pytest.raises(kvsnap.Error, match=r"^Session::schedule_branch_points: offset 20"):
            session.schedule_branch_points([20])


def test_one_session_at_a_time(rng):
    prefix = kvsnap.PrefixCache([kvsnap.KVCache()])
    session = prefix.begin([1, 2, 3])
    with pytest.raises(kvsnap.Error, match=r"^PrefixCache::begin"):
        prefix.begin([1, 2, 3])
    session.close()
    with pytest.raises(kvsnap.Error, match=r"^Session::prefill_done: the session is closed$"):
        session.prefill_done()


def test_token_ids_are_whole_numbers(rng):
    cache = kvsnap.KVCache()
    prefix = kvsnap.PrefixCache([cache])
    # A float would be cut to an int (1.5 -> 1): refused, whatever its type.
    for prompt in (np.array([1.5, 2.7], np.float32), [1, np.float32(2.0)]):
        with pytest.raises(TypeError):
            prefix.begin(prompt)
        with pytest.raises(TypeError):
            prefix.match(prompt)
    assert prefix.stats().lookups == 0
    with prefix.begin(np.array([1, 2, 3], np.int64)) as session:  # integer dtypes are ids
        remaining = session.remaining()
        cache.update(kvsnap.Batch.single(remaining, 0), kv(rng, 3), kv(rng, 3))
        session.prefill_done()
        with pytest.raises(TypeError):
            session.append_output(np.float32(7))
        session.append_output(np.int32(7))
    assert prefix.match([1, 2, 3, 7]) == 3


def test_stats_hold_the_trie_at_the_same_instant(rng, tmp_path):
    cache = kvsnap.KVCache()
    prefix = kvsnap.PrefixCache([cache])
    serve(prefix, cache, list(range(10)), rng)
    stats = prefix.stats()
    assert stats.nodes == prefix.node_count and stats.nodes > 0
    assert stats.paged_out_bytes == prefix.paged_out_bytes
    assert stats.loaded_nodes == 0
    assert prefix.peak_paged_out_bytes >= prefix.paged_out_bytes
    prefix.save(str(tmp_path), "m")
    restarted = kvsnap.PrefixCache([kvsnap.KVCache()])
    restarted.load(str(tmp_path), "m")
    assert restarted.stats().loaded_nodes == prefix.node_count
    # Under a budget that keeps nothing: every node found in the file, none read, none held.
    small = kvsnap.PrefixCache([kvsnap.KVCache()], max_paged_out_bytes=1)
    small.load(str(tmp_path), "m")
    assert small.stats().loaded_nodes == prefix.node_count
    assert small.stats().evicted_nodes > 0
    assert small.node_count == 0 and small.peak_paged_out_bytes <= 1
    restarted.reset_peak_paged_out_bytes()
    assert restarted.peak_paged_out_bytes == restarted.paged_out_bytes


def test_a_dropped_open_session_frees_its_slot(rng):
    cache = kvsnap.KVCache()
    prefix = kvsnap.PrefixCache([cache])
    session = prefix.begin([1, 2, 3])
    del session  # closed with its last reference: the slot takes the next request
    with prefix.begin([1, 2, 3]) as again:
        assert again.cached == 0


def test_the_prefix_cache_keeps_its_layers_alive(rng):
    prefix = kvsnap.PrefixCache([kvsnap.KVCache()])  # no other reference to the cache
    with prefix.begin([1, 2]) as session:
        assert session.cached == 0


def test_a_prefix_cache_survives_a_restart(tmp_path, rng):
    cache = kvsnap.KVCache()
    prefix = kvsnap.PrefixCache([cache])
    serve(prefix, cache, list(range(10)), rng)
    prefix.save(str(tmp_path), "model-a")
    assert kvsnap.PrefixCache.saved_in(str(tmp_path))
    restarted_cache = kvsnap.KVCache()
    restarted = kvsnap.PrefixCache([restarted_cache])
    with pytest.raises(kvsnap.Error, match='saved for model "model-a", this cache serves "b"'):
        restarted.load(str(tmp_path), "b")
    restarted.load(str(tmp_path), "model-a")
    assert restarted.node_count == prefix.node_count
    assert serve(restarted, restarted_cache, list(range(10)), rng) == 9


def test_a_cache_others_can_write_is_refused_unless_shared(tmp_path, rng):
    cache = kvsnap.KVCache()
    prefix = kvsnap.PrefixCache([cache])
    serve(prefix, cache, list(range(10)), rng)
    prefix.save(str(tmp_path / "cache"), "m")
    assert os.stat(tmp_path / "cache").st_mode & 0o7777 == 0o700
    assert os.stat(tmp_path / "cache" / "prefix_cache.safetensors").st_mode & 0o7777 == 0o600
    os.chmod(tmp_path / "cache", 0o777)
    refused = r"^PrefixCache::(load|saved_in): refusing the folder .*mode 0777\): group and others"
    with pytest.raises(kvsnap.Error, match=refused):
        kvsnap.PrefixCache.saved_in(str(tmp_path / "cache"))
    restarted = kvsnap.PrefixCache([kvsnap.KVCache()])
    with pytest.raises(kvsnap.Error, match=refused):
        restarted.load(str(tmp_path / "cache"), "m")
    assert restarted.node_count == 0
    assert kvsnap.PrefixCache.saved_in(str(tmp_path / "cache"), allow_shared=True)
    restarted.load(str(tmp_path / "cache"), "m", allow_shared=True)
    assert restarted.node_count == prefix.node_count
    written = os.stat(tmp_path / "cache" / "prefix_cache.safetensors").st_mtime_ns
    with pytest.raises(kvsnap.Error, match=r"^PrefixCache::save: refusing the folder .*"
                       r"set SaveOptions::shared"):
        prefix.save(str(tmp_path / "cache"), "m")  # its own load would refuse it
    assert os.stat(tmp_path / "cache" / "prefix_cache.safetensors").st_mtime_ns == written
    prefix.save(str(tmp_path / "cache"), "m", shared=True)  # for the folder's other users
    assert os.stat(tmp_path / "cache" / "prefix_cache.safetensors").st_mode & 0o7777 == 0o644
    fresh = kvsnap.KVCache()
    keys = kv(rng, 2)
    fresh.update(kvsnap.Batch.uniform(1, 2, 0), keys, keys)
    path = str(tmp_path / "turn.safetensors")
    kvsnap.save_snapshots(path, 2, [fresh.snapshot(0)])
    os.chmod(path, 0o666)
    with pytest.raises(kvsnap.Error, match=r"^load_snapshots: refusing the file .*mode 0666\)"):
        kvsnap.load_snapshots(path)
    assert kvsnap.load_snapshots(path, allow_shared=True)[0] == 2
    in_shared = str(tmp_path / "cache" / "turn.safetensors")  # the folder others can write
    with pytest.raises(kvsnap.Error, match=r"^save_snapshots: refusing the folder .*mode 0777"):
        kvsnap.save_snapshots(in_shared, 2, [fresh.snapshot(0)])
    assert not os.path.exists(in_shared)
    kvsnap.save_snapshots(in_shared, 2, [fresh.snapshot(0)], shared=True)
    assert os.stat(in_shared).st_mode & 0o7777 == 0o644
    assert kvsnap.load_snapshots(in_shared, allow_shared=True)[0] == 2


def test_snapshot_files_round_trip(tmp_path, rng):
    cache = kvsnap.KVCache()
    keys = kv(rng, 6)
    cache.update(kvsnap.Batch.uniform(1, 6, 0), keys, keys)
    path = str(tmp_path / "turn.safetensors")
    kvsnap.save_snapshots(path, 6, [cache.snapshot(0), None])
    offset, snapshots = kvsnap.load_snapshots(path)
    assert offset == 6 and snapshots[1] is None and not snapshots[0].is_lazy
    fresh = kvsnap.KVCache()
    assert fresh.restore(snapshots[0], 6)
    np.testing.assert_array_equal(fresh.state()[0][:, :, :6], keys)
    with pytest.raises(kvsnap.Error, match=r"^load_snapshots: cannot open .*missing\.safetensors for reading"):
        kvsnap.load_snapshots(str(tmp_path / "missing.safetensors"))


class FreshLayers:
    """A sequence that makes a new cache for every item it is asked for (a lazy wrapper)."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        if i >= 2:
            raise IndexError(i)
        return kvsnap.KVCache()


def test_layers_are_taken_from_one_pass_over_the_sequence(rng):
    prefix = kvsnap.PrefixCache(FreshLayers())  # the caches it drives are the ones it holds
    junk = [kvsnap.RecurrentCache(1, 1, 1, 1, 1) for _ in range(100)]  # reuse freed memory
    with prefix.begin([1, 2, 3]) as session:
        assert session.cached == 0 and list(session.remaining()) == [1, 2, 3]
    assert prefix.check_invariants() == "" and junk


def test_layers_that_are_not_caches_raise_kvsnap_error():
    with pytest.raises(kvsnap.Error,
                       match=r"^PrefixCache: layers\[1\] has type int; each layer is a kvsnap "):
        kvsnap.PrefixCache([kvsnap.KVCache(), 3])
    with pytest.raises(kvsnap.Error, match=r"^save_snapshots: snapshots\[0\] has type str"):
        kvsnap.save_snapshots("unused", 0, ["x"])


def test_save_snapshots_reads_the_sequence_once_before_saving(tmp_path, rng):
    cache = kvsnap.KVCache()
    keys = kv(rng, 8)
    cache.update(kvsnap.Batch.uniform(1, 8, 0), keys, keys)
    first = cache.snapshot(0)

    class ConsumingLayers:
        """Item 1 consumes and drops item 0 (merge) while the sequence is read."""

        def __len__(self):
            return 2

        def __getitem__(self, i):
            if i == 0:
                return first
            if i == 1:
                del_it = cache.merge(first, None)
                del del_it
                junk.append(kvsnap.KVCache().snapshot(0))
                return None
            raise IndexError(i)

    junk = []
    path = str(tmp_path / "x.safetensors")
    with pytest.raises(kvsnap.Error, match=r"^save_snapshots: this snapshot was consumed by "):
        kvsnap.save_snapshots(path, 8, ConsumingLayers())
    assert not os.path.exists(path)
    second = cache.snapshot(0)
    kvsnap.save_snapshots(path, 8, [second, None])
    offset, snapshots = kvsnap.load_snapshots(path)
    fresh = kvsnap.KVCache()
    assert offset == 8 and fresh.restore(snapshots[0], 8)
    np.testing.assert_array_equal(fresh.state()[0][:, :, :8], keys)
