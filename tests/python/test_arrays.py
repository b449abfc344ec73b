"""Arrays cross between numpy and kvsnap without copies where the layout allows."""
import array as pyarray
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
    # Another dtype converts the values the bits stand for, not the bits as integers.
    np.testing.assert_array_equal(np.asarray(wrapped, dtype=np.float32), [1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(wrapped, dtype=np.float64), [1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(wrapped, dtype=np.uint16), bits)


def test_array_protocol_copy_keyword():
    # numpy 2 passes copy= to __array__: True always copies, False refuses a conversion.
    source = np.arange(4, dtype=np.float32)
    wrapped = kvsnap.Array(source)
    assert np.shares_memory(wrapped.__array__(copy=False), source)
    assert np.shares_memory(wrapped.__array__(np.float32, copy=None), source)
    copied = wrapped.__array__(copy=True)
    assert not np.shares_memory(copied, source)
    np.testing.assert_array_equal(copied, source)
    with pytest.raises(ValueError, match="copy=False"):
        wrapped.__array__(np.float64, copy=False)
    bf16 = kvsnap.Array(np.array([0x3F80], dtype=np.uint16))
    with pytest.raises(ValueError, match="bf16 to float32 needs a copy"):
        bf16.__array__(np.float32, copy=False)
    np.testing.assert_array_equal(bf16.__array__(np.float32, copy=True), [1.0])


def test_a_capsule_without_a_name_is_refused():
    import ctypes

    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

    class Unnamed:
        def __dlpack__(self, stream=None):
            return new_capsule(1, None, None)

    with pytest.raises(kvsnap.Error, match='not a "dltensor"'):
        kvsnap.Array.from_dlpack(Unnamed())


def test_a_copied_dlpack_tensor_is_held_to_the_byte_offset_limit_too():
    # A tensor with a negative stride is copied, not viewed: its byte_offset is checked as a
    # view's is (it was read from unchecked, 2^63 bytes past the data).
    import ctypes

    class Device(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class DataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class Tensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", Device), ("ndim", ctypes.c_int32),
                    ("dtype", DataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                    ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]

    class Managed(ctypes.Structure):
        _fields_ = [("dl_tensor", Tensor), ("manager_ctx", ctypes.c_void_p),
                    ("deleter", ctypes.c_void_p)]

    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    values = np.arange(4, dtype=np.float32)
    shape, strides = (ctypes.c_int64 * 1)(4), (ctypes.c_int64 * 1)(-1)

    def producer(byte_offset):
        managed = Managed()
        managed.dl_tensor = Tensor(values.ctypes.data + 12, Device(1, 0), 1, DataType(2, 32, 1),
                                   shape, strides, byte_offset)

        class Producer:
            def __dlpack__(self, stream=None):
                return new_capsule(ctypes.addressof(managed), b"dltensor", None)

        return Producer(), managed  # the struct lives as long as the test holds it

    reversed_, kept = producer(0)
    np.testing.assert_array_equal(kvsnap.Array.from_dlpack(reversed_).numpy(), [3, 2, 1, 0])
    hostile, kept = producer(2**63)
    with pytest.raises(kvsnap.Error, match=r"byte_offset 9223372036854775808 is more than 2\^62"):
        kvsnap.Array.from_dlpack(hostile)


def test_unsupported_arrays_raise_kvsnap_error():
    with pytest.raises(kvsnap.Error, match=r"^kvsnap.Array: numpy dtype float64 is not supported"):
        kvsnap.Array(np.zeros(3))
    with pytest.raises(kvsnap.Error, match="kvsnap arrays have at most 4"):
        kvsnap.Array(np.zeros((1, 1, 1, 1, 1), np.float32))
    # Refused before anything else, naming the call (Shape itself holds at most 8 extents).
    with pytest.raises(kvsnap.Error, match=r"^kvsnap.Array: numpy array of 9 axes"):
        kvsnap.Array(np.zeros((1,) * 9, np.dtype(">f4")))


def test_python_numbers_become_the_dtypes_kvsnap_holds():
    assert kvsnap.Array([[1, 2], [3, 4]]).numpy().dtype == np.int32
    floats = kvsnap.Array((0.5, 1.25))
    assert floats.numpy().dtype == np.float32 and floats.numpy().tolist() == [0.5, 1.25]
    assert kvsnap.AttentionMask.from_array([[[[1, 0], [1, 1]]]]).kind == "array"  # int32
    with pytest.raises(kvsnap.Error, match=r"^kvsnap.Array: Python ints outside int32"):
        kvsnap.Array([2**31])
    with pytest.raises(kvsnap.Error, match=r"^kvsnap.Array: Python floats outside float32"):
        kvsnap.Array([1e39])
    # Buffers keep their dtype and memory: only Python numbers are narrowed.
    buffer = pyarray.array("f", [1.0, 2.0])
    view = kvsnap.Array(buffer)
    assert view.numpy().dtype == np.float32 and np.shares_memory(view.numpy(), np.asarray(buffer))
    assert kvsnap.Array(memoryview(np.zeros(2, np.uint16))).numpy().dtype == np.uint16
    # A numpy array keeps its dtype: an int64 one is refused, not narrowed behind its back.
    with pytest.raises(kvsnap.Error, match=r"numpy dtype int64 is not supported"):
        kvsnap.Array(np.array([1, 2]))


def test_dlpack_export_takes_the_protocols_keywords():
    # numpy >= 2.1 and the array API pass max_version, dl_device and copy as keywords.
    array = kvsnap.Array(np.arange(4, dtype=np.float32))
    for capsule in (array.__dlpack__(max_version=(1, 0)), array.__dlpack__(dl_device=(1, 0)),
                    array.__dlpack__(stream=None, max_version=(1, 0), dl_device=(1, 0), copy=True)):
        np.testing.assert_array_equal(kvsnap.Array.from_dlpack(Capsule(capsule)).numpy(),
                                      np.arange(4, dtype=np.float32))
    with pytest.raises(BufferError, match=r"dl_device \(2, 0\) asked; kvsnap arrays are on the CPU"):
        array.__dlpack__(dl_device=(2, 0))


class Capsule:
    """A DLPack producer handing out one capsule made before."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, stream=None):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


def test_dlpack_exchanges_arrays_both_ways_without_a_copy():
    source = np.arange(12, dtype=np.float32).reshape(3, 4)
    imported = kvsnap.Array.from_dlpack(source)
    assert np.shares_memory(np.asarray(imported), source)
    exported = np.from_dlpack(imported)
    assert np.shares_memory(exported, source)
    np.testing.assert_array_equal(exported, source)


def test_read_only_memory_stays_read_only_through_kvsnap_arrays():
    cache = kvsnap.KVCache()
    keys = np.ones((1, 2, 2, 8), np.float32)
    history = cache.update(kvsnap.Batch.uniform(1, 2, 0), keys, keys)
    snapshot = cache.snapshot(0)  # lazy: names the live slots a write through a view would change
    for view in (history.keys, history.keys.base, cache.state()[0]):
        rewrapped = kvsnap.Array(view)
        assert rewrapped.read_only
        for numpy_view in (rewrapped.numpy(), np.asarray(rewrapped)):
            assert not numpy_view.flags.writeable
            with pytest.raises(ValueError, match="read-only"):
                numpy_view[...] = 9
    assert cache.restore(None, 0) and cache.restore(snapshot, 2)
    np.testing.assert_array_equal(cache.state()[0], keys)

    immutable = bytes(16)
    wrapped = kvsnap.Array(np.frombuffer(immutable, np.float32))
    assert wrapped.read_only and not wrapped.numpy().flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        wrapped.numpy()[0] = 1
    assert immutable == bytes(16)
    writable = kvsnap.Array(np.zeros(4, np.float32))
    assert not writable.read_only and writable.numpy().flags.writeable


def test_dlpack_exports_a_copy_of_a_read_only_array():
    cache = kvsnap.KVCache()
    keys = np.arange(16, dtype=np.float32).reshape(1, 2, 2, 4)
    view = cache.update(kvsnap.Batch.uniform(1, 2, 0), keys, keys).keys.base
    exported = np.from_dlpack(view)
    assert not np.shares_memory(exported, np.asarray(view))
    np.testing.assert_array_equal(exported, keys)
    copied = kvsnap.Array.from_dlpack(view)
    assert not copied.read_only and not copied.shares_storage(view)
    with pytest.raises(BufferError, match=r"^Array.__dlpack__: copy=False, but this array is"):
        view.__dlpack__(copy=False)
    source = np.ones(3, np.float32)
    writable = kvsnap.Array(source)
    assert np.shares_memory(np.from_dlpack(writable), source)  # writable: a view

    class AskingForACopy:
        def __dlpack__(self, stream=None):
            return writable.__dlpack__(stream, copy=True)

        def __dlpack_device__(self):
            return writable.__dlpack_device__()

    assert not np.shares_memory(np.from_dlpack(AskingForACopy()), source)


def test_misaligned_numpy_input_is_copied_not_refused():
    blob = b"\0\0" + np.arange(64, dtype=np.float32).tobytes()  # a tensor at byte offset 2
    keys = np.frombuffer(blob, np.float32, offset=2).reshape(1, 2, 4, 8)
    assert not keys.flags.aligned and keys.flags.c_contiguous
    references = sys.getrefcount(keys)
    wrapped = kvsnap.Array(keys)
    assert not np.shares_memory(np.asarray(wrapped), keys) and wrapped.read_only
    history = kvsnap.KVCache().update(kvsnap.Batch.uniform(1, 4, 0), keys, keys)
    np.testing.assert_array_equal(history.keys, keys)
    del wrapped, history
    assert sys.getrefcount(keys) == references


def test_misaligned_dlpack_tensors_are_copied_not_refused():
    blob = bytearray(b"\0\0" + np.arange(8, dtype=np.float32).tobytes())
    misaligned = np.frombuffer(blob, np.float32, offset=2)  # writable, exported as it is
    assert not misaligned.flags.aligned
    for view in (misaligned, misaligned.reshape(2, 4)[:, ::2]):
        imported = kvsnap.Array.from_dlpack(view)
        assert not np.shares_memory(np.asarray(imported), misaligned)
        np.testing.assert_array_equal(np.asarray(imported), view)


def test_dlpack_tensors_with_negative_strides_are_copied():
    source = np.arange(24, dtype=np.float32).reshape(4, 6)
    for view in (source[:, ::-1], source[::-2, 1::2], source[::-1].T):
        imported = kvsnap.Array.from_dlpack(view)
        assert not np.shares_memory(np.asarray(imported), source)
        np.testing.assert_array_equal(np.asarray(imported), view)
    with pytest.raises(kvsnap.Error, match="dtype .* is not supported"):
        kvsnap.Array.from_dlpack(np.zeros(3)[::-1])


def test_from_dlpack_keeps_the_producer_alive_and_lets_go_of_it():
    source = np.ones((2, 3), np.float32)
    references = sys.getrefcount(source)
    imported = kvsnap.Array.from_dlpack(source)
    assert sys.getrefcount(source) > references
    del imported
    assert sys.getrefcount(source) == references
