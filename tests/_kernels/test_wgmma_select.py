"""Kernel layer: top-k and threshold selection in the Hopper kernel's epilogue.

Where ``nvcc`` is installed (CI's machine has it, and no GPU), each selection kernel's source
goes through ``ptxas`` for ``sm_90a``: valid, within the shared memory a block may have, the
asynchronous instructions kept asynchronous, and no spills for the metrics users run most. The
``gpu`` tests of test_bmma_select.py check both kernels exact against the host path on a Hopper
GPU (the ``wgmma`` cases of each test there).
"""

from __future__ import annotations

import shutil

import pytest
from helpers import assert_assembles_for_sm90a

from dask_gpuchunk._kernels import wgmma_select
from dask_gpuchunk._kernels.wgmma import TILE


@pytest.mark.slow  # ptxas alone (12-14 s a top-k source): the same in every CI job
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc to assemble the kernel with")
@pytest.mark.parametrize("name, metric, spills_at_most", [
    ("pairs_at_least_wgmma", "tanimoto", 0),
    # Cosine's square roots and the persistent loop's state: ptxas (CUDA 13.0) spills 20
    # bytes of the threshold kernel, outside its counts' loop; the top-k's loop state 68
    # bytes, stored and loaded around each tile's counts, none in their 32 steps' selection.
    ("pairs_at_least_wgmma", "cosine", 64), ("top_k_candidates_wgmma", "tanimoto", 72)])
def test_selection_sources_assemble_for_sm90a_without_spills(tmp_path, name, metric,
                                                             spills_at_most):
    assert_assembles_for_sm90a(tmp_path, name, wgmma_select.select_source(name, metric),
                               spills_at_most)


def test_selection_sources_name_one_kernel_and_one_metric():
    source = wgmma_select.select_source("pairs_at_least_wgmma", "dice")
    assert "#define SELECT_METRIC 1" in source
    assert "pairs_at_least_wgmma(" in source and "top_k_candidates_wgmma(" not in source
    with pytest.raises(ValueError, match="no wgmma selection kernel"):
        wgmma_select.select_source("gram_wgmma", "tanimoto")
    # The stages, the columns' data and the warps' queues fit a block's 227 KiB; the
    # threshold kernel's column buffers fit what the launch gives (the top-k's).
    assert TILE.shared_bytes < wgmma_select.shared_bytes(TILE) <= 227 * 1024
    assert wgmma_select._threshold_bytes(TILE) <= wgmma_select.shared_bytes(TILE)
