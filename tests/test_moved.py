"""Old module paths (one release): attributes read through them warn and are the new modules'
own, and importing one leaves ``dg.gram`` and ``dg.similarity`` the functions."""

from __future__ import annotations

import importlib

import pytest

import dask_gpuchunk as dg
from dask_gpuchunk.bits import gram as gram_module
from dask_gpuchunk.bits import selection as selection_module


@pytest.mark.parametrize("old", ["bitpacking", "gram", "gram_blocks", "gram_graphs", "selection",
                                 "similarity", "similarity_graphs"])
def test_each_old_path_imports_and_warns_on_use(old):
    moved = importlib.import_module(f"dask_gpuchunk.{old}")
    new = importlib.import_module(f"dask_gpuchunk.bits.{old}")
    name = new.__all__[0]
    with pytest.warns(DeprecationWarning, match=f"dask_gpuchunk.{old} moved to "
                                                f"dask_gpuchunk.bits.{old}"):
        assert getattr(moved, name) is getattr(new, name)


def test_importing_an_old_path_keeps_the_public_functions():
    with pytest.warns(DeprecationWarning):
        from dask_gpuchunk.gram import block_counts
        from dask_gpuchunk.similarity import similarity as old_similarity
        from dask_gpuchunk.selection import WGMMA_SELECTIONS
    import dask_gpuchunk.gram  # noqa: F401 - the old path as a plain import
    assert block_counts is gram_module.block_counts
    assert WGMMA_SELECTIONS is selection_module.WGMMA_SELECTIONS
    assert dg.gram is gram_module.gram and callable(dg.gram)
    assert dg.similarity is old_similarity and callable(dg.similarity)


def test_a_name_the_new_module_lacks_is_an_attribute_error():
    moved = importlib.import_module("dask_gpuchunk.gram_blocks")
    with pytest.warns(DeprecationWarning), pytest.raises(AttributeError):
        moved.no_such_name  # noqa: B018
