"""``dg.gram`` of words straight from a ``.npy``: each chunk read once per process where its
blocks run, never sent between workers; its grouped blocks on clusters and on GPUs."""

from __future__ import annotations

from collections import Counter

import importlib

import dask
import dask.array as da
import numpy as np
import pytest
from helpers import random_bits

import dask_gpuchunk as dg
from dask_gpuchunk import jobs
from dask_gpuchunk._kernels.gram import reference_gram
from dask_gpuchunk import config
from dask_gpuchunk.bits import gram_graphs

# the module, which the package's function of the same name hides as an attribute
gram_module = importlib.import_module("dask_gpuchunk.bits.gram")


# ---- words straight from a .npy: each chunk read once per process, never sent between workers

# Under dask's array query planning the words are read through their tasks, as before.
needs_legacy_graphs = pytest.mark.skipif(
    type(da.ones(1)).__module__.startswith("dask.array._array_expr"),
    reason="the Gram reads a .npy's chunks itself only outside array query planning")


@needs_legacy_graphs
@pytest.mark.parametrize("words_dtype", ["uint8", "uint64"])
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_gram_of_a_npy_reads_its_chunks_where_the_blocks_run(rng, tmp_path, words_dtype, device):
    from dask_gpuchunk.io import npy_reader_of

    a = random_bits(rng, (203, 1000 if words_dtype == "uint8" else 1024), 0.3)
    words = (np.packbits(a, axis=1) if words_dtype == "uint8"
             else np.packbits(a, axis=1, bitorder="little").view(np.uint64))
    np.save(tmp_path / "w.npy", words)
    x = dg.from_npy(tmp_path / "w.npy", chunks=((50, 1, 77, 75), -1))
    assert npy_reader_of(x) is not None
    g = dg.gram(x, packed=True, device=device, block_rows=None if device == "cpu" else 1)
    assert any(str(k).startswith("resident-words") for k in dict(g.__dask_graph__()))
    assert g.chunks == (x.chunks[0], x.chunks[0])
    np.testing.assert_array_equal(g.compute(), reference_gram(a))
    # grouped: blocks over whole groups of the file's row chunks, read as groups
    g = dg.gram(x, packed=True, device=device, block_rows=80, keep_on_device=True)
    assert g.chunks == ((51, 77, 75),) * 2
    result = g.compute()
    if device != "cpu" and dg.gpu_available():  # C's blocks stayed on the GPU
        import cupy

        assert isinstance(g._meta, cupy.ndarray) and isinstance(result, cupy.ndarray)
        result = cupy.asnumpy(result)
    assert isinstance(result, np.ndarray)
    np.testing.assert_array_equal(result, reference_gram(a))
    # Anything done to the words first: read through their tasks, as before.
    for y in (x.rechunk((60, -1)), x[1:], x.rechunk((50, 64))):
        assert npy_reader_of(y) is None
        np.testing.assert_array_equal(dg.gram(y, packed=True, device=device).compute(),
                                      reference_gram(a[1:] if y.shape[0] == 202 else a))


@needs_legacy_graphs
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_gram_of_a_npy_computes_the_blocks_below_too_when_asked(rng, tmp_path, device):
    # gram-mirror="recompute": every block its own task over the source, no
    # transposes of other blocks; the same counts.
    a = random_bits(rng, (150, 777), 0.4)
    np.save(tmp_path / "w.npy", np.packbits(a, axis=1))
    x = dg.from_npy(tmp_path / "w.npy", chunks=((40, 1, 60, 49), -1))
    with config.internal_values({"gram-mirror": "recompute"}):
        g = dg.gram(x, packed=True, device=device)
    graph = dict(g.__dask_graph__())
    assert not any(v[0] is gram_graphs.transposed_block for v in graph.values() if isinstance(v, tuple))
    assert g.name != dg.gram(x, packed=True, device=device).name
    np.testing.assert_array_equal(g.compute(), reference_gram(a))
    with config.internal_values({"gram-mirror": "sideways"}), \
            pytest.raises(ValueError, match="gram-mirror"):
        dg.gram(x, packed=True, device=device)


def test_gram_of_a_npy_refuses_a_file_changed_since_and_names_it_to_to_npy(rng, tmp_path):
    from dask_gpuchunk.io.files import InputChangedError
    from dask_gpuchunk.io import inputs_of

    words = np.packbits(random_bits(rng, (40, 64), 0.5), axis=1)
    np.save(tmp_path / "w.npy", words)
    g = dg.gram(dg.from_npy(tmp_path / "w.npy", chunks=(15, -1)), packed=True)
    assert [reader.path for reader in inputs_of(g)] == [str(tmp_path / "w.npy")]
    np.save(tmp_path / "w.npy", words[::-1])
    with pytest.raises(InputChangedError):
        g.compute()


@needs_legacy_graphs
def test_gram_of_a_npy_sends_no_words_between_workers(rng, tmp_path):
    # Two workers: before, each block read its chunks through the tasks that read them, and a
    # block on the other worker was sent them (1.0 x the words' bytes between the two; on
    # two GPUs, 2.3 GB over TLS for 2.1 GB of words). Now each worker reads what it needs.
    from distributed import Client, LocalCluster

    words = np.packbits(random_bits(rng, (600, 32768), 0.3), axis=1)  # 2.4 MB
    np.save(tmp_path / "w.npy", words)
    g = dg.gram(dg.from_npy(tmp_path / "w.npy", chunks=(100, -1)), packed=True, device="cpu")
    want = reference_gram(np.unpackbits(words, axis=1))
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        before = jobs.sent_by_workers(client)
        total = client.compute(g.sum(dtype=np.int64), sync=True)
        sent = jobs.sent_by_workers(client, before)
        assert total == want.sum(dtype=np.int64)
        assert len(sent) == 2 and sum(sent.values()) < words.nbytes // 20
        np.testing.assert_array_equal(client.compute(g[::97], sync=True), want[::97])


@needs_legacy_graphs
@pytest.mark.parametrize("read_ahead", [True, False])
def test_gram_of_a_npy_reads_ahead_on_each_worker_once_per_chunk(rng, tmp_path, read_ahead):
    # Each worker reads every row chunk its blocks need once; with read-ahead (the
    # default) all but the first on a thread of its own, before its blocks ask. On
    # dg.local_cluster, whose active memory manager keeps every worker's copy of the source
    # (dask_gpuchunk.distributed.replicas): on a plain LocalCluster a worker read them twice in one CI run.
    from dask_gpuchunk.runtime.resident import resident_stats

    words = np.packbits(random_bits(rng, (900, 4096), 0.3), axis=1)
    np.save(tmp_path / "w.npy", words)
    with config.internal_values({"read-ahead": read_ahead}):
        g = dg.gram(dg.from_npy(tmp_path / "w.npy", chunks=(100, -1)), packed=True,
                    device="cpu")
    want = reference_gram(np.unpackbits(words, axis=1)).sum(dtype=np.int64)
    with dg.local_cluster(n_workers=2, threads_per_gpu=1, dashboard_address=None,
                          secure=False) as client:
        assert client.compute(g.sum(dtype=np.int64), sync=True) == want
        stats = [s["host"] for s in client.run(resident_stats).values()]
    assert all(s["reads"] <= 9 for s in stats), stats  # 9 row chunks: each once at most
    ahead = sum(s["read_ahead"] for s in stats)
    assert (ahead > 0) if read_ahead else (ahead == 0), stats


@needs_legacy_graphs
def test_gram_of_a_npy_shares_its_blocks_between_workers_and_sends_none(rng, tmp_path):
    # distributed hands out a task group whose dependencies are few tasks as root tasks, to
    # whichever worker has a free thread. Named as the Gram's own blocks, the computed blocks
    # depended on their own group (the transposes below the diagonal): each then went where
    # the source was made, and on two GPUs one worker ran 3/4 of them and sent the other
    # 1.3 GB of blocks for its transposes. Small blocks on the CPU do not show it (work
    # stealing evens them out), so the graph's shape is checked, then the cluster's outcome.
    from dask.utils import key_split
    from distributed import Client, LocalCluster, get_task_stream

    words = np.packbits(random_bits(rng, (2400, 4096), 0.3), axis=1)
    np.save(tmp_path / "w.npy", words)
    g = dg.gram(dg.from_npy(tmp_path / "w.npy", chunks=(200, -1)), packed=True, device="cpu")
    computed = _computed_blocks(g)
    assert len(computed) == 78  # 12 row chunks: the blocks on and above the diagonal
    groups = {key_split(key) for key in computed}
    assert len(groups) == 1 and groups != {key_split(g.name)}, groups
    sources = set().union(*(task.dependencies for task in computed.values()))
    assert len(sources) == 1, sources  # the source only: not the group itself

    block_bytes = 200 * 200 * 4
    want = reference_gram(np.unpackbits(words, axis=1)).sum(dtype=np.int64)
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        assert client.compute(g.sum(dtype=np.int64), sync=True) == want  # compiles, warms
        before = jobs.sent_by_workers(client)
        with get_task_stream(client) as stream:
            assert client.compute(g.sum(dtype=np.int64), sync=True) == want
        sent = jobs.sent_by_workers(client, before)
    blocks = Counter(t["worker"] for t in stream.data if key_split(t["key"]) in groups)
    assert len(blocks) == 2 and min(blocks.values()) >= sum(blocks.values()) // 5, blocks
    assert sum(sent.values()) < block_bytes, sent  # not one block of C between the workers


def _computed_blocks(g: da.Array) -> dict:
    """The tasks of a Gram over a ``.npy`` that compute a block, by key."""
    from dask._task_spec import Task

    from dask_gpuchunk.bits.gram_graphs import _resident_block

    layer = dict(g.__dask_graph__().layers[g.name])
    return {key: task for key, task in layer.items()
            if isinstance(task, Task) and task.func is _resident_block}


@needs_legacy_graphs
def test_gram_of_a_npy_spreads_its_diagonal_blocks_over_the_workers(rng, tmp_path):
    # Each diagonal block has one dependent (its block of C), so dask fuses the two and the
    # 16 diagonal blocks form a task group of their own. Without the data-producer mark,
    # distributed takes a group as root tasks only when it has more than twice the cluster's
    # threads: on four workers of two threads (four GPUs), one worker ran all 16.
    from dask.utils import key_split
    from distributed import Client, LocalCluster, get_task_stream

    words = np.packbits(random_bits(rng, (16 * 48, 512), 0.3), axis=1)
    np.save(tmp_path / "w.npy", words)
    g = dg.gram(dg.from_npy(tmp_path / "w.npy", chunks=(48, -1)), packed=True, device="cpu")
    computed = _computed_blocks(g)
    assert len(computed) == 136 and all(task.data_producer for task in computed.values())
    want = reference_gram(np.unpackbits(words, axis=1)).sum(dtype=np.int64)
    # Without work stealing, which moved some of them at times: where the scheduler put them.
    with dask.config.set({"distributed.scheduler.work-stealing": False}), \
            LocalCluster(n_workers=4, threads_per_worker=2, processes=False,
                         dashboard_address=None) as cluster, Client(cluster) as client:
        with get_task_stream(client) as stream:
            assert client.compute(g.sum(dtype=np.int64), sync=True) == want
    fused = {t["key"] for t in stream.data if "upper" in key_split(t["key"])
             and key_split(t["key"]) != key_split(next(iter(computed))[0])}
    assert len(fused) == 16, fused  # the diagonal blocks, fused with their blocks of C
    workers = Counter(t["worker"] for t in stream.data if t["key"] in fused)
    assert len(workers) >= 2, workers


@needs_legacy_graphs
@pytest.mark.gpu
@pytest.mark.parametrize("method", ["auto", "int8", "popcount"])
def test_gram_of_a_npy_stages_each_chunk_to_the_gpu_once(rng, tmp_path, device_cap, method):
    from dask_gpuchunk.jobs import staged_by_workers
    from dask_gpuchunk.runtime.resident import resident_stats

    device_cap(1 << 30)
    a = random_bits(rng, (1000, 3000), 0.3)
    words = np.packbits(a, axis=1)
    np.save(tmp_path / "w.npy", words)
    x = dg.from_npy(tmp_path / "w.npy", chunks=(300, -1))  # 300, 300, 300, 100 rows
    before = staged_by_workers(None)
    reads = resident_stats().get("device 0", {}).get("reads", 0)
    c = dg.gram(x, packed=True, device="gpu", method=method).compute()
    np.testing.assert_array_equal(c, reference_gram(a))
    staged = staged_by_workers(None, before)["this process"]
    assert staged["h2d_bytes"] == words.nbytes  # each chunk once (10 blocks read them)
    sizes = x.chunks[0]
    upper = sum(sizes[i] * sizes[j] for i in range(4) for j in range(i, 4))
    assert staged["d2h_bytes"] == upper * 4
    stats = resident_stats()["device 0"]
    assert stats["reads"] - reads == 4 and stats["nbytes"] == 0  # nothing kept after


@needs_legacy_graphs
@pytest.mark.gpu
def test_a_gram_kept_on_the_device_sums_without_moving_c_to_the_host(rng, tmp_path, device_cap):
    from dask_gpuchunk.jobs import staged_by_workers

    device_cap(1 << 30)
    a = random_bits(rng, (1000, 3000), 0.3)
    np.save(tmp_path / "w.npy", np.packbits(a, axis=1))
    x = dg.from_npy(tmp_path / "w.npy", chunks=(300, -1))
    before = staged_by_workers(None)
    total = dg.gram(x, packed=True, keep_on_device=True).sum(dtype=np.int64).compute()
    assert int(total) == int(reference_gram(a).sum(dtype=np.int64))
    assert staged_by_workers(None, before)["this process"]["d2h_bytes"] == 0


@pytest.mark.gpu
def test_device_resident_words_make_grouped_blocks_by_default(rng, device_cap):
    import cupy

    device_cap(1 << 30)
    a = random_bits(rng, (2000, 4096), 0.4)
    x = dg.asarray(cupy.asarray(np.packbits(a, axis=1)), chunks=(125, -1))  # 16 chunks
    g = dg.gram(x, packed=True)
    assert len(g.chunks[0]) < len(x.chunks[0])  # grouped by the GPU's work
    assert len(g.chunks[0]) >= gram_module.MIN_ROW_GROUPS
    np.testing.assert_array_equal(cupy.asnumpy(g.compute()), reference_gram(a))
