"""Many sequences from Python: a paged cache sharing blocks, heterogeneous batches whose rows
attend to their own histories, per-sequence snapshots, and a prefix cache over several slots."""
import numpy as np
import pytest

import kvsnap
from conftest import kv


def write(cache, seq, keys):
    """Appends keys [1, H, L, D] (values: keys + 1) to sequence `seq` at its offset."""
    batch = kvsnap.Batch(seq_offsets=[cache.offset_of(seq)], seq_query_lens=[keys.shape[2]],
                         seq_ids=[seq])
    return cache.update(batch, keys, keys + 1)


def test_sequences_share_a_prefix_by_block_references(rng):
    cache = kvsnap.PagedKVCache(block_tokens=4)
    prefix = kv(rng, 12)
    write(cache, 0, prefix)
    snapshot = cache.snapshot(0, seq=0)
    assert snapshot.is_lazy and snapshot.size == 0
    assert cache.restore(snapshot, 12, seq=1)
    assert cache.restore(snapshot, 10, seq=2)  # ends inside a block
    stats = cache.pool_stats()
    assert stats.live_blocks == 3 and stats.blocks_copied == 0  # three blocks, shared by all
    assert sorted(cache.sequences()) == [0, 1, 2]
    assert [cache.offset_of(s) for s in (0, 1, 2)] == [12, 12, 10]
    assert cache.exposed_bytes(2) == stats.bytes_in_use // 3  # its next write copies a block
    assert cache.exposed_bytes(0) == 0  # sequence 0 stands at a block boundary
    write(cache, 2, kv(rng, 1))  # writes into the shared third block: that one is copied
    assert cache.pool_stats().blocks_copied == 1
    history = cache.view(kvsnap.Batch(seq_offsets=[0], seq_query_lens=[1], seq_ids=[1]))
    assert history.paged and history.keys is None
    np.testing.assert_array_equal(history.contiguous().keys, prefix)  # sequence 1 untouched


def gather(columns):
    """A paged history's keys [1, H, K, D], read through its block table as a kernel would."""
    t, per_chunk = columns.block_tokens, columns.blocks_per_chunk
    chunks = columns.key_chunks
    parts = []
    for k in range(columns.length):
        block = int(columns.table[k // t])
        slot = (block % per_chunk) * t + k % t
        parts.append(chunks[block // per_chunk][:, :, slot:slot + 1])
    return np.concatenate(parts, axis=2)


def test_a_paged_history_is_its_block_table_over_the_pool(rng):
    cache = kvsnap.PagedKVCache(block_tokens=4, blocks_per_chunk=2)
    prefix = kv(rng, 10)
    history = write(cache, 0, prefix)
    columns = history.paged_columns
    assert columns.block_tokens == 4 and columns.blocks_per_chunk == 2 and columns.length == 10
    assert columns.table.dtype == np.int32 and len(columns.table) == 3
    assert not columns.key_chunks[0].flags.writeable
    np.testing.assert_array_equal(gather(columns), prefix)
    assert cache.restore(cache.snapshot(0, seq=0), 6, seq=1)
    row = write(cache, 1, kv(rng, 3))  # sequence 1: 6 shared tokens, then its own
    np.testing.assert_array_equal(gather(row.paged_columns), row.contiguous().keys)
    assert kvsnap.KVCache().update(kvsnap.Batch.uniform(1, 2, 0), kv(rng, 2), kv(rng, 2)) \
        .paged_columns is None


def test_rows_of_different_sequences_attend_to_their_own_histories(rng):
    cache = kvsnap.PagedKVCache(block_tokens=4)
    tokens = {0: kv(rng, 9), 1: kv(rng, 3)}
    for seq, keys in tokens.items():
        write(cache, seq, keys)
    batch = kvsnap.Batch.rows([(0, 9, [7]), (1, 3, [8, 9])])  # a decode row and a 2-token chunk
    assert batch.seq_ids == [0, 1] and batch.seq_query_lens == [1, 2]
    step = rng.standard_normal((2, 2, 2, 4)).astype(np.float32)
    history = cache.update(batch, step, step + 1)
    assert history.ragged and history.rows == 2
    q = rng.standard_normal((2, 4, 2, 4)).astype(np.float32)
    out = kvsnap.sdpa(batch, q, history, kvsnap.AttentionMask.causal(), 0.5)
    for b, seq in enumerate((0, 1)):
        real = batch.seq_query_lens[b]
        keys = np.concatenate([tokens[seq], step[b:b + 1, :, :real]], axis=2)
        reference = kvsnap.KVCache()  # the same row against a contiguous cache of its tokens
        full = reference.update(kvsnap.Batch.uniform(1, keys.shape[2], 0), keys, keys + 1)
        row = kvsnap.Batch(seq_offsets=[batch.seq_offsets[b]], seq_query_lens=[real])
        expected = kvsnap.sdpa(row, q[b:b + 1, :, :real], full, kvsnap.AttentionMask.causal(), 0.5)
        np.testing.assert_allclose(out[b:b + 1, :, :real], expected, rtol=1e-5, atol=1e-6)


def test_a_ragged_batch_without_input_ids_updates_every_attention_kind(rng):
    # Rows of different lengths, built without ids: the batch is as wide as its longest row.
    batch = kvsnap.Batch(seq_offsets=[0, 0], seq_query_lens=[2, 1], seq_ids=[0, 1])
    step = rng.standard_normal((2, 2, 2, 4)).astype(np.float32)
    for cache in (kvsnap.KVCache(), kvsnap.PagedKVCache(block_tokens=4),
                  kvsnap.RotatingKVCache(8)):
        history = cache.update(batch, step, step + 1)
        assert history.ragged and history.rows == 2
        assert [cache.offset_of(s) for s in (0, 1)] == [2, 1]


def test_per_sequence_calls_refuse_bad_input_and_change_nothing(rng):
    cache = kvsnap.KVCache()
    write(cache, 0, kv(rng, 5))
    write(cache, 1, kv(rng, 3))
    assert not cache.restore(None, 9, seq=1)  # unreachable: False
    with pytest.raises(kvsnap.Error, match=r"from_offset 4"):
        cache.snapshot(4, seq=1)
    assert (cache.offset_of(0), cache.offset_of(1)) == (5, 3)
    with pytest.raises(kvsnap.Error, match=r"PagedKVCache"):
        kvsnap.PagedKVCache(block_tokens=0)
    with pytest.raises(kvsnap.Error, match=r"KVHistory.row: row 3 out of range"):
        cache.view(kvsnap.Batch.uniform(1, 1, 0)).row(3)


def test_a_prefix_cache_over_two_slots_reuses_across_them(rng):
    cache = kvsnap.PagedKVCache(block_tokens=4)
    prefix = kvsnap.PrefixCache([cache], slots=2)
    assert prefix.slots == 2
    prompt = list(range(1, 11))

    def serve(slot, tokens):
        session = prefix.begin(tokens, slot=slot)
        assert session.slot == slot
        remaining = session.remaining()
        keys = kv(rng, len(remaining))
        write(cache, slot, keys)
        session.prefill_done()
        cached = session.cached
        session.close()
        return cached

    assert prefix.match(prompt) == 0
    assert serve(0, prompt) == 0
    follow_up = prompt[:8] + [50, 51]
    assert prefix.match(follow_up) == 8 and prefix.match(follow_up, slot=1) == 8
    assert prefix.stats().lookups == 1  # match changes nothing
    assert serve(1, follow_up) == 8  # slot 1 restores what slot 0 computed
    with pytest.raises(kvsnap.Error, match=r"slot"):
        prefix.begin(prompt, slot=2)
    assert prefix.check_invariants() == ""


def test_a_recurrent_layer_asks_each_sequence_for_its_own_split_points():
    cache = kvsnap.RecurrentCache(conv_tail=1, conv_dim=2, num_v_heads=1, head_v_dim=1,
                                  head_k_dim=1)
    cache.prepare_snapshots([2, 3], seq=1)
    assert cache.snapshot_splits(4, seq=1) == [2, 3]
    assert cache.snapshot_splits(4) == []  # sequence 0 has no schedule
    batch = kvsnap.Batch(seq_offsets=[0], seq_query_lens=[4], seq_ids=[1])
    cache.get(batch, "f32")
    conv = [np.full((1, 1, 2), i, np.float32) for i in range(3)]
    delta = [np.full((1, 1, 1, 1), 10 + i, np.float32) for i in range(3)]
    cache.put(batch, conv, delta)
    assert len(cache.take_snapshots(seq=1)) == 2
    assert cache.state(seq=1)[1][0, 0, 0, 0] == 12


def test_batch_factories_refuse_offsets_outside_int32():
    with pytest.raises(kvsnap.Error,
                       match=r"^Batch::single: offset 4294967301 does not fit in int32"):
        kvsnap.Batch.single([1], 2**32 + 5)  # was silently offset 5
    with pytest.raises(kvsnap.Error, match=r"^Batch::uniform: length 2147483648 does not fit"):
        kvsnap.Batch.uniform(1, 2**31, 0)
    with pytest.raises(kvsnap.Error, match=r"^Batch::rows: row 1 offset -2147483649 does not"):
        kvsnap.Batch.rows([(0, 0, [1]), (1, -2**31 - 1, [2])])
    assert kvsnap.Batch.single([1], 2**31 - 1).seq_offsets == [2**31 - 1]


def test_batch_input_ids_take_any_integer_array_whose_ids_fit_int32():
    for ids in ([[1, 2, 3]], np.array([[1, 2, 3]], np.int64), np.array([[1, 2, 3]], np.uint8)):
        batch = kvsnap.Batch(ids, [0], [3])
        assert batch.input_ids.dtype == np.int32 and batch.input_ids.tolist() == [[1, 2, 3]]
    with pytest.raises(kvsnap.Error, match=r"^Batch.input_ids: int64 values outside int32"):
        kvsnap.Batch(np.array([[1, 2**31]], np.int64), [0], [2])  # would wrap to -2^31
    # Ids that are not integers are refused when the Batch is made, not at a cache's update.
    with pytest.raises(kvsnap.Error, match=r"^Batch.input_ids: float32 \(1, 3\); token ids are integers"):
        kvsnap.Batch(np.zeros((1, 3), np.float32), [0], [3])
    assert kvsnap.Batch([], [0], [3]).input_ids is None  # an empty list: no ids


def recurrent_step(history, inputs, weight):
    """One row's forward through the reference kernels: its end conv tail and delta state."""
    x, q, v, g = inputs
    _, tails = kvsnap.causal_conv1d(x, weight, history.conv_state)
    _, states = kvsnap.gated_delta(q, q, v, g, g, history.delta_state)
    return [tails[-1]], [states[-1]]


def recurrent_inputs(rng, length):
    return (rng.standard_normal((1, length, 3)).astype(np.float32),     # x [1, L, C]
            rng.standard_normal((1, length, 1, 2)).astype(np.float32),  # q, k [1, L, Hk, Dk]
            rng.standard_normal((1, length, 1, 2)).astype(np.float32),  # v [1, L, Hv, Dv]
            rng.uniform(0.5, 1, (1, length, 1)).astype(np.float32))     # g, beta [1, L, Hv]


def test_a_recurrent_batch_of_two_sequences_equals_running_each_alone(rng):
    weight = rng.standard_normal((3, 3)).astype(np.float32)  # conv width 3: a tail of 2
    dims = dict(conv_tail=2, conv_dim=3, num_v_heads=1, head_v_dim=2, head_k_dim=2)
    batched = kvsnap.RecurrentCache(**dims)
    alone = {0: kvsnap.RecurrentCache(**dims), 3: kvsnap.RecurrentCache(**dims)}
    for lengths in ({0: 3, 3: 2}, {0: 1, 3: 1}):  # a prefill of unequal rows, then a decode step
        inputs = {seq: recurrent_inputs(rng, length) for seq, length in lengths.items()}
        batch = kvsnap.Batch.rows([(seq, batched.offset_of(seq), [5] * length)
                                   for seq, length in lengths.items()])
        history = batched.get(batch)
        assert history.rows == 2 and history.conv_state is None and history.delta_state is None
        rows = [recurrent_step(history.row(b), inputs[seq], weight)
                for b, seq in enumerate(lengths)]
        batched.put_rows(batch, rows)
        for seq, cache in alone.items():
            one = kvsnap.Batch.single([5] * lengths[seq], cache.offset)
            cache.put(one, *recurrent_step(cache.get(one), inputs[seq], weight))
    for seq, cache in alone.items():
        assert batched.offset_of(seq) == cache.offset == {0: 4, 3: 3}[seq]
        for got, expected in zip(batched.state(seq=seq), cache.state()):
            np.testing.assert_array_equal(got, expected)


def test_recurrent_rows_are_checked_before_any_state_changes(rng):
    cache = kvsnap.RecurrentCache(2, 3, 1, 2, 2)
    batch = kvsnap.Batch.rows([(0, 0, [1]), (1, 0, [2])])
    history = cache.get(batch)
    with pytest.raises(kvsnap.Error, match=r"^RecurrentHistory.row: row 2 out of range \[0, 2\)"):
        history.row(2)
    good = ([np.zeros((1, 2, 3), np.float32)], [np.zeros((1, 1, 2, 2), np.float32)])
    bad = ([np.zeros((1, 2, 3), np.float32)], [np.zeros((1, 1, 2, 3), np.float32)])
    with pytest.raises(kvsnap.Error, match=r"^RecurrentCache::put"):
        cache.put_rows(batch, [good, bad])
    assert cache.offset_of(0) == cache.offset_of(1) == 0  # row 0 was not put either
    with pytest.raises(kvsnap.Error, match=r"^RecurrentCache.put: a batch of 2 rows .* put_rows"):
        cache.put(batch, *good)
    with pytest.raises(kvsnap.Error, match=r"^RecurrentCache.put_rows: rows\[1\] has type int"):
        cache.put_rows(batch, [good, 7])
    cache.put_rows(batch, [good, good])
    assert cache.offset_of(0) == cache.offset_of(1) == 1


def test_a_batch_copies_its_input_ids():
    # An engine refilling one ids buffer for every step changes no Batch made before.
    buffer = np.array([[5, 6, 7]], np.int32)
    batch = kvsnap.Batch(buffer, seq_offsets=[0], seq_query_lens=[3])
    buffer[0, 0] = 9
    np.testing.assert_array_equal(batch.input_ids, [[5, 6, 7]])


def test_integer_arguments_refuse_floats_of_any_type(rng):
    """A float where an int is wanted would be cut (5.5 -> 5): TypeError, before any call, for a
    Python float, a numpy float scalar, a 0-d float array or a float array's elements."""
    cache = kvsnap.KVCache()
    write(cache, 0, kv(rng, 4))
    floats = (5.5, np.float32(3.0), np.float16(2.0), np.array(2.5))
    calls = [
        lambda f: kvsnap.Batch.single([1, 2], f),
        lambda f: kvsnap.Batch.single(np.array([1.5, 2.0], np.float32), 0),
        lambda f: kvsnap.Batch.single([1, f], 0),
        lambda f: kvsnap.Batch.uniform(1, f, 0),
        lambda f: kvsnap.Batch(seq_offsets=[f], seq_query_lens=[1]),
        lambda f: kvsnap.Batch(seq_offsets=[0], seq_query_lens=[1], seq_ids=[f]),
        lambda f: kvsnap.Batch.rows([(0, f, [1])]),
        lambda f: kvsnap.AttentionMask.sliding_window(f),
        lambda f: cache.offset_of(f),
        lambda f: cache.snapshot(f),
        lambda f: cache.snapshot(0, seq=f),
        lambda f: cache.restore(None, f),
        lambda f: cache.prepare_snapshots([1, f]),
        lambda f: cache.reserve(f),
        lambda f: kvsnap.RotatingKVCache(f),
        lambda f: kvsnap.PagedKVCache(block_tokens=f),
        lambda f: kvsnap.RecurrentCache(f, 1, 1, 1, 1),
        lambda f: kvsnap.PrefixCache([cache], slots=f),
        lambda f: kvsnap.PrefixCache([cache]).begin([1, 2], slot=f),
        lambda f: kvsnap.PrefixCache([cache]).match([1, 2], slot=f),
        lambda f: kvsnap.Speculation([cache], seq=f),
    ]
    for i, call in enumerate(calls):
        for f in floats:
            with pytest.raises(TypeError):
                call(f)
                pytest.fail(f"call {i} took {f!r}")
    assert cache.offset_of(0) == 4
    # Integers of any type are taken, numpy's included.
    assert kvsnap.Batch.single(np.array([1, 2], np.int64), np.int32(3)).seq_offsets == [3]
    assert cache.offset_of(np.int64(0)) == 4
    assert cache.restore(None, np.int16(4))
