"""Kernel layer: the Hopper ``wgmma`` Gram kernel.

Where ``nvcc`` is installed (CI's machine has it, and no GPU), every tile's source goes through
``ptxas`` for ``sm_90a``: the inline PTX is valid, nothing spills and ``ptxas`` does not
serialise the asynchronous instructions. The ``gpu`` tests check it exact on a Hopper GPU, on
every tile here; the default tile on odd sizes beside bmma's kernel in test_gram_kernels.py.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from helpers import assert_assembles_for_sm90a, random_bits

from dask_gpuchunk._kernels.bitpack import reference_bitpack
from dask_gpuchunk._kernels.gram import reference_gram
from dask_gpuchunk._kernels.wgmma import TILE, WgmmaTile, _check_tile, kernel_source

TILES = [TILE, WgmmaTile(128, 128, 4, 1024, 8), WgmmaTile(128, 256, 3, 1024, 8),
         WgmmaTile(256, 128, 3, 1024, 4), WgmmaTile(128, 256, 2, 1024, 1)]


@pytest.mark.slow  # ptxas alone: the same in every CI job, run in the first
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to assemble the kernel with")
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t)))
def test_wgmma_source_assembles_for_sm90a_without_spills(tmp_path, tile):
    assert_assembles_for_sm90a(tmp_path, "gram_wgmma", kernel_source(tile))


def test_wgmma_tile_checks():
    _check_tile(TILE)
    assert TILE.shared_bytes == TILE.stages * ((TILE.bm + TILE.bn) * TILE.kbits // 8 + 16) + 1024
    assert TILE.threads == 128 * (TILE.bm // 64 + 1)
    assert "m64n128k256.s32.b1.b1.and.popc" in kernel_source(TILE)
    for bad in (WgmmaTile(96, 256), WgmmaTile(128, 200), WgmmaTile(64, 256), WgmmaTile(128, 64),
                WgmmaTile(128, 256, 1), WgmmaTile(128, 256, 4, 384), WgmmaTile(128, 256, 4, 512),
                WgmmaTile(128, 256, 4, 1024, 0),
                WgmmaTile(256, 256, 4, 2048)):
        with pytest.raises(ValueError, match="bad wgmma tile"):
            _check_tile(bad)


def _hopper() -> None:
    from dask_gpuchunk._kernels.wgmma import wgmma_supported

    if not wgmma_supported():
        pytest.skip("wgmma needs a Hopper GPU (compute capability 9.0)")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "x".join(map(str, t)))
def test_wgmma_cuda_tile_shapes_and_rectangles(rng, tile):
    import cupy

    from dask_gpuchunk._kernels.wgmma import wgmma_cuda

    _hopper()
    for na, nb, k in ((5, 5, 70), (333, 333, 1043), (600, 77, 4100), (45, 301, 2050)):
        a = random_bits(rng, (na, k), rng.uniform(0.05, 0.95))
        b = random_bits(rng, (nb, k), rng.uniform(0.05, 0.95))
        wa, wb = cupy.asarray(reference_bitpack(a)), cupy.asarray(reference_bitpack(b))
        c = cupy.empty((na, nb), dtype=np.int32)
        wgmma_cuda(wa, wb, c, tile=tile)
        expected = (a.astype(np.float64) @ b.T.astype(np.float64)).astype(np.int32)
        np.testing.assert_array_equal(cupy.asnumpy(c), expected, err_msg=f"{tile} {na}x{nb}x{k}")
        if na == nb:
            c = cupy.empty((na, na), dtype=np.int32)
            wgmma_cuda(wa, None, c, tile=tile)
            np.testing.assert_array_equal(cupy.asnumpy(c), reference_gram(a),
                                          err_msg=f"{tile} diagonal {na}x{k}")


@pytest.mark.gpu
def test_wgmma_cuda_takes_strided_and_odd_width_words(rng):
    # The copy engine needs contiguous rows of whole 16-byte pieces: views and odd word counts
    # are copied first, with the same counts.
    import cupy

    from dask_gpuchunk._kernels.wgmma import wgmma_cuda

    _hopper()
    a = random_bits(rng, (300, 1000), 0.4)
    words = cupy.asarray(reference_bitpack(a))  # 16 words a row
    wide = cupy.zeros((300, 40), dtype=np.uint64)
    wide[:, 3:19] = words
    for view in (wide[:, 3:19], wide[:, 3:20], words[:, :15], words[1:, :]):
        bits = np.unpackbits(cupy.asnumpy(view).view(np.uint8), axis=1)
        expected = reference_gram(bits)
        c = cupy.empty((view.shape[0],) * 2, dtype=np.int32)
        wgmma_cuda(view, None, c)
        np.testing.assert_array_equal(cupy.asnumpy(c), expected)
        wgmma_cuda(view, view, c)
        np.testing.assert_array_equal(cupy.asnumpy(c), expected)


@pytest.mark.gpu
def test_tensor_maps_are_kept_for_the_same_words_and_right_after_reuse(rng):
    # A map depends on the words' address and shape only: made once, reused, and still right
    # when new words land at the same address.
    import cupy

    from dask_gpuchunk._kernels.wgmma import tensor_map, wgmma_cuda

    _hopper()
    words = cupy.asarray(reference_bitpack(random_bits(rng, (200, 1024), 0.3)))
    assert tensor_map(words)[0] is tensor_map(words)[0]
    assert tensor_map(words[:100])[0] is not tensor_map(words)[0]
    for density in (0.2, 0.7):
        bits = random_bits(rng, (200, 1024), density)
        words[...] = cupy.asarray(reference_bitpack(bits))
        c = cupy.empty((200, 200), dtype=np.int32)
        wgmma_cuda(words, words[:200], c)
        np.testing.assert_array_equal(cupy.asnumpy(c), reference_gram(bits))
