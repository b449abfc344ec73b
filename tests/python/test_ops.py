"""The reference kernels from Python, against numpy."""
import numpy as np
import pytest

import kvsnap


def test_sdpa_over_a_cache_history_equals_numpy_attention(rng):
    cache = kvsnap.KVCache()
    keys = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    values = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    q = rng.standard_normal((1, 4, 6, 4)).astype(np.float32)  # GQA: 4 query heads, 2 KV heads
    batch = kvsnap.Batch.uniform(1, 6, 0)
    history = cache.update(batch, keys, values)
    out = kvsnap.sdpa(batch, q, history, kvsnap.AttentionMask.causal(), 0.5)
    scores = np.einsum("hld,hkd->hlk", q[0], np.repeat(keys[0], 2, axis=0)) * 0.5
    scores = np.where(np.tril(np.ones((6, 6), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = np.einsum("hlk,hkd->hld", weights, np.repeat(values[0], 2, axis=0))
    np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6)


def test_kernels_run_in_segments_with_carried_state(rng):
    x = rng.standard_normal((1, 6, 3)).astype(np.float32)
    weight = rng.standard_normal((3, 4)).astype(np.float32)
    whole, tails = kvsnap.causal_conv1d(x, weight, boundaries=[2])
    first, [tail] = kvsnap.causal_conv1d(x[:, :2], weight)
    rest, _ = kvsnap.causal_conv1d(x[:, 2:], weight, tail)
    np.testing.assert_allclose(whole, np.concatenate([first, rest], axis=1), rtol=1e-6)
    np.testing.assert_array_equal(tails[0], tail)

    q, k = (rng.standard_normal((1, 5, 1, 2)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 5, 2, 2)).astype(np.float32)
    g = np.full((1, 5, 2), 0.9, np.float32)
    beta = np.full((1, 5, 2), 0.5, np.float32)
    out, [middle, end] = kvsnap.gated_delta(q, k, v, g, beta, boundaries=[3])
    late, [again] = kvsnap.gated_delta(q[:, 3:], k[:, 3:], v[:, 3:], g[:, 3:], beta[:, 3:], middle)
    np.testing.assert_allclose(out[:, 3:], late, rtol=1e-5)
    np.testing.assert_allclose(end, again, rtol=1e-5)


def test_every_thread_count_gives_bitwise_the_same_attention(rng):
    q = rng.standard_normal((3, 8, 20, 16)).astype(np.float32)
    keys = rng.standard_normal((3, 2, 50, 16)).astype(np.float32)
    values = rng.standard_normal((3, 2, 50, 12)).astype(np.float32)
    history = kvsnap.KVCache().update(kvsnap.Batch.uniform(3, 50, 0), keys, values)
    batch = kvsnap.Batch.uniform(3, 20, 30)  # the last 20 positions' queries
    mask = kvsnap.AttentionMask.causal()
    assert kvsnap.threads() == 1
    one = kvsnap.sdpa(batch, q, history, mask, 0.25)
    try:
        kvsnap.set_threads(3)
        assert kvsnap.threads() == 3
        np.testing.assert_array_equal(kvsnap.sdpa(batch, q, history, mask, 0.25), one)
    finally:
        kvsnap.set_threads(1)
    with pytest.raises(kvsnap.Error, match=r"set_threads: 0 threads is outside \[1, 256\]"):
        kvsnap.set_threads(0)
    assert kvsnap.threads() == 1
