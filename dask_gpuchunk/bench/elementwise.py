"""``dask-gpuchunk bench elementwise``: a large product and an RK4-style function, every path.

Defaults: two ``1,000,000 x 500`` float64 host arrays (4 GB each), result 4 GB, ~200 MB row
chunks. Two tables, one run, one machine: ``product`` (``c = a * b``): ours with
``device="gpu"`` on pageable and on pinned host arrays, ours device-resident (CuPy chunks: a
persist of four chunks per array, of one chunk per array, a 10-step loop of persists timed per
step), ours ``device="cpu"`` and ``"auto"``; NumPy (one thread); numba parallel CPU; naive
dask-cuda (``from_array -> cupy.asarray -> * -> cupy.asnumpy`` on a ``LocalCUDACluster``);
CuPy ``a * b`` on device arrays (once, a 10-step loop); Dask's ``a * b`` persisted on the same
CuPy chunks (what any Dask operation pays); the whole-array approach (everything to the device,
a thread per row, copied back); device rows interleaved, 15 rounds. ``rk4`` (two RK4 steps of
``y' = -k y + sin y`` per element): ours ``gpu`` (pageable), device-resident, ``cpu``,
``auto``; numba parallel CPU; NumPy (one thread, at most 50,000 rows, scaled, as the JSON notes).

Limits in the same run: pinned PCIe H2D/D2H/both, HBM (device copy), host memory (all-core
copy). Every "ours" and host peer writes into a touched, preallocated output (``out=``).
Ratios: to the PCIe floor (host rows), the HBM floor (device rows), the table's best row.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from dask import persist

from ..arrays import asarray
from ..elementwise_ops import elementwise, multiply
from .report import machine_info, report_of
from .timing import Bench, DevicePeaks, Entry, time_entry

__all__ = ["rk4_step", "run"]


def _rk4_scalar(y: float, k: float) -> float:
    # Two classical RK4 steps of dy/dt = -k*y + sin(y) with h = 0.01.
    h = 0.01
    for _ in range(2):
        k1 = -k * y + math.sin(y)
        y2 = y + 0.5 * h * k1
        k2 = -k * y2 + math.sin(y2)
        y3 = y + 0.5 * h * k2
        k3 = -k * y3 + math.sin(y3)
        y4 = y + h * k3
        k4 = -k * y4 + math.sin(y4)
        y = y + (h / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)
    return y


#: The compute-heavy function of the second table, as a dask_gpuchunk operation.
rk4_step = elementwise(_rk4_scalar, name="rk4_step")


def _rk4_numpy(y: np.ndarray, k: np.ndarray, out: np.ndarray) -> None:
    h = 0.01
    for _ in range(2):
        k1 = -k * y + np.sin(y)
        k2 = -k * (y + 0.5 * h * k1) + np.sin(y + 0.5 * h * k1)
        k3 = -k * (y + 0.5 * h * k2) + np.sin(y + 0.5 * h * k2)
        k4 = -k * (y + h * k3) + np.sin(y + h * k3)
        y = y + (h / 6.0) * (k1 + 2.0 * k2 + 2.0 * k3 + k4)
    out[...] = y


def _numba_parallel(scalar: Callable) -> Callable:
    import numba

    f = numba.njit(scalar)

    @numba.njit(parallel=True, nogil=True)
    def kernel(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        for i in numba.prange(a.shape[0]):
            for j in range(a.shape[1]):
                out[i, j] = f(a[i, j], b[i, j])

    return kernel


def _sync_persist(x: Any) -> Any:
    """Persist a CuPy-chunked Dask array and wait until its kernels are done."""
    import cupy

    (result,) = persist(x, scheduler="threads")
    cupy.cuda.runtime.deviceSynchronize()
    return result


#: Arrays of the product table's shape alive at once: the two inputs, the output, the expected
#: result, NumPy's and the peers' temporaries; with a GPU also three pinned copies (inputs,
#: output) and a host copy of the device-resident result.
PRODUCT_ARRAYS = {"cpu": 6, "gpu": 10}
#: Arrays of the RK4 table's shape alive at once (inputs, output, NumPy's temporaries).
RK4_ARRAYS = 6


def host_memory_needed(rows: int, cols: int, rk4_rows: int, gpu: bool) -> int:
    """About how many bytes of host memory ``run`` holds at its peak (float64 arrays).

    Examples
    --------
    >>> host_memory_needed(1_000_000, 500, 500_000, gpu=True) / 1e9
    40.0
    """
    return max(PRODUCT_ARRAYS["gpu" if gpu else "cpu"] * rows, RK4_ARRAYS * rk4_rows) * cols * 8


def rows_that_fit(nbytes: int, cols: int, gpu: bool) -> tuple[int, int]:
    """``(rows, rk4_rows)`` whose run needs at most ``nbytes`` of host memory."""
    rows = nbytes // (PRODUCT_ARRAYS["gpu" if gpu else "cpu"] * cols * 8)
    rk4 = nbytes // (RK4_ARRAYS * cols * 8)
    return max(0, int(rows)), max(0, int(min(rk4, rows)))


def run(
    rows: int = 1_000_000,
    cols: int = 500,
    chunk_mb: float = 200.0,
    rk4_rows: int = 500_000,
    repeat: int = 3,
    skip: tuple[str, ...] = (),
    log: Callable[[str], None] = print,
    loop_sizes: tuple[int, ...] = (),
    loop_steps: int = 20,
) -> dict[str, Any]:
    """Run the tables and return the report (see :mod:`dask_gpuchunk.bench.report`); with
    ``loop_sizes`` and a GPU, seed 002's loop too (:mod:`dask_gpuchunk.bench.loop`)."""
    bench = Bench(repeat, skip, log)
    chunk_rows = max(1, int(chunk_mb * 1e6 // (cols * 8)))
    log("limits ...")
    from .limits import hbm_bandwidth, host_bandwidth, pcie_bandwidth

    limits: dict[str, float] = dict(host_bandwidth())
    if bench.has_gpu:
        limits.update({f"pcie_{k}": v for k, v in pcie_bandwidth().items()})
        limits["hbm_copy_traffic"] = hbm_bandwidth()
    rng = np.random.default_rng(0)
    _table(bench, "product", lambda a, b: a * b, multiply, (rows, cols), chunk_rows, rng)
    _table(bench, "rk4", _rk4_scalar, rk4_step, (rk4_rows, cols), chunk_rows, rng)
    if loop_sizes and bench.has_gpu:
        from .loop import run_loop

        bench.entries += run_loop(list(loop_sizes), loop_steps, repeat, log, skip)
    return _report(bench.entries, limits, rows=rows, cols=cols, rk4_rows=rk4_rows,
                   chunk_rows=chunk_rows)


def _table(bench: Bench, table: str, scalar_op: Callable, op: Any, shape: tuple[int, int],
           chunk_rows: int, rng: np.random.Generator) -> None:
    """One table: the same ``out = op(a, b)`` through every path, then the peers."""
    log = bench.log
    log(f"{table}: generating {shape[0]} x {shape[1]} float64 inputs ...")
    chunks = (chunk_rows, shape[1])
    a = rng.random(shape)
    b = rng.random(shape) * (1.0 if table == "product" else 2.0)
    out = np.empty(shape)
    out[...] = np.nan  # touched: every row writes into resident pages
    expected = a * b if table == "product" else None
    first = len(bench.entries)

    def check(result: np.ndarray = out) -> None:
        if expected is not None:
            if not np.array_equal(result, expected):
                raise AssertionError(f"{table}: wrong result")
            return
        rows = slice(0, min(2000, result.shape[0]))
        ref = np.empty_like(result[rows])
        _rk4_numpy(a[rows], b[rows], ref)
        if not np.allclose(result[rows], ref, rtol=1e-12, atol=1e-12):
            raise AssertionError(f"{table}: wrong result")

    xa, xb = asarray(a, chunks), asarray(b, chunks)

    def ours(device: str) -> Callable[[], Any]:
        return lambda: op(xa, xb, device=device, out=out)

    log(f"{table}: ours ...")
    kernel = _numba_parallel(scalar_op)
    kernel(a[:2], b[:2], out[:2])  # compile
    trio = {"ours cpu": ours("cpu"), "ours auto (pageable host arrays)": ours("auto"),
            "peer numba parallel (CPU)": lambda: kernel(a, b, out)}
    peak: DevicePeaks | None = None
    if bench.has_gpu:
        peak = DevicePeaks(ours("gpu"))
        trio = {"ours gpu (pageable host arrays)": peak, **trio}
    else:
        bench.timed(table, "ours gpu (pageable host arrays)", lambda: None, gpu=True)
    from ..runtime.placement import decisions, forget

    forget()
    for e in bench.interleaved(table, trio, check):
        if e.name.startswith("ours auto"):
            e.extra["placement"] = [{k: v for k, v in d.items() if k != "key"}
                                    for d in decisions()]
        if e.name.startswith("ours gpu") and peak is not None:
            peak.record(e)

    if table == "product" and bench.has_gpu and bench.want("ours gpu (pinned"):
        from ..runtime.staging import empty_pinned

        pa, pb, pc = (empty_pinned(shape, np.float64) for _ in range(3))
        pa[...], pb[...], pc[...] = a, b, np.nan
        pinned = DevicePeaks(lambda: op(asarray(pa, chunks), asarray(pb, chunks), device="gpu",
                                       out=pc))
        e = bench.timed(table, "ours gpu (pinned host arrays)", pinned, gpu=True,
                        check=lambda: check(pc))
        pinned.record(e)
        del pa, pb, pc

    if bench.has_gpu and (bench.want("device-resident") or bench.want("cupy")):
        import cupy

        _device_rows(bench, table, op, a, b, check)
        gc.collect()  # the device copies of a and b go with _device_rows' frame
        cupy.get_default_memory_pool().free_all_blocks()

    log(f"{table}: peers ...")
    if table == "product":
        bench.timed(table, "peer numpy (1 thread)", lambda: np.multiply(a, b, out=out),
                    check=check)
    elif bench.want("peer numpy"):
        # NumPy takes minutes here: time a slice of rows and scale linearly.
        part = min(shape[0], 50_000)
        e = time_entry(table, "peer numpy (1 thread)", "peer",
                       lambda: _rk4_numpy(a[:part], b[:part], out[:part]), repeat=1, warmup=0)
        if e.seconds is not None and part < shape[0]:
            e.extra["measured_rows"] = part
            e.seconds *= shape[0] / part
            e.runs = [t * shape[0] / part for t in e.runs]
        bench.add(e)
    if table == "product":
        bench.timed(table, "peer whole arrays to the GPU (numba.cuda)", _seed000(a, b, out), gpu=True,
                    check=check)
        if bench.has_gpu:
            _flush_numba_frees()
        bench.timed(table, "peer naive dask-cuda (LocalCUDACluster)",
                    _naive_dask_cuda(a, b, chunks), gpu=True, warmup=0, repeat=1)
    for e in bench.entries[first:]:
        e.extra.setdefault("workload_bytes", {"in": a.nbytes + b.nbytes, "out": out.nbytes})


#: Rounds of the device-resident rows: each run takes milliseconds, and Dask's share of it
#: varies by a few tenths of a millisecond between runs, so three would be noise.
DEVICE_ROUNDS = 15
#: Steps of the device-resident loop rows (seed 002's pattern), timed per step.
LOOP_STEPS = 10
#: CuPy's own ``a * b`` rows, which the device-resident rows are held against (one persist
#: against one multiply, a step of a loop against a step of CuPy's loop).
CUPY_ROW = "peer cupy a*b (device arrays)"
CUPY_LOOP_ROW = f"peer cupy a*b, {LOOP_STEPS}-step loop (per step)"


def _device_rows(bench: Bench, table: str, op: Any, a: np.ndarray, b: np.ndarray,
                 check: Callable[[np.ndarray], None]) -> None:
    """Ours on persisted CuPy chunks, and CuPy's own ``a * b``, on the same device arrays.

    All rows of the table are timed interleaved, round by round (:meth:`Bench.interleaved`),
    so that the ratios to CuPy compare runs made under the same conditions.
    """
    import cupy

    from ..runtime.budget import device_capacity, format_bytes

    steps = LOOP_STEPS
    names = ["ours device-resident (CuPy chunks)", "ours device-resident, one chunk per array",
             f"ours device-resident, {steps}-step loop (per step)"]
    if table == "product":
        names += [CUPY_ROW, CUPY_LOOP_ROW, "peer dask.array a*b (CuPy chunks)",
                  "peer dask.array a*b, one chunk per array"]
    # Both inputs, the result kept from the last run and the one being made, all at once.
    needed = 4 * a.nbytes
    if needed > device_capacity():  # a capped device (--device-budget): reported, not fatal
        for name in names:
            if bench.want(name):
                bench.add(Entry(table, name, "ours" if name.startswith("ours") else "peer",
                                skipped=f"needs {format_bytes(needed)} on the device at once; "
                                        f"the device has {format_bytes(device_capacity())} "
                                        "(fewer --rows)"))
        return
    dev_a, dev_b = cupy.asarray(a), cupy.asarray(b)
    rows = max(1, a.shape[0] // 4)  # four chunks of a quarter each: device memory is ample
    xa, xb = asarray(dev_a, (rows, a.shape[1])), asarray(dev_b, (rows, a.shape[1]))
    # The same arrays as one chunk each (they fit): Dask's cost per persist is mostly per task.
    whole_a, whole_b = asarray(dev_a, dev_a.shape), asarray(dev_b, dev_b.shape)
    held: list[Any] = []

    def ours() -> None:
        held[:] = [_sync_persist(op(xa, xb, device="gpu"))]

    def ours_whole() -> None:
        held[:] = [_sync_persist(op(whole_a, whole_b, device="gpu"))]

    def ours_loop() -> None:
        # Seed 002's pattern: persist each step without waiting; the device runs step k
        # while Dask builds and schedules step k + 1.
        for _ in range(steps):
            held[:] = [persist(op(xa, xb, device="gpu"), scheduler="threads")[0]]
        cupy.cuda.runtime.deviceSynchronize()

    def cupy_mul() -> None:
        result = dev_a * dev_b
        cupy.cuda.runtime.deviceSynchronize()
        del result

    def cupy_loop() -> None:
        for _ in range(steps):
            result = dev_a * dev_b
        cupy.cuda.runtime.deviceSynchronize()
        del result

    def dask_mul() -> None:
        held[:] = [_sync_persist(xa * xb)]

    def dask_mul_whole() -> None:
        held[:] = [_sync_persist(whole_a * whole_b)]

    def check_ours() -> None:
        if held:  # the last result of ours (or of Dask's own multiply) that ran
            # Joined on the host: on the device it was a fifth array (out of memory, 8 GiB cap)
            r = held[0]
            check(r.map_blocks(cupy.asnumpy, dtype=r.dtype, meta=np.empty((0, 0), r.dtype)
                               ).compute(scheduler="threads"))

    # CuPy's own a * b, and Dask's own multiply on the same CuPy chunks (what any Dask
    # operation pays per persist), in the product table.
    fns = dict(zip(names, [ours, ours_whole, ours_loop, cupy_mul, cupy_loop, dask_mul,
                           dask_mul_whole], strict=False))
    for e in bench.interleaved(table, fns, check_ours, repeat=max(bench.repeat, DEVICE_ROUNDS)):
        e.extra["interleaved_rounds"] = len(e.runs)
        if "loop" in e.name:
            _per_step(e, steps)
    held.clear()


def _per_step(entry: Entry | None, steps: int) -> None:
    if entry is not None and entry.seconds is not None:
        entry.seconds /= steps
        entry.runs = [t / steps for t in entry.runs]
        entry.first_run = None if entry.first_run is None else entry.first_run / steps
        entry.extra["steps"] = steps


def _flush_numba_frees() -> None:
    """Free the device arrays numba has released but not yet freed. It frees them in
    batches, later: without this, the whole-array peer's 12 GB stayed held by this process
    into the next table's rows (the driver's peak showed them). numba-cuda keeps the pending
    frees with its memory manager (measured: the context's own list was empty)."""
    from numba import cuda

    context = cuda.current_context()
    pending = getattr(getattr(context, "memory_manager", None), "deallocations", None)
    for frees in (pending, getattr(context, "deallocations", None)):
        if frees is not None:
            frees.clear()


def _seed000(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    """Seed 000's approach in our words: copy whole arrays to the device, one thread per row."""

    def run_once() -> None:
        from numba import cuda

        kernel = _seed000_kernel()
        d_a, d_b = cuda.to_device(a), cuda.to_device(b)
        d_out = cuda.device_array(a.shape, a.dtype)
        threads = 64
        kernel[(a.shape[0] + threads - 1) // threads, threads](d_a, d_b, d_out)
        d_out.copy_to_host(out)
        del d_a, d_b, d_out

    return run_once


_SEED000: list[Any] = []


def _seed000_kernel() -> Any:
    if not _SEED000:
        from numba import cuda

        @cuda.jit
        def rowwise(x: Any, y: Any, z: Any) -> None:
            row = cuda.grid(1)
            if row < x.shape[0]:
                for col in range(x.shape[1]):
                    z[row, col] = x[row, col] * y[row, col]

        _SEED000.append(rowwise)
    return _SEED000[0]


def _naive_dask_cuda(a: np.ndarray, b: np.ndarray, chunks: tuple[int, int]) -> Callable[[], None]:
    """The obvious dask-cuda program: from_array, cupy.asarray, multiply, asnumpy, compute."""

    def run_once() -> None:
        import cupy
        import dask.array as da
        from dask_cuda import LocalCUDACluster
        from distributed import Client

        with LocalCUDACluster(n_workers=1, threads_per_worker=4) as cluster, Client(cluster):
            xa = da.from_array(a, chunks=chunks).map_blocks(cupy.asarray)
            xb = da.from_array(b, chunks=chunks).map_blocks(cupy.asarray)
            result = (xa * xb).map_blocks(cupy.asnumpy).compute()
            del result

    return run_once


def _versus_cupy(rows: list[Entry]) -> None:
    """``vs_cupy`` (and the row it compares with) on each device-resident row of a table that
    has CuPy's rows: the ratio the device-resident target is stated in."""
    by_name = {e.name: e for e in rows if e.seconds}
    for e in rows:
        if not e.seconds or not ("device-resident" in e.name or e.name.startswith("peer dask")):
            continue
        ref = by_name.get(CUPY_LOOP_ROW if "loop" in e.name else CUPY_ROW)
        if ref is not None:
            e.extra["vs_cupy"] = e.seconds / ref.seconds
            e.extra["vs_cupy_row"] = ref.name


def _floor_of(name: str) -> str:
    """Which floor a row is measured against: HBM for data on the device, PCIe for host data
    through a GPU, host memory for rows on the CPU (and every row where no GPU is visible,
    which have no PCIe floor)."""
    if ("device-resident" in name or name.startswith("peer cupy") or "CuPy chunk" in name
            or "one chunk per array" in name):
        return "hbm_floor_s"
    lowered = name.lower()
    if "cpu" in lowered or "numpy" in lowered or "numba parallel" in lowered:
        return "host_memory_floor_s"
    return "pcie_floor_s"


def _report(entries: list[Entry], limits: dict[str, float], **workload: Any) -> dict[str, Any]:
    floors: dict[str, dict[str, float]] = {}
    for table in ("product", "rk4"):
        rows = [e for e in entries if e.table == table]
        if not rows:
            continue
        wb = rows[0].extra.get("workload_bytes", {})
        f: dict[str, float] = {}
        if "pcie_h2d" in limits and wb:
            f["pcie_floor_s"] = max(wb["in"] / limits["pcie_h2d"], wb["out"] / limits["pcie_d2h"],
                                    (wb["in"] + wb["out"]) / limits["pcie_bidirectional"])
        if "hbm_copy_traffic" in limits and wb:
            f["hbm_floor_s"] = (wb["in"] + wb["out"]) / limits["hbm_copy_traffic"]
        if wb:
            f["host_memory_floor_s"] = (wb["in"] + wb["out"]) / limits["host_copy_traffic"]
        floors[table] = f
        best = min((e.seconds for e in rows if e.seconds), default=None)
        for e in rows:
            if e.seconds is None:
                continue
            if best:
                e.extra["vs_best"] = e.seconds / best
            floor = f.get(_floor_of(e.name)) or f.get("host_memory_floor_s")
            if floor:
                e.extra["vs_floor"] = e.seconds / floor
        _versus_cupy(rows)
    return report_of("elementwise", entries, machine_info(), workload, limits, floors)
