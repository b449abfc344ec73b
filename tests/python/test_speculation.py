"""Speculation rounds from Python: exact rollback of rejected drafts for an attention cache and
a sliding window past its size, with a prefix cache session that takes the drafts back."""
import numpy as np
import pytest

import kvsnap

WINDOW = 4


def token_kv(position):
    """Keys [1, 2, 1, 4] that name their position (values their negatives)."""
    keys = 1000.0 * position + np.arange(8, dtype=np.float32).reshape(1, 2, 1, 4)
    return keys, -keys


def write(cache, first, last):
    """Writes positions first..last-1, one token at a time."""
    for p in range(first, last):
        keys, values = token_kv(p)
        cache.update(kvsnap.Batch.single([0], p), keys, values)


def visible(history, query):
    """The keys a query at position `query` sees, columns in position order."""
    keys = np.roll(np.asarray(history.keys), -history.oldest_column, axis=2)
    positions = history.first_position + np.arange(keys.shape[2])
    return keys[:, :, positions > query - WINDOW, :]


def test_a_round_rolls_back_to_the_accepted_drafts_with_a_session():
    attention, window = kvsnap.KVCache(), kvsnap.RotatingKVCache(WINDOW)
    layers = [attention, None, window]
    prefix = kvsnap.PrefixCache(layers)
    round_ = kvsnap.Speculation(layers)
    prompt = [1, 2, 3, 4, 5, 6]
    session = prefix.begin(prompt)
    write(attention, 0, 6)
    write(window, 0, 6)
    session.prefill_done()
    session.append_output(7)

    round_.begin(3)
    assert round_.open and round_.start == 6 and round_.drafts == 3
    assert round_.capturing_layers == 1  # the window, past its size; the KV cache rewinds
    with pytest.raises(kvsnap.Error, match=r"^Speculation::begin"):
        round_.begin(1)
    for draft in (8, 9, 10):
        session.append_output(draft)
    write(attention, 6, 10)
    write(window, 6, 10)
    with pytest.raises(kvsnap.Error, match=r"^Speculation::accept"):
        round_.accept(4)
    round_.accept(1)  # 8 confirmed, 9 rejected
    assert not round_.open
    assert attention.offset == 8 and window.offset == 8
    stats = round_.stats()
    assert (stats.rounds, stats.drafted, stats.accepted) == (1, 3, 1)
    assert (stats.rewinds, stats.restores) == (1, 1)

    # The window holds what writing only the accepted tokens leaves: restored, not recomputed.
    reference = kvsnap.RotatingKVCache(WINDOW)
    write(reference, 0, 8)
    query = kvsnap.Batch.single([0], 8)
    seen = visible(window.view(query), 8)
    assert seen.shape[2] == WINDOW - 1
    np.testing.assert_array_equal(seen, visible(reference.view(query), 8))

    with pytest.raises(kvsnap.Error, match=r"^Session::retract_outputs: count 5 must be in \[0, 4\]"):
        session.retract_outputs(5)
    assert attention.restore(None, 5)  # the KV layer alone back into the prompt: refused
    with pytest.raises(kvsnap.Error, match=r"^Session::retract_outputs: layer 0 stands at offset 5, inside the 6-token prompt"):
        session.retract_outputs(2)
    write(attention, 5, 8)
    session.retract_outputs(2)
    session.close()
    assert prefix.match(prompt + [7, 8, 99]) == 8
    assert prefix.match(prompt + [7, 9, 99]) <= 7
    assert prefix.check_invariants() == ""


def test_a_round_keeps_its_layers_alive():
    round_ = kvsnap.Speculation([kvsnap.KVCache()], seq=0)
    round_.begin(0)
    round_.cancel()
    assert not round_.open
    with pytest.raises(kvsnap.Error, match=r"^Speculation::begin: drafts -1"):
        round_.begin(-1)


def test_a_round_refuses_a_layer_someone_else_scheduled():
    attention, window = kvsnap.KVCache(), kvsnap.RotatingKVCache(WINDOW)
    write(attention, 0, 10)
    write(window, 0, 10)
    attention.prepare_snapshots([30])  # an attention layer would only rewind: still refused
    round_ = kvsnap.Speculation([window, attention, attention])  # listed twice: one layer
    with pytest.raises(kvsnap.Error, match=r"^Speculation::begin: layer 1 has captures scheduled"):
        round_.begin(3)
    assert not round_.open
    attention.cancel_snapshots()
    round_.begin(3)
    write(attention, 10, 14)
    write(window, 10, 14)
    window.cancel_snapshots()  # the round's captures, dropped by another call
    with pytest.raises(kvsnap.Error, match=r"^Speculation::accept: the round's captures .* were taken, replaced or lost"):
        round_.accept(0)
    assert round_.open and attention.offset == 14 and window.offset == 14  # nothing moved
    round_.cancel()
    assert not round_.open and attention.offset == 14


def test_layers_are_taken_from_one_pass_over_the_sequence():
    class FreshLayers:
        """A sequence that makes a new cache for every item it is asked for."""

        def __len__(self):
            return 1

        def __getitem__(self, i):
            if i >= 1:
                raise IndexError(i)
            return kvsnap.KVCache()

    round_ = kvsnap.Speculation(FreshLayers())
    junk = [kvsnap.RecurrentCache(1, 1, 1, 1, 1) for _ in range(100)]  # reuse freed memory
    round_.begin(2)
    assert round_.open and round_.start == 0 and round_.drafts == 2 and junk
    round_.cancel()
    with pytest.raises(kvsnap.Error, match=r"^Speculation: layers\[0\] has type float"):
        kvsnap.Speculation([1.5])
