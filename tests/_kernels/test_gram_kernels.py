"""Kernel layer: Gram blocks of packed words, popcount on CPU and CUDA, int8 through cuBLAS.

CUDA popcount runs on numba's CUDA simulator where no GPU is visible (small sizes, a small
tile), on the real GPU otherwise; the int8 method needs cuBLAS, so a real GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_bits
from numba import cuda

from dask_gpuchunk._kernels.bitpack import reference_bitpack
from dask_gpuchunk._kernels.gram import (
    SIM_TILE,
    TileShape,
    _popcount_cuda_source,
    int8_cuda,
    popcount_cpu,
    popcount_cuda,
    reference_gram,
    transpose_cpu,
)

SIZES = [1, 7, 63, 64, 65, 130]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("k", [1, 63, 64, 65, 1043])
def test_popcount_cpu_symmetric(rng, n, k):
    a = random_bits(rng, (n, k), rng.uniform(0.05, 0.95))
    np.testing.assert_array_equal(popcount_cpu(reference_bitpack(a), None), reference_gram(a))


@pytest.mark.parametrize("na, nb", [(1, 9), (9, 1), (5, 70), (67, 13)])
def test_popcount_cpu_rectangular(rng, na, nb):
    a = random_bits(rng, (na, 200), 0.3)
    b = random_bits(rng, (nb, 200), 0.7)
    expected = (a.astype(np.int64) @ b.T.astype(np.int64)).astype(np.int32)
    got = popcount_cpu(reference_bitpack(a), reference_bitpack(b))
    np.testing.assert_array_equal(got, expected)


def test_popcount_cpu_dense_counts_exactly(rng):
    a = np.ones((5, 3000), dtype=np.uint8)
    a[2, :7] = 0
    np.testing.assert_array_equal(popcount_cpu(reference_bitpack(a), None), reference_gram(a))


def test_popcount_cpu_word_mismatch():
    with pytest.raises(ValueError, match="word counts differ"):
        popcount_cpu(np.zeros((2, 3), np.uint64), np.zeros((2, 4), np.uint64))


def test_tile_source_is_generated_for_any_shape():
    source = _popcount_cuda_source(TileShape(3, 5, 2, 3, 3))
    compile(source, "<test>", "exec")
    assert source.count("cuda.popc") == 2 * 3 * 3


@pytest.mark.parametrize("n, k", [(1, 1), (7, 63), (9, 65), (13, 130)])
def test_popcount_cuda_symmetric(rng, n, k):
    a = random_bits(rng, (n, k), rng.uniform(0.1, 0.9))
    c = cuda.device_array((n, n), dtype=np.int32)
    popcount_cuda(cuda.to_device(reference_bitpack(a)), None, c)
    np.testing.assert_array_equal(c.copy_to_host(), reference_gram(a))


@pytest.mark.parametrize("na, nb, k", [(3, 11, 70), (10, 2, 129)])
def test_popcount_cuda_rectangular_and_odd_tile(rng, na, nb, k):
    a = random_bits(rng, (na, k), 0.5)
    b = random_bits(rng, (nb, k), 0.5)
    expected = (a.astype(np.int64) @ b.T.astype(np.int64)).astype(np.int32)
    for tile in (None, SIM_TILE, TileShape(1, 3, 1, 2, 3)):
        c = cuda.device_array((na, nb), dtype=np.int32)
        popcount_cuda(cuda.to_device(reference_bitpack(a)), cuda.to_device(reference_bitpack(b)),
                      c, tile=tile)
        np.testing.assert_array_equal(c.copy_to_host(), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 1041, 1043])
@pytest.mark.parametrize("k", [1, 65, 1043, 5000])
def test_popcount_and_int8_cuda_on_gpu(rng, n, k):
    import cupy

    a = random_bits(rng, (n, k), rng.uniform(0.01, 0.99))
    words = cupy.asarray(reference_bitpack(a))
    expected = reference_gram(a)
    for method in ("popcount", "int8"):
        for b in (None, words):
            c = cupy.empty((n, n), dtype=np.int32)
            if method == "int8":
                int8_cuda(words, b, c)
            else:
                popcount_cuda(words, b, c)
            np.testing.assert_array_equal(cupy.asnumpy(c), expected, err_msg=f"{method} {b is None}")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["int8", "bmma"])
def test_tensor_core_kernels_rectangular(rng, kernel):
    import cupy

    from dask_gpuchunk._kernels.bmma import bmma_cuda

    a = random_bits(rng, (301, 777), 0.5)
    b = random_bits(rng, (45, 777), 0.2)
    c = cupy.empty((301, 45), dtype=np.int32)
    run = {"int8": int8_cuda, "bmma": bmma_cuda}[kernel]
    run(cupy.asarray(reference_bitpack(a)), cupy.asarray(reference_bitpack(b)), c)
    expected = (a.astype(np.int64) @ b.T.astype(np.int64)).astype(np.int32)
    np.testing.assert_array_equal(cupy.asnumpy(c), expected)


@pytest.mark.parametrize("shape", [(1, 1), (1, 200), (130, 67), (64, 64), (300, 129)])
def test_transpose_cpu(rng, shape):
    block = rng.integers(-1000, 1000, size=shape).astype(np.int32)
    out = transpose_cpu(block)
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out, block.T)


def _one_bit_kernel(name: str):
    """bmma_cuda or wgmma_cuda; the latter skipped off Hopper GPUs."""
    from dask_gpuchunk._kernels.bmma import bmma_cuda
    from dask_gpuchunk._kernels.wgmma import wgmma_cuda, wgmma_supported

    if name == "wgmma" and not wgmma_supported():
        pytest.skip("wgmma needs a Hopper GPU (compute capability 9.0)")
    return {"bmma": bmma_cuda, "wgmma": wgmma_cuda}[name]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["bmma", "wgmma"])
@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 129, 257, 1041, 1043])
@pytest.mark.parametrize("k", [1, 65, 255, 256, 257, 1025, 1043, 5000])
def test_one_bit_kernels_on_gpu(rng, kernel, n, k):
    import cupy

    run = _one_bit_kernel(kernel)
    a = random_bits(rng, (n, k), rng.uniform(0.01, 0.99))
    words = cupy.asarray(reference_bitpack(a))
    expected = reference_gram(a)
    for b in (None, words):
        c = cupy.empty((n, n), dtype=np.int32)
        run(words, b, c)
        np.testing.assert_array_equal(cupy.asnumpy(c), expected, err_msg=f"diagonal={b is None}")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(128, 128, 64, 64, 4, 512, 1, 0), (128, 256, 64, 64, 3, 1024, 8, 1),
                                  (256, 128, 64, 64, 2, 2048, 3, 1), (64, 128, 32, 64, 3, 1024, 2, 0)])
def test_bmma_cuda_tile_shapes(rng, tile):
    import cupy

    from dask_gpuchunk._kernels.bmma import BmmaTile, bmma_cuda

    tile = BmmaTile(*tile)
    for n, k in ((5, 70), (333, 1043), (600, 4100)):
        a = random_bits(rng, (n, k), rng.uniform(0.05, 0.95))
        words = cupy.asarray(reference_bitpack(a))
        expected = reference_gram(a)
        for b in (None, words):
            c = cupy.empty((n, n), dtype=np.int32)
            bmma_cuda(words, b, c, tile=tile)
            np.testing.assert_array_equal(cupy.asnumpy(c), expected,
                                          err_msg=f"{tile} n={n} k={k} diagonal={b is None}")


def test_bmma_tile_checks():
    from dask_gpuchunk._kernels.bmma import TILE, BmmaTile, _check_tile

    _check_tile(TILE)
    assert TILE.shared_bytes == TILE.stages * (TILE.bm + TILE.bn) * TILE.kbits // 8
    for bad in (BmmaTile(128, 128, 48, 64, 3), BmmaTile(128, 128, 64, 64, 1),
                BmmaTile(128, 128, 64, 64, 3, kbits=256), BmmaTile(1024, 256, 64, 64, 3),
                BmmaTile(128, 128, 64, 64, 3, group=0)):
        with pytest.raises(ValueError, match="bad bmma tile"):
            _check_tile(bad)
