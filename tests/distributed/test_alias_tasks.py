"""Dask's Alias tasks resolved before a graph goes to a cluster."""

from __future__ import annotations

import operator

import dask
import dask.array
import numpy as np
import pytest
from dask._task_spec import Alias, Task, TaskRef
from dask.local import get_sync
from distributed import get_task_stream

import dask_gpuchunk as dg
from dask_gpuchunk.distributed.alias_tasks import optimize_arrays, resolve_aliases, resolving_aliases


classic_only = pytest.mark.skipif(dask.array.array_expr_enabled(), reason="array query "
                                  "planning makes expressions, whose graphs dask makes without "
                                  "these aliases")


def _chain_graph() -> dict:
    # e -> d (alias) -> c (alias) -> b; a requested alias r of b stays
    return {
        "a": Task("a", operator.add, 2, 5),
        "b": Task("b", operator.mul, TaskRef("a"), 3),
        "c": Alias("c", "b"),
        "d": Alias("d", "c"),
        "e": Task("e", operator.sub, TaskRef("d"), TaskRef("a")),
        "f": Task("f", operator.add, TaskRef("c"), TaskRef("d")),
        "r": Alias("r", "b"),
    }


def test_aliases_are_resolved_through_chains_and_requested_ones_stay():
    graph = _chain_graph()
    keys = ["e", "f", "r"]
    resolved = resolve_aliases(graph, keys)
    assert sorted(resolved) == ["a", "b", "e", "f", "r"]
    assert resolved["e"].dependencies == {"a", "b"}
    assert resolved["f"].dependencies == {"b"}
    assert isinstance(resolved["r"], Alias)
    assert get_sync(resolved, keys) == get_sync(graph, keys) == (14, 42, 21)


def test_a_graph_without_aliases_comes_back_as_it_was():
    graph = {"a": Task("a", operator.add, 1, 2), "b": Task("b", operator.neg, TaskRef("a"))}
    assert resolve_aliases(graph, ["b"]) == graph


def test_a_cycle_of_aliases_is_not_followed_for_ever():
    graph = {"x": Alias("x", "y"), "y": Alias("y", "x"),
             "z": Task("z", operator.neg, TaskRef("x"))}
    resolved = resolve_aliases(graph, ["z"])
    assert set(resolved) == {"z"}  # nothing to run it: a broken graph stays broken


def _gram_sum(tmp_path, rng):
    bits = rng.integers(0, 256, size=(97, 9), dtype=np.uint8)  # uneven row chunks
    np.save(tmp_path / "bits.npy", bits)
    words = dg.from_npy(tmp_path / "bits.npy", chunks=(20, -1))
    expected = int(np.bitwise_count(bits[:, None, :] & bits[None, :, :]).sum())
    return dg.gram(words, packed=True, device="cpu").sum(), expected


@classic_only
def test_a_gram_sum_loses_its_aliases_and_keeps_its_value(tmp_path, rng):
    total, expected = _gram_sum(tmp_path, rng)
    keys = total.__dask_keys__()
    graph = total.__dask_graph__()
    from dask.array.optimization import optimize

    plain = optimize(graph, keys)
    resolved = optimize_arrays(graph, keys)
    aliases = sum(isinstance(node, Alias) for node in plain.values())
    assert aliases >= 25  # one a block of C (5 x 5 blocks), fused with its sum
    assert not any(isinstance(node, Alias) for node in resolved.values())
    assert len(resolved) == len(plain) - aliases
    (with_aliases,), (without,) = get_sync(plain, keys), get_sync(resolved, keys)
    assert int(without) == int(with_aliases) == expected


def test_fused_tasks_keep_the_workers_their_parts_asked_for():
    # b asks for w1 and is fused with c (which asks for nothing) as b-c, which asks for w1;
    # a asks for w0 and stays alone; d asks for nothing.
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

    graph = {"a": Task("a", operator.add, 1, 2), "b": Task("b", operator.neg, TaskRef("a")),
             "c": Task("c", operator.mul, TaskRef("b"), 2),
             "d": Task("d", operator.sub, TaskRef("c"), TaskRef("a"))}
    placed = {"a": "w0", "b": "w1"}
    layers = {
        "placed": MaterializedLayer({k: graph[k] for k in placed}, annotations={
            "workers": lambda key: [placed[key]], "allow_other_workers": True}),
        "rest": MaterializedLayer({k: v for k, v in graph.items() if k not in placed})}
    hlg = HighLevelGraph(layers, {"placed": set(), "rest": {"placed"}})
    optimized = optimize_arrays(hlg, ["d"])
    asked = {}
    for layer in optimized.layers.values():
        for kind, value in (layer.annotations or {}).items():
            for key in layer:
                asked.setdefault(key, {})[kind] = value(key)
    assert sorted(dict(optimized)) == ["a", "b-c", "d"]
    assert asked == {"a": {"workers": ["w0"], "allow_other_workers": True},
                     "b-c": {"workers": ["w1"], "allow_other_workers": True}}, asked
    assert get_sync(dict(optimized), "d") == get_sync(graph, "d") == -9


@classic_only
def test_local_cluster_resolves_aliases_while_its_client_is_open(tmp_path, rng):
    total, expected = _gram_sum(tmp_path, rng)
    assert dask.config.get("array_optimize", None) is None
    from dask.array.optimization import optimize

    plain = optimize(total.__dask_graph__(), total.__dask_keys__())
    aliases = {str(key) for key, node in plain.items() if isinstance(node, Alias)}
    with dg.local_cluster(processes=False, dashboard_address=None) as client:
        assert dask.config.get("array_optimize") is optimize_arrays
        ran = {}
        for optimizer in (optimize, optimize_arrays):  # dask's own, then the package's
            with dask.config.set(array_optimize=optimizer), get_task_stream(client) as stream:
                assert int(client.compute(total).result()) == expected
            ran[optimizer] = [str(record["key"]) for record in stream.data]
    assert aliases <= set(ran[optimize])  # dask's own: every alias ran as a task
    assert not aliases & set(ran[optimize_arrays])
    assert len(ran[optimize_arrays]) == len(ran[optimize]) - len(aliases)
    assert dask.config.get("array_optimize", None) is None


def test_a_callers_own_array_optimize_and_the_setting_off_are_respected():
    def mine(dsk, keys, **kwargs):
        return dsk

    with dask.config.set(array_optimize=mine), resolving_aliases():
        assert dask.config.get("array_optimize") is mine
    with dask.config.set({"gpuchunk.resolve-aliases": False}), resolving_aliases():
        assert dask.config.get("array_optimize", None) is None


def test_a_joined_cluster_resolves_aliases_inside_the_block_only():
    # dg.connect changes nothing of this process's dask settings (tests/test_process_settings);
    # the block resolves the aliases of what is computed inside it.
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster:
        client = dg.connect(address=cluster.scheduler_address)
        try:
            assert dask.config.get("array_optimize", None) is None
            with dg.resolving_aliases():
                assert dask.config.get("array_optimize") is optimize_arrays
                assert int(client.compute(dask.array.ones(10, chunks=3).sum()).result()) == 10
            assert dask.config.get("array_optimize", None) is None
        finally:
            client.close()
