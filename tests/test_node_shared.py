"""Device chunks handed between a node's GPU processes through CUDA IPC (node_shared)."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask.sizeof import sizeof
from distributed.protocol import deserialize, serialize
from helpers import random_bits

import dask_gpuchunk as dg
from dask_gpuchunk import node_shared
from dask_gpuchunk._kernels.gram import reference_gram
from dask_gpuchunk.node_shared import NodeSharedChunk, chunk_of

SAME_HOST = {"sender": {"address": "tls://127.0.0.1:4001"},
             "recipient": {"address": "tls://127.0.0.1:4002"}}
OTHER_HOST = {"sender": {"address": "tcp://10.0.0.1:4001"},
              "recipient": {"address": "tcp://10.0.0.2:4002"}}


def _sent(shared: NodeSharedChunk, context) -> tuple[dict, list, NodeSharedChunk]:
    header, frames = serialize(shared, serializers=("dask", "pickle"), on_error="raise",
                               context=context)
    return header, frames, deserialize(header, frames)


class _FakeIpc:
    """A stand-in for CudaIpc within one process: a ticket names a chunk kept here."""

    kept: dict[int, np.ndarray] = {}
    fetch_fails: Exception | bool = False

    def export(self, chunk):
        self.kept[id(chunk)] = chunk
        return {"id": id(chunk), "shape": list(chunk.shape)}

    def fetch(self, ticket):
        if isinstance(self.fetch_fails, Exception):
            raise self.fetch_fails
        return None if self.fetch_fails else self.kept[ticket["id"]].copy()


@pytest.fixture
def fake_ipc(monkeypatch):
    monkeypatch.setattr(node_shared, "CudaIpc", _FakeIpc)
    monkeypatch.setattr(node_shared, "_shared_here", lambda chunk: True)
    monkeypatch.setattr(_FakeIpc, "fetch_fails", False)
    return _FakeIpc


def test_a_host_chunk_travels_as_its_bytes_and_arrives_as_a_copy_it_counts(rng):
    chunk = rng.integers(0, 2**63, size=(37, 5), dtype=np.uint64)
    shared = NodeSharedChunk(chunk)
    header, frames, received = _sent(shared, SAME_HOST)
    assert "ipc" not in header["sub-header"] and frames
    np.testing.assert_array_equal(chunk_of(received), chunk)
    assert chunk_of(received) is not chunk
    # Both count the chunk: spilling can move either off the GPU.
    assert sizeof(shared) >= chunk.nbytes and sizeof(received) >= chunk.nbytes


def test_to_a_worker_of_the_same_host_a_chunk_travels_as_a_ticket(rng, fake_ipc):
    chunk = rng.integers(0, 2**63, size=(64, 3), dtype=np.uint64)
    header, frames, received = _sent(NodeSharedChunk(chunk), SAME_HOST)
    assert header["sub-header"]["ipc"]["shape"] == [64, 3] and not frames
    assert header["sub-header"]["ipc"]["pid"] > 0
    np.testing.assert_array_equal(chunk_of(received), chunk)


@pytest.mark.parametrize("context", [OTHER_HOST, None], ids=["another host", "a spill"])
def test_elsewhere_or_spilled_a_chunk_travels_as_its_bytes(rng, fake_ipc, context):
    chunk = rng.integers(0, 2**63, size=(64, 3), dtype=np.uint64)
    header, frames, received = _sent(NodeSharedChunk(chunk), context)
    assert "ipc" not in header["sub-header"] and frames
    np.testing.assert_array_equal(chunk_of(received), chunk)


@pytest.mark.parametrize("failure", [True, RuntimeError("cudaErrorMapBufferObjectFailed")],
                         ids=["stale", "refused"])
def test_a_chunk_that_cannot_be_copied_on_arrival_fails_its_task_naming_the_setting(
        rng, fake_ipc, monkeypatch, failure):
    monkeypatch.setattr(_FakeIpc, "fetch_fails", failure)
    chunk = rng.integers(0, 2**63, size=(8, 2), dtype=np.uint64)
    _, _, received = _sent(NodeSharedChunk(chunk), SAME_HOST)
    with pytest.raises(RuntimeError, match="gpuchunk.share-device-chunks") as error:
        chunk_of(received)
    assert "(8, 2)" in str(error.value)
    if isinstance(failure, Exception):
        assert "cudaErrorMapBufferObjectFailed" in str(error.value)
    # Spilled and read back, the failure stays a failure, never a chunk.
    _, _, spilled = _sent(received, None)
    with pytest.raises(RuntimeError, match="share-device-chunks"):
        chunk_of(spilled)


def test_only_chunks_on_gpus_are_wrapped(rng):
    words = da.from_array(np.ones((6, 2), np.uint64), chunks=(3, 2))
    dsk: dict = {}
    refs = node_shared.node_shared_refs(dsk, words, [(words.name, 0, 0)], "w")
    assert dsk == {} and [r.key for r in refs] == [(words.name, 0, 0)]


@pytest.mark.parametrize("protocol, wrapped", [("tls", True), ("tcp", True), ("ucx", False)])
def test_device_chunks_are_wrapped_except_on_ucx(monkeypatch, protocol, wrapped):
    # Over UCX distributed sends CuPy chunks GPU to GPU itself; a wrapper went as host bytes
    # (2 x H200: the Gram 2.2-2.8 s wrapped, 0.60-0.71 s not).
    import types

    words = types.SimpleNamespace(_meta=object())
    monkeypatch.setattr(node_shared, "is_cupy", lambda meta: True)
    monkeypatch.setattr(node_shared, "cluster_workers", lambda: 2)
    monkeypatch.setattr(node_shared, "cluster_protocol", lambda: protocol)
    assert node_shared._on_devices(words) is wrapped


needs_legacy_graphs = pytest.mark.skipif(
    type(da.ones(1)).__module__.startswith("dask.array._array_expr"),
    reason="under array query planning the Gram and similarity go through dask's blockwise: "
           "their chunks travel as distributed sends them")


@pytest.fixture
def words_wrapped(monkeypatch):
    """Host words wrapped as if they were on GPUs: the graph the GPUs get, on CPU workers."""
    monkeypatch.setattr(node_shared, "_on_devices", lambda collection: True)


@needs_legacy_graphs
def test_a_gram_of_wrapped_words_on_two_workers_is_exact(rng, words_wrapped):
    bits = random_bits(rng, (530, 300), 0.4)
    words = da.from_array(np.packbits(bits, axis=1), chunks=(100, -1))
    g = dg.gram(words, packed=True, device="cpu")
    assert any(str(k[0]).startswith("gram-words-") for k in dict(g.dask) if isinstance(k, tuple))
    with dg.local_cluster(n_workers=2, threads_per_gpu=1, dashboard_address=None,
                          secure=False) as client:
        got = client.compute(g, sync=True)
    np.testing.assert_array_equal(got, reference_gram(bits))


@needs_legacy_graphs
def test_similarity_of_wrapped_words_on_two_workers_is_exact(rng, monkeypatch):
    bits = random_bits(rng, (410, 256), 0.3)
    words = da.from_array(np.packbits(bits, axis=1), chunks=(90, -1))
    want = dask.compute(*dg.similarity(words, packed=True, top_k=3, device="cpu"))
    monkeypatch.setattr(node_shared, "_on_devices", lambda collection: True)
    top = dg.similarity(words, packed=True, top_k=3, device="cpu")
    assert any(str(k[0]).startswith("similarity-words-") for k in dict(top[0].dask)
               if isinstance(k, tuple))
    with dg.local_cluster(n_workers=2, threads_per_gpu=1, dashboard_address=None,
                          secure=False):
        got = dask.compute(*top)
    for got_part, want_part in zip(got, want, strict=True):  # indices, then scores
        np.testing.assert_array_equal(got_part, want_part)


def _cupy_words_on_both_workers(client, words: np.ndarray, chunk_rows: int):
    import cupy
    from distributed import wait

    x = da.from_array(words, chunks=(chunk_rows, -1)).map_blocks(
        cupy.asarray, dtype=words.dtype, meta=cupy.empty((0, 0), words.dtype))
    x = x.persist()
    wait(x)
    owners = {w for ws in client.who_has(x).values() for w in ws}
    return x, owners


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [True, False], ids=["through IPC", "through the network"])
def test_a_gram_of_device_words_on_two_gpu_processes_copies_them_gpu_to_gpu(rng, shared):
    # Two worker processes on the node's GPUs (both on GPU 0 where there is one): a block
    # whose words lie in the other process receives them through CUDA IPC, exact.
    import cupy
    from distributed import Client, LocalCluster

    from dask_gpuchunk.jobs import staged_by_workers

    bits = random_bits(rng, (1200, 640), 0.4)
    words = np.packbits(bits, axis=1)
    # The workers start with this process's settings (distributed's nannies pass them on).
    settings = {"gpuchunk.share-min-bytes": 0, "gpuchunk.share-device-chunks": shared}
    with dask.config.set(settings), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                         dashboard_address=None) as cluster, Client(cluster) as client:
        x, owners = _cupy_words_on_both_workers(client, words, 200)
        before = staged_by_workers(client)
        got = dg.gram(x, packed=True).compute()
        staged = staged_by_workers(client, before)
    np.testing.assert_array_equal(cupy.asnumpy(got), reference_gram(bits))
    peer = sum(w["peer_bytes"] for w in staged.values())
    if len(owners) < 2:
        pytest.skip("the words' chunks all landed on one worker: nothing to send")
    assert (peer > 0) if shared else (peer == 0), staged


@pytest.mark.gpu
def test_top_k_of_device_words_on_two_gpu_processes_is_exact(rng):
    import cupy
    from distributed import Client, LocalCluster

    bits = random_bits(rng, (900, 512), 0.3)
    words = np.packbits(bits, axis=1)
    want = dask.compute(*dg.similarity(words, packed=True, top_k=4))
    with dask.config.set({"gpuchunk.share-min-bytes": 0}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                         dashboard_address=None) as cluster, Client(cluster) as client:
        x, _ = _cupy_words_on_both_workers(client, words, 150)
        got = dask.compute(*dg.similarity(x, packed=True, top_k=4))
    for got_part, want_part in zip(got, want, strict=True):  # indices, then scores
        np.testing.assert_array_equal(cupy.asnumpy(got_part), cupy.asnumpy(want_part))


@pytest.mark.gpu
def test_a_gpu_worker_spills_a_wrapper_as_device_memory():
    # dask-cuda's spilling counts only what it takes for device memory; a wrapper of a CuPy
    # chunk is registered as such where dask-cuda's worker has imported it first.
    def counts_as_device_memory() -> bool:  # sent by value to the worker
        import cupy
        from dask_cuda.is_device_object import is_device_object

        return bool(is_device_object(NodeSharedChunk(cupy.ones(3))))

    with dg.local_cluster(gpus=1, dashboard_address=None) as client:
        assert list(client.run(counts_as_device_memory).values()) == [True]
