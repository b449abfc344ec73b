"""Arrays cross between numpy and kvsnap without copies where the layout allows."""
import sys

import numpy as np
import pytest

import kvsnap


def test_wrapping_a_numpy_array_copies_nothing_and_allocates_nothing():
    source = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    before = kvsnap.live_bytes()
    wrapped = kvsnap.Array(source)
    assert kvsnap.live_bytes() == before
    assert np.shares_memory(np.asarray(wrapped), source)
    assert wrapped.shape == (2, 3, 4) and wrapped.dtype == "f32" and wrapped.strides == (12, 4, 1)


def test_a_strided_view_is_wrapped_with_its_strides():
    source = np.arange(24, dtype=np.float16).reshape(4, 6)
    wrapped = kvsnap.Array(source[:, ::2].T)
    assert wrapped.strides == (2, 6)
    assert np.shares_memory(np.asarray(wrapped), source)
    np.testing.assert_array_equal(np.asarray(wrapped), source[:, ::2].T)


def test_layouts_kvsnap_cannot_name_are_copied_first():
    source = np.arange(6, dtype=np.float32)
    reversed_view = kvsnap.Array(source[::-1])  # a negative stride
    assert not np.shares_memory(np.asarray(reversed_view), source)
    np.testing.assert_array_equal(np.asarray(reversed_view), source[::-1])
    big_endian = kvsnap.Array(source.astype(">f4"))
    np.testing.assert_array_equal(np.asarray(big_endian), source)


def test_kvsnap_keeps_the_numpy_array_alive_and_lets_go_of_it():
    source = np.zeros(8, dtype=np.int32)
    references = sys.getrefcount(source)
    wrapped = kvsnap.Array(source)
    assert sys.getrefcount(source) == references + 1
    del wrapped
    assert sys.getrefcount(source) == references


def test_views_of_kvsnap_memory_keep_it_alive():
    cache = kvsnap.KVCache()
    keys = np.ones((1, 1, 3, 2), np.float32)
    view = cache.update(kvsnap.Batch.uniform(1, 3, 0), keys, keys).keys
    del cache  # the view's base holds the buffer
    np.testing.assert_array_equal(view, keys)
    assert isinstance(view.base, kvsnap.Array) and view.base.read_only


def test_bf16_crosses_as_uint16_bits():
    bits = np.array([0x3F80, 0x4000], dtype=np.uint16)  # 1.0, 2.0 in bfloat16
    wrapped = kvsnap.Array(bits)
    assert wrapped.dtype == "bf16"
    assert np.asarray(wrapped).dtype == np.uint16


def test_unsupported_arrays_raise_kvsnap_error():
    with pytest.raises(kvsnap.Error, match=r"^kvsnap.Array: numpy dtype float64 is not supported"):
        kvsnap.Array(np.zeros(3))
    with pytest.raises(kvsnap.Error, match="kvsnap arrays have at most 4"):
        kvsnap.Array(np.zeros((1, 1, 1, 1, 1), np.float32))


def test_dlpack_exchanges_arrays_both_ways_without_a_copy():
    source = np.arange(12, dtype=np.float32).reshape(3, 4)
    imported = kvsnap.Array.from_dlpack(source)
    assert np.shares_memory(np.asarray(imported), source)
    exported = np.from_dlpack(imported)
    assert np.shares_memory(exported, source)
    np.testing.assert_array_equal(exported, source)
