"""Attention masks and the positions a history's columns hold: explicit arrays, intersections,
lookback windows, the physical mask over a history's columns, and positions in a ring."""
import numpy as np
import pytest

import kvsnap
from conftest import kv


def attention(q, keys, values, visible, scale):
    """Reference attention [1, H, L, Dv] of q [1, H, L, D] over keys [1, H, K, D] where
    visible [L, K] (True: the query sees the key)."""
    scores = np.einsum("bhld,bhkd->bhlk", q, keys) * scale
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhlk,bhkd->bhld", weights, values)


@pytest.fixture
def prefill(rng):
    """A 6-token prefill: (batch, q, keys, values, history)."""
    keys, values, q = kv(rng, 6), kv(rng, 6), kv(rng, 6)
    batch = kvsnap.Batch.uniform(1, 6, 0)
    history = kvsnap.KVCache().update(batch, keys, values)
    return batch, q, keys, values, history


def test_an_explicit_mask_is_boolean_or_an_additive_bias(rng, prefill):
    batch, q, keys, values, history = prefill
    visible = rng.random((6, 6)) > 0.4
    np.fill_diagonal(visible, True)
    expected = attention(q, keys, values, visible, 0.5)
    boolean = kvsnap.AttentionMask.from_array(visible.astype(np.int32)[None, None])
    additive = np.where(visible, 0, -np.inf).astype(np.float32)
    bias = kvsnap.AttentionMask.from_array(additive[None, None])
    assert boolean.kind == bias.kind == "array"
    for mask in (boolean, bias):
        np.testing.assert_allclose(kvsnap.sdpa(batch, q, history, mask, 0.5), expected,
                                   rtol=1e-5, atol=1e-6)


def test_intersect_keeps_the_keys_visible_under_both(rng, prefill):
    batch, q, keys, values, history = prefill
    visible = rng.random((6, 6)) > 0.3
    np.fill_diagonal(visible, True)
    explicit = kvsnap.AttentionMask.from_array(visible.astype(np.int32)[None, None])
    both = kvsnap.AttentionMask.causal().intersect(explicit)
    assert both.kind == "intersection" and both.is_causal
    expected = attention(q, keys, values, visible & np.tri(6, dtype=bool), 0.5)
    np.testing.assert_allclose(kvsnap.sdpa(batch, q, history, both, 0.5), expected,
                               rtol=1e-5, atol=1e-6)
    window = kvsnap.AttentionMask.causal().intersect(kvsnap.AttentionMask.lookback(2))
    assert window.kind == "sliding_window" and window.window == 2


def test_lookback_hides_old_keys_and_keeps_later_ones(prefill):
    batch, q, keys, values, history = prefill
    lookback = kvsnap.AttentionMask.lookback(3)
    assert (lookback.kind, lookback.window, lookback.is_causal) == ("lookback", 3, False)
    assert not lookback.allows(5, 2) and lookback.allows(5, 3) and lookback.allows(5, 9)
    sliding = kvsnap.AttentionMask.sliding_window(3)
    assert sliding.is_causal and sliding.allows(5, 3) and not sliding.allows(5, 6)
    query, key = np.arange(6)[:, None], np.arange(6)[None, :]
    expected = attention(q, keys, values, key > query - 3, 0.5)  # later keys stay visible
    np.testing.assert_allclose(kvsnap.sdpa(batch, q, history, lookback, 0.5), expected,
                               rtol=1e-5, atol=1e-6)


def test_apply_mask_is_the_logical_mask_over_the_history_columns(prefill):
    batch, q, keys, values, history = prefill
    physical = history.apply_mask(batch, kvsnap.AttentionMask.causal())
    assert physical.kind == "array"  # the prefill's queries see different keys
    # A KVCache's column c holds position c, so the physical mask works as a logical one.
    np.testing.assert_array_equal(
        kvsnap.sdpa(batch, q, history, physical, 0.5),
        kvsnap.sdpa(batch, q, history, kvsnap.AttentionMask.causal(), 0.5))
    cache = kvsnap.KVCache()
    step = cache.update(kvsnap.Batch.uniform(1, 6, 0), keys, values)
    decode = kvsnap.Batch.uniform(1, 1, 6)
    step = cache.update(decode, keys[:, :, :1], values[:, :, :1])
    assert step.apply_mask(decode, kvsnap.AttentionMask.causal()).kind == "none"  # sees all


def test_a_rotating_history_names_the_position_of_every_column(rng):
    window = kvsnap.RotatingKVCache(4)
    keys = kv(rng, 7)
    for p in range(7):
        history = window.update(kvsnap.Batch.single([0], p), keys[:, :, p:p + 1],
                                keys[:, :, p:p + 1])
    assert (history.length, history.window) == (4, 4)
    assert (history.first_position, history.oldest_column) == (3, 3)
    assert [history.position(c) for c in range(4)] == [4, 5, 6, 3]
    for c in range(4):  # column c holds the keys of position(c)
        np.testing.assert_array_equal(history.keys[:, :, c], keys[:, :, history.position(c)])
    with pytest.raises(kvsnap.Error, match=r"^KVHistory.position: column 4 out of range \[0, 4\)"):
        history.position(4)
    plain = kvsnap.KVCache().update(kvsnap.Batch.uniform(1, 3, 0), keys[:, :, :3], keys[:, :, :3])
    assert (plain.first_position, plain.oldest_column, plain.position(2)) == (0, 0, 2)


def test_a_ragged_history_has_no_positions_of_its_own(rng):
    cache = kvsnap.KVCache()
    batch = kvsnap.Batch.rows([(0, 0, [1, 2]), (1, 0, [5])])
    step = rng.standard_normal((2, 1, 2, 2)).astype(np.float32)
    history = cache.update(batch, step, step)
    assert history.ragged and history.row(1).length == 1 and history.row(0).position(1) == 1
    for read in (lambda: history.position(1), lambda: history.first_position,
                 lambda: history.oldest_column, lambda: history.window):
        with pytest.raises(kvsnap.Error, match=r"this history is ragged \(2 rows .* row\(b\)"):
            read()
