"""The device-memory budget: its arithmetic, the early refusal of chunks that cannot fit, the
admission of chunks into the budget, and work larger than a capped GPU (gpu marker)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import bit_products, random_bits

import dask_gpuchunk as dg
from dask_gpuchunk import jobs
from dask_gpuchunk.runtime import budget
from dask_gpuchunk.runtime.budget import DeviceBudgetError
from dask_gpuchunk.cli import main

MiB = 2**20


@pytest.mark.parametrize("value, expected", [
    ("1073741824", 2**30), ("50%", 8 * 2**30), (" 0 ", None), ("", None), ("1e9", 10**9),
])
def test_pool_limit_from_env(value, expected):
    assert budget.pool_limit_from_env(16 * 2**30, value) == expected


@pytest.mark.parametrize("limit, expected", [
    ("default", int(0.8 * 8 * 2**30)), (0.25, 2 * 2**30), (2**30, 2**30), (10**12, 8 * 2**30),
    (0, None), (None, None), ("auto", None),
])
def test_spill_limit_is_taken_of_the_capacity(limit, expected):
    assert budget.spill_limit(8 * 2**30, limit) == expected


def test_check_fits_names_bytes_budget_and_option():
    budget.check_fits(100 * MiB, "a chunk", "chunks=", budget=100 * MiB)  # exactly fits
    with pytest.raises(DeviceBudgetError) as info:
        budget.check_fits(3 * 2**30, "dg.multiply: one chunk", "chunks=", budget=2**30)
    text = str(info.value)
    assert "3.00 GiB" in text and "1.00 GiB" in text and "chunks=" in text
    assert isinstance(info.value, MemoryError)


def test_slab_bytes_count_words_slab_block_and_scratch():
    words, rows, n = 3125, 4096, 100_000
    words_bytes = n * words * 8
    expected = words_bytes + rows * n * 4 + rows * rows * 4 + 2 * rows * words * 64
    assert jobs.gram._slab_bytes(rows, n, words_bytes, words, 8, "int8") == expected
    assert jobs.gram._slab_bytes(rows, n, words_bytes, words, 8, "popcount") == expected - 2 * rows * words * 64


def _packed_bits(rng, tmp_path, shape=(600, 2000)):
    bits = random_bits(rng, shape, 0.5)
    np.save(tmp_path / "packed.npy", np.packbits(bits, axis=1))
    return bits


def test_gram_job_refuses_blocks_larger_than_the_workers_budget(rng, tmp_path, monkeypatch):
    _packed_bits(rng, tmp_path)
    monkeypatch.setattr(jobs.gram, "_budgets_where_it_runs", lambda: [1 * MiB, 64 * MiB])
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["gram", "packed.npy", "--packed", "-o", "g.npy",
                                       "--method", "popcount", "--chunk-rows", "512"])
    assert result.exit_code == 2, (result.exit_code, result.output)
    message = result.stderr.strip()
    assert message.startswith("error:") and "\n" not in message, message
    assert "1.00 MiB" in message and "--chunk-rows" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed.npy"]


def test_gram_job_takes_fewer_rows_per_chunk_where_blocks_would_not_fit(rng, tmp_path,
                                                                        monkeypatch):
    bits = _packed_bits(rng, tmp_path)  # 600 x 2000 bits: 32 words a row
    monkeypatch.setattr(jobs.gram, "_budgets_where_it_runs", lambda: [1 * MiB])
    summary = jobs.gram_job(tmp_path / "packed.npy", tmp_path / "g.npy", packed=True,
                            method="popcount", device="auto")(None)
    # 4096 rows: 69 MB a block; halved down to 256 rows (0.39 MB), the first that fits.
    assert summary["chunk_rows"] == 256 and summary["layout"] == "blocks"
    np.testing.assert_array_equal(np.load(tmp_path / "g.npy"),
                                  bit_products(bits, bits))
    summary = jobs.gram_job(tmp_path / "packed.npy", tmp_path / "g.npy", packed=True,
                            method="popcount", device="auto", overwrite=True)
    monkeypatch.setattr(jobs.gram, "_budgets_where_it_runs", lambda: [2**40])
    assert summary(None)["chunk_rows"] == jobs.gram.CHUNK_ROWS


def _layout_of(rng, tmp_path, monkeypatch, budget_bytes):
    """The layout gram_job picks for method="auto" on GPU workers with this budget, where
    "auto" means int8 (the job's writers are replaced: nothing runs)."""
    gram_module = importlib.import_module("dask_gpuchunk.bits.gram")  # the package exports gram()

    _packed_bits(rng, tmp_path, (1000, 2048))
    monkeypatch.setattr(jobs.gram, "_budgets_where_it_runs", lambda: [budget_bytes])
    int8_on_gpus = lambda method, on_gpu: "int8" if on_gpu else "popcount"  # noqa: E731
    monkeypatch.setattr(gram_module, "resolve_method", int8_on_gpus)
    monkeypatch.setattr(jobs.gram, "resolve_method", int8_on_gpus)  # jobs' own name for it
    captured = {}
    monkeypatch.setattr(jobs.gram, "_gram_slabs_to_file",
                        lambda *a, upper, **k: captured.setdefault("upper" if upper else "rows", 1))
    monkeypatch.setattr(jobs.common, "to_npy", lambda *a, **k: captured.setdefault("blocks", 1))
    monkeypatch.setattr(jobs.gram, "_start_warmup", lambda *a: [])
    jobs.gram_job(tmp_path / "packed.npy", tmp_path / "g.npy", packed=True, method="auto",
                  device="auto", chunk_rows=250)(None)
    return next(iter(captured))


def test_rows_layout_only_where_a_whole_slab_fits_the_budget(rng, tmp_path, monkeypatch):
    # A slab task: 256 KB of words, a 250 x 1000 slab, a 250 x 250 block, int8 scratch.
    slab = jobs.gram._slab_bytes(250, 1000, 1000 * 32 * 8, 32, 8, "int8")
    assert _layout_of(rng, tmp_path, monkeypatch, slab) == "rows"
    assert _layout_of(rng, tmp_path, monkeypatch, slab - 1) == "blocks"


# ---- on a GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_reservations_never_exceed_the_budget(device_cap):
    device_cap(1024 * MiB)
    limit = budget.working_budget()
    assert limit == int(1024 * MiB * (1 - budget.HEADROOM_FRACTION))
    held, most, lock = [0], [0], threading.Lock()

    def chunk(nbytes):
        with budget.reserve(nbytes):
            with lock:
                held[0] += nbytes
                most[0] = max(most[0], held[0])
            time.sleep(0.02)
            with lock:
                held[0] -= nbytes

    threads = [threading.Thread(target=chunk, args=(size * MiB,))
               for size in (400, 300, 500, 200, 350, 450, 100, 600)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0 < most[0] <= limit
    with pytest.raises(DeviceBudgetError):
        with budget.reserve(limit + 1):
            pass


@pytest.mark.gpu
def test_admission_counts_device_arrays_held_outside_the_chunks(rng, device_cap):
    import cupy

    # int8 Gram blocks of 512 + 512 rows x 131,072 bits unpack 128 MiB each: three fit the
    # budget's 460 MiB, but not beside the 64 MiB of words, 100 MiB this test holds and the
    # blocks already computed, which only the pool knows of.
    device_cap(512 * MiB)
    bits = random_bits(rng, (2048, 131_072), 0.5)
    words = cupy.asarray(np.packbits(bits, axis=1))
    held = cupy.ones(100 * MiB, dtype=np.uint8)
    x = dg.asarray(words, chunks=(512, -1))
    g = cupy.asnumpy(dg.gram(x, packed=True, method="int8").compute(scheduler="threads",
                                                                      num_workers=8))
    rows = rng.choice(2048, 8, replace=False)
    b = bits.astype(np.int64)
    np.testing.assert_array_equal(g[rows], b[rows] @ b.T)
    assert int(held.sum()) == 100 * MiB


@pytest.mark.gpu
def test_a_chunk_that_runs_out_of_memory_beside_others_runs_again_alone(device_cap):
    import cupy

    device_cap(256 * MiB)
    calls = []

    def chunk():
        calls.append(1)
        if len(calls) == 1:
            raise cupy.cuda.memory.OutOfMemoryError(1, 2, 3)
        return "done"

    before = budget.retried_alone["chunks"]
    assert budget.run_reserved(chunk, 10 * MiB) == "done"
    assert len(calls) == 2 and budget.retried_alone["chunks"] == before + 1

    def never_fits():
        raise cupy.cuda.memory.OutOfMemoryError(1, 2, 3)

    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        budget.run_reserved(never_fits, 10 * MiB)


@pytest.mark.gpu
def test_a_device_chunk_larger_than_the_budget_is_refused_before_any_work(device_cap):
    import cupy

    device_cap(256 * MiB)
    x = dg.asarray(cupy.ones((40 * MiB // 8,)), chunks=-1)  # 40 MiB: fits the cap as input
    y = dg.asarray(cupy.ones((60 * MiB,), dtype=np.int8), chunks=-1)
    dg.multiply(x, x, device="gpu")  # 40 MiB out: fits
    with pytest.raises(DeviceBudgetError, match="chunks="):
        dg.multiply(y, np.float64(2.0), device="gpu")  # 480 MiB of float64 out > 230 MiB


@pytest.mark.gpu
def test_host_product_larger_than_the_capped_device(rng, device_cap):
    import cupy

    device_cap(256 * MiB)
    budget.reset_peak()
    a, b = rng.random((4000, 10_000)), rng.random((1, 10_000))  # 320 MB in, 320 MB out
    c = dg.multiply(dg.asarray(a, chunks=(500, -1)), b, device="gpu").compute()
    np.testing.assert_array_equal(c, a * b)
    assert budget.peak_bytes()["pool"] <= 256 * MiB
    assert cupy.get_default_memory_pool().get_limit() == 256 * MiB


@pytest.mark.gpu
def test_gram_under_a_cap_is_exact_and_refuses_blocks_that_cannot_fit(rng, device_cap):
    device_cap(512 * MiB)
    bits = random_bits(rng, (3000, 4000), 0.5)
    words = np.packbits(bits, axis=1)
    g = dg.gram(dg.asarray(words, chunks=(1000, -1)), packed=True).compute()
    np.testing.assert_array_equal(g, bit_products(bits, bits))
    big = np.zeros((20_000, 8), np.uint8)
    with pytest.raises(DeviceBudgetError, match="rows"):
        dg.gram(dg.asarray(big, chunks=(20_000, -1)), packed=True, method="int8")


@pytest.mark.gpu
def test_local_cluster_workers_spill_as_a_card_of_the_capped_size(device_cap):
    cap = 512 * MiB
    device_cap(cap)
    with dg.local_cluster(dashboard_address=None) as client:
        limits = client.run(budget.stored_limit)
        budgets = client.run(budget.working_budget)
    assert set(limits.values()) == {int(cap * budget.DEFAULT_SPILL_FRACTION)}
    assert set(budgets.values()) == {int(cap * (1 - budget.HEADROOM_FRACTION))}  # none stored


@pytest.mark.gpu
def test_device_data_four_times_the_cap_on_a_default_local_cluster(device_cap):
    import cupy

    cap = 512 * MiB
    device_cap(cap)
    chunk = 64 * MiB // 8  # float64 elements: an eighth of the cap per chunk
    with dg.local_cluster(dashboard_address=None) as client:
        # 2 GiB of device chunks, 4 x the cap, then a product over them and a sum.
        x = dg.asarray(np.arange(32 * chunk, dtype=np.float64), chunks=chunk)
        x = x.map_blocks(cupy.asarray, dtype=x.dtype,
                         meta=cupy.empty((0,), np.float64)).persist()
        y = dg.multiply(x, 0.5).persist()
        total = float(y.sum().compute())
        reports = client.run(budget.budget_report)
    n = 32 * chunk
    assert total == 0.5 * n * (n - 1) / 2
    for report in reports.values():
        assert report["peak_pool"] <= cap


@pytest.mark.gpu
def test_gram_command_under_a_cap_reports_the_peak(rng, tmp_path):
    bits = random_bits(rng, (4000, 6000), 0.5)
    np.save(tmp_path / "bits.npy", np.packbits(bits, axis=1))
    cap = 256 * MiB
    env = {**__import__("os").environ, "CUPY_GPU_MEMORY_LIMIT": str(cap)}
    r = subprocess.run([sys.executable, "-m", "dask_gpuchunk", "gram", str(tmp_path / "bits.npy"),
                        "-o", str(tmp_path / "g.npy"), "--packed", "--chunk-rows", "1000",
                        "--json"], capture_output=True, text=True, timeout=300, env=env,
                       check=False)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    memory = summary["where"]["device_memory"]
    assert memory and all(0 < m["peak_pool"] <= cap for m in memory), memory
    assert all(m["capacity"] == cap for m in memory), memory
    # The driver's count (context, modules and the pool's blocks), where it can be read.
    assert all(m["peak_process"] is None or m["peak_process"] > 0 for m in memory), memory
    g = np.load(tmp_path / "g.npy", mmap_mode="r")
    rows = rng.choice(4000, 10, replace=False)
    np.testing.assert_array_equal(g[rows], bit_products(bits[rows], bits))


def test_graph_budget_is_the_smallest_gpu_workers_and_this_process_without_a_client(
        monkeypatch):
    # Graphs are sized by the workers' budgets, never by a device of the submitting process
    # (asking CUDA there made it a context on worker 0's GPU).
    from distributed import Client, LocalCluster

    monkeypatch.setattr(budget, "working_budget", lambda dask_worker=None: 5 << 30)
    assert budget.graph_budget() == 5 << 30  # no client: this process's
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        monkeypatch.setattr(budget, "gpu_available", lambda: False)
        assert budget.graph_budget() == 5 << 30  # no worker has a GPU: this process's
        addresses = sorted(client.scheduler_info()["workers"])
        sizes = {addresses[0]: 3 << 30, addresses[1]: 7 << 30}
        monkeypatch.setattr(budget, "gpu_available", lambda: True)
        monkeypatch.setattr(budget, "working_budget",
                            lambda dask_worker=None: sizes.get(getattr(dask_worker, "address",
                                                                       None), 1))
        assert budget.graph_budget() == 3 << 30
        with pytest.raises(DeviceBudgetError, match="the smallest of the workers' GPUs"):
            budget.check_fits_for_graph(4 << 30, "a block", "chunks=")
        budget.check_fits_for_graph(3 << 30, "a block", "chunks=")
