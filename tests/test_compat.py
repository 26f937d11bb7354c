"""Each private dask / distributed / dask-cuda touch point (dask_gpuchunk._compat) against the
installed releases: a release that moves one fails here, by name."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.active_memory_manager import ActiveMemoryManagerPolicy

from dask_gpuchunk import _compat

PACKAGE = Path(_compat.__file__).parent


def test_alias_names_its_target():
    alias = _compat.alias_task_type()("b", "a")
    assert alias.key == "b" and alias.target == "a"


def test_fused_task_keys_name_what_linear_fusion_joined():
    import operator

    from dask._task_spec import Task, TaskRef, fuse_linear_task_spec

    graph = {"a": Task("a", operator.add, 1, 2), "b": Task("b", operator.neg, TaskRef("a")),
             "c": Task("c", operator.mul, TaskRef("b"), 2),
             "d": Task("d", operator.sub, TaskRef("c"), TaskRef("a"))}
    fused = fuse_linear_task_spec(graph, ["d"])
    assert sorted(_compat.fused_task_keys(fused["b-c"])) == ["b", "c"]
    assert _compat.fused_task_keys(fused["d"]) == ("d",)


def test_flatten_keys_of_nested_lists():
    assert _compat.flatten_keys([["a", [("x", 0, 1)]], "c"]) == ["a", ("x", 0, 1), "c"]


def test_parse_gufunc_signature():
    ins, out = _compat.parse_gufunc_signature("(i,j),(j)->(i)")
    assert ins == [("i", "j"), ("j",)] and out == ("i",)


def test_common_blockdim_and_slices_from_chunks():
    assert tuple(_compat.common_blockdim([(2, 2), (1, 3)])) == (1, 1, 2)
    slices = _compat.slices_from_chunks(((2, 1), (3,)))
    x = np.arange(9).reshape(3, 3)
    assert [x[s].tolist() for s in slices] == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8]]]


def test_is_array_expression_follows_query_planning():
    planning = bool(dask.config.get("array.query-planning", False))
    assert _compat.is_array_expression(da.ones(3)) == planning
    assert not _compat.is_array_expression(np.ones(3))


def test_worker_threads_of_a_real_worker():
    with LocalCluster(n_workers=1, threads_per_worker=3, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        counts = client.run(lambda dask_worker: _compat.worker_threads(dask_worker))
    assert list(counts.values()) == [3]


def test_device_results_lru_only_of_a_dask_cuda_store():
    class Lru(dict):
        n = 123

    dask_cuda_like = types.SimpleNamespace(
        data=types.SimpleNamespace(device_buffer=types.SimpleNamespace(fast=Lru())))
    assert _compat.device_results_lru(dask_cuda_like).n == 123
    assert _compat.device_results_lru(types.SimpleNamespace(data={})) is None
    assert _compat.device_results_lru(object()) is None


def test_register_device_object_only_where_dask_cuda_is_imported(monkeypatch):
    class Held:
        pass

    monkeypatch.delitem(sys.modules, "dask_cuda.is_device_object", raising=False)
    assert not _compat.register_device_object(Held, lambda obj: True)
    registered = {}
    dispatch = types.SimpleNamespace(
        register=lambda cls: lambda f: registered.setdefault(cls, f))
    monkeypatch.setitem(sys.modules, "dask_cuda.is_device_object",
                        types.SimpleNamespace(is_device_object=dispatch))
    assert _compat.register_device_object(Held, lambda obj: True)
    assert registered[Held](Held())


def test_reduce_replicas_is_a_policy_and_suggestions_name_their_task():
    assert issubclass(_compat.reduce_replicas_policy(), ActiveMemoryManagerPolicy)
    task = types.SimpleNamespace(key=("x", 0))
    assert _compat.suggestion_key(("drop", task, None)) == ("x", 0)


@pytest.mark.gpu
def test_register_cupy_deserializer_round_trips_through_distributed():
    import cupy
    from distributed.protocol import deserialize, serialize
    from distributed.protocol.serialize import dask_deserialize

    from dask_gpuchunk.distributed.spilling import unspill_through_pool

    before = dask_deserialize.dispatch(cupy.ndarray)
    try:
        _compat.register_cupy_deserializer(unspill_through_pool)
        x = cupy.arange(12, dtype=np.float32).reshape(3, 4)[:, 1:]
        back = deserialize(*serialize(x, serializers=("dask",)))
        np.testing.assert_array_equal(back.get(), x.get())
    finally:
        dask_deserialize.register(cupy.ndarray)(before)


# Undocumented modules of dask, distributed and dask-cuda. (numba-cuda's private launch path
# stays in dask_gpuchunk._kernels.launch: the kernels import nothing of the layers above.)
PRIVATE_MODULES = ("dask._task_spec", "dask.array.gufunc", "distributed.protocol.cupy",
                   "dask_cuda.is_device_object", "dask.array._array_expr", "dask.core")
ENGINES = ("dask", "distributed", "dask_cuda", "zict")


def test_no_module_but_compat_imports_a_private_name():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module != "__future__"):
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                names += [a.name for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value] if node.value.startswith(PRIVATE_MODULES) else []
            if any(n.startswith(PRIVATE_MODULES) or n.startswith("_") for n in names) and \
                    any(n.split(".")[0] in ENGINES for n in names):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def test_default_clients_and_forgetting_one():
    import dask

    scheduler = dask.config.get("scheduler", None)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster:
        client = Client(cluster)  # as dg.connect makes one: the default, not a context
        before = _compat.default_clients()
        assert id(client) in before
        _compat.forget_default_clients(before - {id(client)})
        assert id(client) not in _compat.default_clients()
        assert client.status in ("closing", "closed")
    assert dask.config.get("scheduler", None) == scheduler
