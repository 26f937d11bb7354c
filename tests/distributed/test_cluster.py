"""``dg.local_cluster`` / ``dg.connect`` and the memory-limit parser."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import dask
import dask.array as da
import numpy as np
import pytest
from helpers import bit_products

import dask_gpuchunk as dg
from dask_gpuchunk.distributed import cluster as cluster_module
from dask_gpuchunk.distributed.cluster import parse_memory_limit


@pytest.mark.parametrize("value, expected", [("8GB", 8_000_000_000), ("500MiB", 500 * 2**20),
                                             ("0.8", 0.8), (0, 0), ("0", 0), ("auto", "auto"),
                                             (None, None), (123_456_789, 123_456_789),
                                             ("1", 1.0)])
def test_parse_memory_limit(value, expected):
    assert parse_memory_limit(value, "x") == expected


@pytest.mark.parametrize("value", ["lots", "-5", "8 parsecs", "-1GB", "", "1.5", "123456"])
def test_parse_memory_limit_rejects(value):
    with pytest.raises(ValueError, match="^x[: ]"):
        parse_memory_limit(value, "x")


def test_local_cluster_runs_operators(rng, tmp_path):
    a = rng.random((300, 30))
    bits = (rng.random((50, 100)) < 0.5).astype(np.uint8)
    with dg.local_cluster(processes=False, dashboard_address=None, spill_dir=tmp_path / "spill",
                          memory_limit="2GB") as client:
        assert len(client.scheduler_info()["workers"]) == 1
        product = dg.multiply(dg.asarray(a, chunks=100), 2.0).compute()
        g = dg.gram(da.from_array(bits, chunks=(20, 100))).compute()
    np.testing.assert_array_equal(product, a * 2.0)
    np.testing.assert_array_equal(g, bit_products(bits, bits))
    assert (tmp_path / "spill").is_dir()


def test_local_cluster_worker_processes_compile_their_own_kernels(rng):
    a = rng.random((200, 10))
    with dask.config.set({"gpuchunk.file-writes": 7}), \
            dg.local_cluster(n_workers=2, threads_per_gpu=1, dashboard_address=None) as client:
        assert len(client.scheduler_info()["workers"]) == 2
        # The package's settings where the cluster was started reach its worker processes.
        assert list(client.run(_file_writes).values()) == [7, 7]
        # Before any task: the worker plugin imported what the tasks run.
        imported = client.run(lambda: all(f"dask_gpuchunk.{m}" in sys.modules
                                          for m in ("backend", "elementwise", "gram", "io")))
        assert list(imported.values()) == [True, True]
        plugins = client.run(lambda dask_worker: list(dask_worker.plugins))
        assert all("dask-gpuchunk-setup" in names for names in plugins.values())
        result = dg.multiply(da.from_array(a, chunks=50), a[0])
        np.testing.assert_array_equal(result.compute(), a * a[0])
        # What device="auto" decided is gathered from the workers, each record naming its own.
        client.run(_record_a_decision)
        found = [r for r in dg.placement_decisions() if r.get("function") == "planted"]
        assert sorted(r["worker"] for r in found) == sorted(client.scheduler_info()["workers"])


def _file_writes() -> int:
    from dask_gpuchunk import config

    return config.get("file-writes")


def _record_a_decision() -> None:
    from dask_gpuchunk.runtime import placement

    placement.decide(("planted", os.getpid()),
                     lambda: ({"function": "planted", "choice": "cpu"}, None))


def test_local_cluster_threads():
    import os

    with dg.local_cluster(processes=False, dashboard_address=None,
                          threads_per_gpu="cores") as client:
        nthreads = list(client.nthreads().values())
    expected = os.cpu_count() if not dg.gpu_available() else max(
        1, (os.cpu_count() or 1) // dg.gpu_count())
    assert nthreads == [expected] * len(nthreads)
    with dg.local_cluster(processes=False, dashboard_address=None) as client:
        nthreads = list(client.nthreads().values())
    expected = os.cpu_count() if not dg.gpu_available() else cluster_module.THREADS_PER_GPU
    assert nthreads == [expected] * len(nthreads)


def _scheduler_saturation(dask_scheduler):
    return dask_scheduler.WORKER_SATURATION


def _assigned_and_queued(dask_scheduler):
    return ([len(ws.processing) for ws in dask_scheduler.workers.values()],
            len(dask_scheduler.queued))


_released = threading.Event()


def _wait_for_release(i):
    _released.wait(30)
    return i


def test_local_cluster_hands_each_worker_two_root_tasks_beyond_its_threads():
    _released.clear()
    with dg.local_cluster(processes=False, dashboard_address=None, threads_per_gpu=2) as client:
        assert client.run_on_scheduler(_scheduler_saturation) == 2.0
        try:
            futures = client.map(_wait_for_release, range(20), pure=False)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # every task known to the scheduler
                assigned, queued = client.run_on_scheduler(_assigned_and_queued)
                if sum(assigned) + queued == 20:
                    break
                time.sleep(0.02)
            time.sleep(0.2)  # nothing more is handed out while both threads are held
            assigned, queued = client.run_on_scheduler(_assigned_and_queued)
            # distributed's default (1.1) would hand 3 to a 2-thread worker, queue 17.
            assert assigned == [4] * len(assigned)
            assert queued == 20 - 4 * len(assigned)
        finally:
            _released.set()
        assert sorted(client.gather(futures)) == list(range(20))


def test_local_cluster_keeps_a_worker_saturation_of_the_callers():
    with dask.config.set({"distributed.scheduler.worker-saturation": 1.5}), dg.local_cluster(
            processes=False, dashboard_address=None, threads_per_gpu=2) as client:
        assert client.run_on_scheduler(_scheduler_saturation) == 1.5
    with dg.local_cluster(processes=False, dashboard_address=None,
                          threads_per_gpu=64) as client:
        assert client.run_on_scheduler(_scheduler_saturation) == 1.1
    # The setting lasts only while the cluster starts.
    assert dask.config.get("distributed.scheduler.worker-saturation") == 1.1


def test_local_cluster_bad_arguments():
    with pytest.raises(ValueError, match="threads_per_gpu"), dg.local_cluster(threads_per_gpu=0):
        pass
    with pytest.raises(ValueError, match="or 'cores'"), dg.local_cluster(threads_per_gpu="many"):
        pass
    with pytest.raises(ValueError, match="memory size"), dg.local_cluster(memory_limit="lots"):
        pass
    if not dg.gpu_available():
        with pytest.raises(dg.GPUNotAvailableError, match="no CUDA GPU"), dg.local_cluster(gpus=1):
            pass


def test_connect_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        dg.connect()
    with pytest.raises(ValueError, match="exactly one"):
        dg.connect(scheduler_file=tmp_path / "s.json", address="tcp://127.0.0.1:1")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dg.connect(scheduler_file=tmp_path / "missing.json")


@pytest.mark.gpu
def test_local_cuda_cluster_runs_operators_on_worker_gpus(rng, tmp_path, capfd):
    a = rng.random((4000, 64))
    bits = (rng.random((700, 3000)) < 0.5).astype(np.uint8)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "bits.npy", bits)
    with dg.local_cluster(dashboard_address=None, device_memory_limit="2GB") as client:
        assert sum(client.run(dg.gpu_count).values()) >= 1
        x = dg.from_npy(tmp_path / "a.npy", chunks=(1000, 64))
        dg.to_npy(dg.multiply(x, x, device="gpu"), tmp_path / "c.npy")
        g = dg.gram(dg.from_npy(tmp_path / "bits.npy", chunks=(256, 3000)), device="gpu")
        dg.to_npy(g, tmp_path / "g.npy")
        dg.to_npy(dg.multiply(x, 2.0), tmp_path / "d.npy")  # device="auto": measured there
        assert any("worker" in r for r in dg.placement_decisions())
    np.testing.assert_array_equal(np.load(tmp_path / "d.npy"), a * 2.0)
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), a * a)
    np.testing.assert_array_equal(np.load(tmp_path / "g.npy"), bit_products(bits, bits))
    # The workers' preload left the CUDA context to dask-cuda (which warns about an earlier one).
    assert "already exists" not in capfd.readouterr().err


def _listening_addresses() -> list[str]:
    import psutil

    return [c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_local_cluster_talks_tls_on_loopback_and_refuses_strangers():
    from distributed import Client

    with dg.local_cluster(processes=False, dashboard_address=None) as client:
        address = client.scheduler.address
        assert address.startswith("tls://127.0.0.1:"), address
        assert client.submit(lambda: 41 + 1).result() == 42
        # Everything this process listens on, the scheduler's HTTP server included.
        assert set(_listening_addresses()) <= {"127.0.0.1"}, _listening_addresses()
        for stranger in (address, address.replace("tls://", "tcp://")):
            # A refused Client lives on in a reference cycle; collected during the next
            # Client's start, its __del__ hung CI (distributed's loop runners stop under the
            # lock a start holds): collected before each start, none during one.
            gc.collect()
            gc.disable()
            try:
                with pytest.raises((OSError, TypeError, TimeoutError)):  # no credentials
                    Client(stranger, timeout=2).close()
            finally:
                gc.enable()
        gc.collect()


class _Litter:
    """Garbage in a reference cycle (only the collector frees it) that records, when freed,
    whether distributed's loop-runner lock was held: what an unreferenced Client's __del__
    would then wait for forever."""

    freed_under_lock: list[bool] = []

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        from distributed.utils import LoopRunner

        _Litter.freed_under_lock.append(LoopRunner._lock.locked())


def test_starting_a_cluster_collects_no_garbage_under_distributed_loop_lock(monkeypatch):
    from distributed.utils import LoopRunner

    start = LoopRunner._start_unlocked

    def littered_start(self):  # garbage made under the lock, the collector eager to run
        for _ in range(100):
            _Litter()
        return start(self)

    monkeypatch.setattr(LoopRunner, "_start_unlocked", littered_start)
    _Litter.freed_under_lock.clear()
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        with dg.local_cluster(processes=False, dashboard_address=None, secure=False) as client:
            assert client.submit(lambda: 1).result() == 1
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert _Litter.freed_under_lock and not any(_Litter.freed_under_lock)


def test_local_cluster_without_tls_stays_on_loopback():
    with dg.local_cluster(processes=False, dashboard_address=None, secure=False) as client:
        assert not client.scheduler.address.startswith("tls://")
        assert client.submit(lambda: 1).result() == 1
        assert set(_listening_addresses()) <= {"127.0.0.1"}, _listening_addresses()


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{}, {"n_workers": 2}, {"secure": False}],
                         ids=["defaults", "two-workers", "plain-tcp"])
def test_every_listener_of_a_local_cluster_is_on_loopback(kwargs):
    # As a user starts it: worker processes, the dashboard where Dask puts it by default.
    with dg.local_cluster(**kwargs) as client:
        assert "127.0.0.1" in client.dashboard_link, client.dashboard_link
        here = set(_listening_addresses())  # the scheduler and its HTTP server
        workers = client.run(_listening_addresses)
    assert here and here <= {"127.0.0.1"}, here
    for address, listening in workers.items():
        assert set(listening) <= {"127.0.0.1"}, (address, listening)


def test_ucx_has_no_tls_and_needs_distributed_ucxx(monkeypatch):
    with pytest.raises(ValueError, match="has no TLS"):
        with dg.local_cluster(protocol="ucx", secure=True):
            pass
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "distributed_ucxx" else real(name, *a))
    with pytest.raises(ImportError, match="pip install distributed-ucxx"):
        with dg.local_cluster(protocol="ucx"):
            pass


def test_the_jobs_protocol_option(tmp_path, monkeypatch):
    import importlib.util

    from click.testing import CliRunner

    from dask_gpuchunk.cli import main

    np.save(tmp_path / "a.npy", np.arange(12.0).reshape(4, 3))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "a.npy", "-o", "c.npy",
                                       "--protocol", "tcp"])
    assert result.exit_code == 0, result.output
    assert "talks plain TCP on loopback" in result.stderr
    result = CliRunner().invoke(main, ["multiply", "a.npy", "a.npy", "-o", "d.npy",
                                       "--protocol", "ucx", "--no-tls"])
    assert result.exit_code == 2 and "--no-tls is --protocol tcp" in result.output
    if importlib.util.find_spec("distributed_ucxx") is None:
        result = CliRunner().invoke(main, ["multiply", "a.npy", "a.npy", "-o", "d.npy",
                                           "--protocol", "ucx"])
        assert result.exit_code == 5 and "needs distributed-ucxx" in result.stderr
        assert not (tmp_path / "d.npy").exists()


@pytest.mark.gpu
def test_a_gram_of_device_words_over_ucx_is_exact_and_unwrapped(rng):
    pytest.importorskip("distributed_ucxx")
    import cupy

    from helpers import random_bits

    from dask_gpuchunk._kernels.gram import reference_gram

    bits = random_bits(rng, (3000, 4096), 0.4)
    words = np.packbits(bits, axis=1)
    with dg.local_cluster(protocol="ucx", dashboard_address=None) as client:
        assert client.scheduler.address.startswith("ucx://")
        x = client.persist(dg.asarray(words, chunks=(700, -1)).map_blocks(
            cupy.asarray, dtype=words.dtype, meta=cupy.empty((0, 0), words.dtype)))
        g = dg.gram(x, packed=True)
        # no wrappers: distributed sends CuPy chunks GPU to GPU over UCX
        assert not any(str(k[0]).startswith("gram-words-") for k in dict(g.dask)
                       if isinstance(k, tuple))
        got = client.compute(g, sync=True).get()
    np.testing.assert_array_equal(got, reference_gram(bits))


def test_workers_spill_limit_reads_the_first_visible_device_of_a_capped_pool(monkeypatch):
    # The card's size comes from NVML for the workers' first device, not from CUDA in this
    # process (which would make it a context there).
    asked = []
    monkeypatch.setattr(cluster_module, "_first_device_total",
                        lambda visible: asked.append(visible) or 80 << 30)
    monkeypatch.delenv("CUPY_GPU_MEMORY_LIMIT", raising=False)
    assert cluster_module._workers_spill_limit("default", "1,0") == "default"
    assert asked == []
    monkeypatch.setenv("CUPY_GPU_MEMORY_LIMIT", str(8 << 30))
    assert cluster_module._workers_spill_limit("default", "1,0") == int(0.8 * (8 << 30))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert cluster_module._workers_spill_limit(0.5, None) == 4 << 30
    assert asked == ["1,0", "3"]
