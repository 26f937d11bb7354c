"""Old module paths (one release): attributes read through them warn and are the new modules'
own, and importing one leaves ``dg.gram`` and ``dg.similarity`` the functions."""

from __future__ import annotations

import importlib
import pickle
import warnings

import pytest

import dask_gpuchunk as dg
from dask_gpuchunk.bits import gram as gram_module
from dask_gpuchunk.bits import selection as selection_module


@pytest.mark.parametrize("old, new", [
    *((name, f"bits.{name}") for name in ("bitpacking", "gram", "gram_blocks", "gram_graphs",
                                          "selection", "similarity", "similarity_graphs")),
    ("elementwise", "elementwise_ops.operations"),
    *((f"elementwise_{name}", f"elementwise_ops.{name}")
      for name in ("blocks", "graphs", "operands")),
    *((name, f"runtime.{name}") for name in ("backend", "budget", "chunk_layout", "cpu_runner",
                                             "device_launch", "gpu_runners", "placement",
                                             "process_memory", "resident", "staging")),
    ("fingerprint_jobs", "jobs.fingerprints"),
    *((name, f"distributed.{name}") for name in ("alias_tasks", "cluster", "joining",
                                                 "replicas", "spilling", "worker")),
    ("partials", "io.partials")])
def test_each_old_path_imports_and_warns_on_use(old, new):
    moved = importlib.import_module(f"dask_gpuchunk.{old}")
    module = importlib.import_module(f"dask_gpuchunk.{new}")
    name = (module.__all__ or sorted(n for n, v in vars(module).items()  # one of its own
                                     if getattr(v, "__module__", None) == module.__name__))[0]
    with pytest.warns(DeprecationWarning, match=f"dask_gpuchunk.{old} moved to "
                                                f"dask_gpuchunk.{new}"):
        assert getattr(moved, name) is getattr(module, name)


def test_the_elementwise_operators_package_imports_every_way_and_leaves_dg_elementwise():
    import dask_gpuchunk.elementwise_ops.graphs as graphs  # a plain import through the package
    from dask_gpuchunk.elementwise_ops import ElementwiseOp, elementwise, multiply, operations

    assert (ElementwiseOp, elementwise, multiply) == (
        operations.ElementwiseOp, operations.elementwise, operations.multiply)
    assert graphs.LISTED_GRAPH_MAX_BLOCKS > 0
    with pytest.warns(DeprecationWarning):
        from dask_gpuchunk.elementwise import multiply as old_multiply
    assert old_multiply is multiply
    assert dg.elementwise is elementwise and dg.multiply is multiply


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


def test_a_name_the_new_module_lacks_is_an_attribute_error_without_a_warning():
    # as pickle's search of every module for a function's name meets it (dask's tokenize)
    moved = importlib.import_module("dask_gpuchunk.gram_blocks")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            moved.no_such_name  # noqa: B018
        # pickle's search of sys.modules for a name no module has: every old path read, quietly
        assert pickle.whichmodule(object(), "a_name_no_module_has") == "__main__"
