"""Kernel layer: packing 0/1 data into words, viewing packed words as 64-bit, unpacking to int8.

CUDA kernels run on numba's CUDA simulator where no GPU is visible (small sizes), on the real
GPU otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_bits
from numba import cuda

from dask_gpuchunk._kernels.bitpack import (
    BitValueError,
    bitpack_cpu,
    bitpack_cuda,
    check_bits_dtype,
    check_words_dtype,
    reference_bitpack,
    unpack_int8_cuda,
    words64,
)

BIT_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"]
SHAPES = [(1, 1), (3, 63), (4, 64), (5, 65), (2, 130), (6, 200), (0, 5), (3, 0)]


def popcounts(words: np.ndarray) -> np.ndarray:
    """Set bits per row of packed words of any unsigned dtype."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=1).sum(axis=1)


def test_reference_layout():
    x = np.zeros((1, 130), dtype=np.uint8)
    x[0, [0, 63, 64, 129]] = 1
    words = reference_bitpack(x)
    assert words.dtype == np.uint64 and words.shape == (1, 3)
    assert words[0].tolist() == [1 | (1 << 63), 1, 2]


@pytest.mark.parametrize("dtype", BIT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bitpack_cpu_matches_reference(rng, shape, dtype):
    x = random_bits(rng, shape, 0.4, dtype)
    words = bitpack_cpu(x)
    np.testing.assert_array_equal(words, reference_bitpack(x))
    assert words.shape == (shape[0], -(-shape[1] // 64))


def test_bitpack_cpu_non_contiguous_and_big_endian(rng):
    x = random_bits(rng, (9, 150), 0.5, np.int16)
    np.testing.assert_array_equal(bitpack_cpu(x[::2, 3:]), reference_bitpack(x[::2, 3:]))
    b = random_bits(rng, (9, 150), 0.5, np.uint8)
    np.testing.assert_array_equal(bitpack_cpu(b[::2, 3::2]), reference_bitpack(b[::2, 3::2]))
    np.testing.assert_array_equal(bitpack_cpu(x.astype(">i2")), reference_bitpack(x))


@pytest.mark.parametrize("dtype, bad", [(np.int16, 2), (np.int16, -1), (np.int16, 255),
                                        (np.int8, -1), (np.uint8, 2), (np.uint8, 128)])
def test_bitpack_cpu_names_bad_value_and_place(rng, dtype, bad):
    # One-byte data goes through the 8-columns-per-multiply kernel, wider data through the other.
    x = random_bits(rng, (5, 70), 0.5, dtype)
    x[3, 66] = bad
    x[4, 1] = bad
    with pytest.raises(BitValueError, match=rf"found {bad} at row 103, column 66\b"):
        bitpack_cpu(x, origin=(100, 0))


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int64"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 63), (2, 65), (3, 129)])
def test_bitpack_cuda_matches_reference(rng, shape, dtype):
    x = random_bits(rng, shape, 0.5, dtype)
    words = bitpack_cuda(cuda.to_device(x)).copy_to_host()
    np.testing.assert_array_equal(words, reference_bitpack(x))


def test_bitpack_cuda_names_bad_value(rng):
    x = random_bits(rng, (4, 70), 0.5, np.int8)
    x[2, 68] = 7
    with pytest.raises(BitValueError, match=r"found 7 at row 12, column 68\b"):
        bitpack_cuda(cuda.to_device(x), origin=(10, 0))


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64", ">u2", ">u8"])
@pytest.mark.parametrize("words", [1, 3, 8, 9])
def test_words64_keeps_the_bits_of_each_row(rng, dtype, words):
    w = rng.integers(0, 256, size=(5, words * np.dtype(dtype).itemsize), dtype=np.uint8)
    w = w.view(np.dtype(dtype).newbyteorder('=')).astype(dtype)
    w64 = words64(w)
    assert w64.dtype == np.uint64 and w64.flags.c_contiguous
    assert w64.shape == (5, -(-(words * np.dtype(dtype).itemsize) // 8))
    np.testing.assert_array_equal(popcounts(w64), popcounts(w))
    # the same bits land in the same places in every row: AND-popcounts are unchanged
    pair = np.unpackbits(np.ascontiguousarray(w[:1] & w[1:2]).view(np.uint8)).sum()
    assert int(popcounts(w64[:1] & w64[1:2])[0]) == pair


def test_words64_uint64_is_not_copied():
    w = np.arange(6, dtype=np.uint64).reshape(2, 3)
    assert words64(w) is w


def test_check_dtypes():
    assert check_bits_dtype(">i4") == np.dtype("int32")
    with pytest.raises(TypeError, match="bool or integer"):
        check_bits_dtype("complex64")
    with pytest.raises(TypeError, match="unsigned integer"):
        check_words_dtype("bool")


@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (4, 5)])
def test_unpack_int8_cuda(rng, shape):
    words = rng.integers(0, 2**64, size=shape, dtype=np.uint64)
    out = cuda.device_array((shape[0], shape[1] * 64), dtype=np.int8)
    unpack_int8_cuda(cuda.to_device(words), out)
    unpacked = out.copy_to_host()
    assert set(np.unique(unpacked)) <= {0, 1}
    np.testing.assert_array_equal(unpacked.sum(axis=1), popcounts(words))
    # byte 8q+b of a row is bit b of byte q of the row's words
    expected = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
    np.testing.assert_array_equal(unpacked, expected)


def test_unpack_int8_cuda_checks_out_shape():
    with pytest.raises(ValueError, match="out must be int8"):
        unpack_int8_cuda(cuda.to_device(np.zeros((2, 1), np.uint64)),
                         cuda.device_array((2, 63), dtype=np.int8))
