"""``dask-gpuchunk bench gram``: exact Gram matrices of bit-packed 0/1 data, every method and peer.

Workload (defaults, seed 001 at the issue's size): ``N = 16384`` rows of ``K = 131072`` random
bits (density 0.5), packed into ``uint64`` words that already sit on the GPU; ``C = A · Aᵀ`` is
left on the GPU too (1 GB of int32). Rates are bit multiply-accumulates per second,
``N * N * K / t``, whether or not a method skips the lower triangle ("effective" rate).

Rows, one table, one run:

* ours, through ``dg.gram`` on persisted CuPy chunks (``--chunk-rows`` rows per chunk, several
  values allowed): ``method="popcount"``, ``"int8"``, ``"auto"``;
* ours, the per-block kernels alone on the whole matrix (one launch, symmetric), for each
  popcount tile shape given with ``--tile`` and for the int8 path;
* ours on the CPU (numba popcount twin), timed on ``--cpu-rows`` rows and scaled by ``N**2``;
* peers: seed 001's approach re-implemented (bytes, one thread per entry, 32 x 32 shared tiles,
  a loop over the 8 bits of each AND; timed on ``--bitloop-rows`` rows, scaled); CuPy float32
  matmul of the unpacked 0/1 matrix (exact: sums stay below 2**24); cuBLAS int8 ``gemmEx``
  through CuPy on the unpacked matrix (the full ``C``); ``torch._int_mm`` and fp8
  ``torch._scaled_mm`` (no fast accumulation) where torch is installed;
* limit: the popcount ceiling, a microbenchmark of independent AND + POPC + ADD chains on
  32-bit words (``popc/s x 32`` bit operations per second).

Every result that is computed in full is compared with ours exactly; sampled rows of ours are
compared with NumPy (``bitwise_count``) on the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .report import machine_info, machine_line, report_of
from .timing import Bench, DevicePeaks, Entry

__all__ = ["popcount_ceiling", "run"]


def _sync() -> None:
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


# ---- the popcount ceiling ------------------------------------------------------------------

_CHAINS = 8
_CEILING: list[Any] = []


def _ceiling_kernel() -> Any:
    if not _CEILING:
        from numba import cuda, uint32

        source = ["def chains(seed, steps, out):", "    t = cuda.grid(1)",
                  "    m = uint32(seed[t % seed.shape[0]])"]
        source += [f"    x{c} = uint32(t * {c + 1})" for c in range(_CHAINS)]
        source += ["    for _ in range(steps):"]
        # Each chain's next value depends on its last one, so nothing is hoisted out of the
        # loop; the chains are independent of each other, so they fill the pipelines.
        source += [f"        x{c} = uint32(x{c} + uint32(cuda.popc(x{c} & m)))" for c in range(_CHAINS)]
        source += ["    out[t] = " + " ^ ".join(f"x{c}" for c in range(_CHAINS))]
        namespace: dict[str, Any] = {"cuda": cuda, "uint32": uint32}
        exec(compile("\n".join(source) + "\n", "<popcount ceiling>", "exec"), namespace)  # noqa: S102
        _CEILING.append(cuda.jit(namespace["chains"]))
    return _CEILING[0]


def popcount_ceiling(steps: int = 4096, blocks_per_sm: int = 8, repeat: int = 5) -> dict[str, float]:
    """Measured rate of 32-bit AND + POPC + ADD chains on every SM: popc/s and bit-ops/s."""
    import cupy
    from numba import cuda

    sms = int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    threads, blocks = 256, sms * blocks_per_sm
    seed = cupy.asarray(np.random.default_rng(0).integers(1, 2**32, 1024, dtype=np.uint32))
    out = cupy.empty(threads * blocks, dtype=np.uint32)
    kernel = _ceiling_kernel()
    args = (cuda.as_cuda_array(seed, sync=False), steps, cuda.as_cuda_array(out, sync=False))
    kernel[blocks, threads](*args)
    _sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        kernel[blocks, threads](*args)
        _sync()
        best = min(best, time.perf_counter() - t0)
    popc = threads * blocks * steps * _CHAINS
    return {"popc_per_s": popc / best, "bit_ops_per_s": 32 * popc / best, "seconds": best}


# ---- seed 001's approach -------------------------------------------------------------------

_SEED: list[Any] = []
_SEED_TILE = 32


def _seed001_kernel() -> Any:
    """Seed 001's final kernel, in our words: bytes of 8 bits, one thread per entry of C, 32 x 32
    tiles of bytes in shared memory, and a loop over the 8 bits of each AND."""
    if not _SEED:
        from numba import cuda, int32, uint8

        tpb = _SEED_TILE
        tpb_padded = _SEED_TILE + 1  # numba needs the shape's entries as constants

        @cuda.jit
        def byte_bits(a: Any, c: Any) -> None:
            tile_a = cuda.shared.array((tpb, tpb), dtype=uint8)
            tile_b = cuda.shared.array((tpb, tpb_padded), dtype=uint8)
            col, row = cuda.grid(2)
            tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
            total = int32(0)
            for step in range((a.shape[1] + tpb - 1) // tpb):
                k = step * tpb + tx
                tile_a[ty, tx] = a[row, k] if row < a.shape[0] and k < a.shape[1] else 0
                other = cuda.blockIdx.x * tpb + ty
                tile_b[ty, tx] = a[other, k] if other < a.shape[0] and k < a.shape[1] else 0
                cuda.syncthreads()
                for j in range(tpb):
                    both = tile_a[ty, j] & tile_b[tx, j]
                    for bit in range(8):
                        if both & (1 << bit):
                            total += 1
                cuda.syncthreads()
            if row < c.shape[0] and col < c.shape[1]:
                c[row, col] = total

        _SEED.append(byte_bits)
    return _SEED[0]


def _seed001(words_dev: Any, rows: int) -> tuple[Callable[[], None], Any]:
    import cupy
    from numba import cuda

    a = words_dev[:rows].view(np.uint8)
    c = cupy.empty((rows, rows), dtype=np.int32)
    grid = (-(-rows // _SEED_TILE), -(-rows // _SEED_TILE))
    kernel = _seed001_kernel()
    args = (cuda.as_cuda_array(a, sync=False), cuda.as_cuda_array(c, sync=False))

    def run_once() -> None:
        kernel[grid, (_SEED_TILE, _SEED_TILE)](*args)
        _sync()

    return run_once, c


# ---- the bench -----------------------------------------------------------------------------


def _scaled(entry: Entry | None, factor: float, rows: int) -> None:
    if entry is not None and entry.seconds is not None and factor != 1:
        entry.seconds *= factor
        entry.runs = [t * factor for t in entry.runs]
        entry.first_run = None if entry.first_run is None else entry.first_run * factor
        entry.extra["measured_rows"] = rows


def _host_rows_check(words: np.ndarray, result: Any, sample: np.ndarray) -> None:
    """Rows ``sample`` of ``result`` against NumPy's popcounts on the host."""
    if isinstance(result, np.ndarray):
        got = result[sample]
    else:
        import cupy

        got = cupy.asnumpy(result[cupy.asarray(sample)])
    for i, r in enumerate(sample):
        expected = np.bitwise_count(words & words[r]).sum(axis=1, dtype=np.int64)
        if not np.array_equal(got[i], expected.astype(np.int32)):
            raise AssertionError(f"gram: row {r} differs from NumPy")


def run(
    n: int = 16384,
    k: int = 131072,
    chunk_rows: Sequence[int] = (4096,),
    tiles: Sequence[tuple[int, int, int, int, int]] = (),
    seed_rows: int = 4096,
    cpu_rows: int = 1024,
    repeat: int = 3,
    skip: tuple[str, ...] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the gram table and return the report (see :func:`dask_gpuchunk.bench.report.save`)."""
    bench = Bench(repeat, skip, log)
    table = "gram"
    rng = np.random.default_rng(1)
    m = -(-k // 64)
    log(f"gram: {n} x {k} random bits ({m} words per row) ...")
    words = rng.integers(0, 2**64, size=(n, m), dtype=np.uint64, endpoint=False)
    if k % 64:
        words[:, -1] &= np.uint64((1 << (k % 64)) - 1)
    sample = np.sort(rng.choice(n, size=min(n, 8), replace=False))
    limits: dict[str, float] = {}
    _cpu_rows(bench, table, words[: min(n, cpu_rows)], n)
    if not bench.has_gpu:
        for name in ("ours popcount (device-resident)", "ours int8 (device-resident)"):
            bench.timed(table, name, lambda: None, gpu=True)
        return _report(bench.entries, limits, n=n, k=k, chunk_rows=list(chunk_rows))
    import cupy

    if bench.want("ceiling"):
        log("popcount ceiling ...")
        limits.update({f"popcount_ceiling_{key}": v for key, v in popcount_ceiling().items()})
    dev_words = cupy.asarray(words)
    # The first checked C, on the host: kept on the device beside each entry's own C and the
    # words, it ran the bench out of memory under a 2 GiB cap.
    reference: list[np.ndarray] = []

    def check(result: Any) -> None:
        host = result if isinstance(result, np.ndarray) else cupy.asnumpy(result)
        if not reference:
            _host_rows_check(words, host, sample)
            reference.append(host)
        elif not np.array_equal(host, reference[0]):
            raise AssertionError("gram: differs from the first checked result")

    _ours_dask(bench, table, dev_words, n, chunk_rows, check)
    _ours_kernels(bench, table, dev_words, tiles, check)
    cupy.get_default_memory_pool().free_all_blocks()
    _peers(bench, table, dev_words, n, k, seed_rows, check, reference)
    return _report(bench.entries, limits, n=n, k=k, chunk_rows=list(chunk_rows))


def _cpu_rows(bench: Bench, table: str, words: np.ndarray, n: int) -> None:
    from ..bits.gram import gram

    rows = words.shape[0]
    result: list[Any] = []
    e = bench.timed(table, "ours popcount cpu (host words)",
                    lambda: result.__setitem__(slice(None), [gram(words, packed=True, device="cpu").compute()]),
                    repeat=1)
    if e is not None and e.seconds is not None:
        sample = np.arange(0, rows, max(1, rows // 4))
        _host_rows_check(words, result[0], sample)
    _scaled(e, (n / rows) ** 2, rows)


def _methods_here() -> tuple[str, ...]:
    """The Gram methods of this GPU: wgmma on a Hopper only."""
    from .._kernels.wgmma import wgmma_supported

    hopper = ("wgmma",) if wgmma_supported() else ()
    return ("popcount", "int8", "bmma", *hopper, "auto")


def _ours_dask(bench: Bench, table: str, dev_words: Any, n: int, chunk_rows: Sequence[int],
               check: Callable[[Any], None]) -> None:
    import cupy
    from dask import persist

    from ..arrays import asarray
    from ..bits.gram import gram

    for rows in chunk_rows:
        x = asarray(dev_words, (rows, dev_words.shape[1]))
        (x,) = persist(x)  # already materialised: the views become the graph's chunks
        for method in _methods_here():
            held: list[Any] = []

            def once(method: str = method, x: Any = x, held: list[Any] = held) -> None:
                (g,) = persist(gram(x, packed=True, method=method), scheduler="threads")
                _sync()
                held[:] = [g]

            def check_held(held: list[Any] = held) -> None:  # C joined on the host
                check(held[0].map_blocks(cupy.asnumpy, dtype=held[0].dtype,
                                         meta=np.empty((0, 0), held[0].dtype)
                                         ).compute(scheduler="threads"))

            name = f"ours {method} (device-resident, {rows}-row chunks)"
            # CuPy's pool kept from run to run, as a user's loop of Grams has it (emptied
            # before each run, every run paid cudaFree and cudaMalloc of its C anew).
            peaks = DevicePeaks(once, release=held.clear, keep_pool=True)
            peaks.record(bench.timed(table, name, peaks, gpu=True, check=check_held))
            held.clear()
            cupy.get_default_memory_pool().free_all_blocks()


def _ours_kernels(bench: Bench, table: str, dev_words: Any,
                  tiles: Sequence[tuple[int, int, int, int, int]], check: Callable[[Any], None]) -> None:
    import cupy

    from .._kernels import gram as kernels
    from .._kernels.bmma import bmma_cuda
    from .._kernels.wgmma import wgmma_cuda, wgmma_supported

    n = dev_words.shape[0]
    c = cupy.empty((n, n), dtype=np.int32)

    def row(name: str, launch: Callable[[], None]) -> None:
        def run_once() -> None:
            launch()
            _sync()

        bench.timed(table, name, run_once, gpu=True, check=lambda: check(c))

    for tile in [kernels.CUDA_TILE, *(kernels.TileShape(*t) for t in tiles)]:
        row(f"ours popcount kernel alone, tile {tuple(tile)}",
            lambda tile=tile: kernels.popcount_cuda(dev_words, None, c, tile=tile))
    # Every tile computed: the rate the kernel itself reaches, comparable with the ceiling.
    row("ours popcount kernel alone, full C (no symmetry)",
        lambda: kernels.popcount_cuda(dev_words, dev_words, c))
    row("ours bmma kernel alone (symmetric)", lambda: bmma_cuda(dev_words, None, c))
    row("ours bmma kernel alone, full C (no symmetry)", lambda: bmma_cuda(dev_words, dev_words, c))
    if wgmma_supported():
        row("ours wgmma kernel alone (symmetric)", lambda: wgmma_cuda(dev_words, None, c))
        row("ours wgmma kernel alone, full C (no symmetry)",
            lambda: wgmma_cuda(dev_words, dev_words, c))
    row("ours int8 kernels alone (unpack + 3 GEMMs)", lambda: kernels.int8_cuda(dev_words, None, c))


def _peers(bench: Bench, table: str, dev_words: Any, n: int, k: int, seed_rows: int,
           check: Callable[[Any], None], reference: list[np.ndarray]) -> None:
    import cupy

    from .._kernels import gram as kernels
    from .._kernels.bitpack import unpack_int8_cuda

    rows = min(n, seed_rows)
    if bench.want("seed 001"):
        seed_once, seed_c = _seed001(dev_words, rows)
        e = bench.timed(table, "peer byte-packed bit-loop kernel", seed_once, gpu=True, repeat=1)
        if e is not None and e.seconds is not None and reference and \
                not np.array_equal(cupy.asnumpy(seed_c), reference[0][:rows, :rows]):
            raise AssertionError("seed 001 peer: wrong result")
        _scaled(e, (n / rows) ** 2, rows)
        del seed_c

    int8_rows = ("peer cuBLAS int8 gemmEx via CuPy (full C)", "peer torch._int_mm (full C)",
                 "peer torch._scaled_mm fp8 (full C)", "peer cupy float32 matmul (full C)")
    try:
        unpacked = cupy.empty((n, dev_words.shape[1] * 64), dtype=np.int8)
        c = cupy.empty((n, n), dtype=np.int32)
    except cupy.cuda.memory.OutOfMemoryError as exc:  # under --device-budget: reported, not fatal
        _no_room(bench, table, int8_rows, exc)
        return
    unpack_int8_cuda(dev_words, unpacked)
    _sync()

    def gemm_int8() -> None:
        kernels._gemm_int8(unpacked, unpacked, c, slice(0, n), slice(0, n),
                           cupy.cuda.get_current_stream().ptr)
        _sync()

    bench.timed(table, "peer cuBLAS int8 gemmEx via CuPy (full C)", gemm_int8, gpu=True,
                check=lambda: check(c))
    _torch_peers(bench, table, unpacked, check)
    if bench.want("float32"):
        del c
        try:
            a32 = unpacked.astype(np.float32)
        except cupy.cuda.memory.OutOfMemoryError as exc:
            _no_room(bench, table, int8_rows[-1:], exc)
            return
        held: list[Any] = []

        def f32() -> None:
            held[:] = [cupy.matmul(a32, a32.T)]
            _sync()

        bench.timed(table, "peer cupy float32 matmul (full C)", f32, gpu=True,
                    check=lambda: check(held[0].astype(np.int32)))
        held.clear()


def _no_room(bench: Bench, table: str, names: Sequence[str], exc: Exception) -> None:
    """Rows whose operands do not fit the device (a capped pool): skipped, with the reason."""
    for name in names:
        if bench.want(name):
            bench.add(Entry(table, name, "peer",
                            skipped=f"its operands do not fit the device: {exc}".splitlines()[0]))


def _torch_peers(bench: Bench, table: str, unpacked: Any, check: Callable[[Any], None]) -> None:
    try:
        import torch
    except Exception as exc:
        for name in ("peer torch._int_mm (full C)", "peer torch._scaled_mm fp8 (full C)"):
            if bench.want(name):
                bench.add(Entry(table, name, "peer", skipped=f"torch not importable ({exc})"))
        return
    import cupy

    a = torch.as_tensor(unpacked, device="cuda")
    held: list[Any] = []

    def int_mm() -> None:
        held[:] = [torch._int_mm(a, a.t())]
        torch.cuda.synchronize()

    bench.timed(table, "peer torch._int_mm (full C)", int_mm, gpu=True,
                check=lambda: check(cupy.asarray(held[0])))
    a8 = a.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")

    def scaled_mm() -> None:
        held[:] = [torch._scaled_mm(a8, a8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                    use_fast_accum=False)]
        torch.cuda.synchronize()

    bench.timed(table, "peer torch._scaled_mm fp8 (full C)", scaled_mm, gpu=True,
                check=lambda: check(cupy.asarray(held[0]).astype(np.int32)))
    held.clear()


def _report(entries: list[Entry], limits: dict[str, float], **workload: Any) -> dict[str, Any]:
    n, k = workload["n"], workload["k"]
    macs = float(n) * n * k
    ceiling = limits.get("popcount_ceiling_bit_ops_per_s")
    seed = next((e.seconds for e in entries if e.name.startswith("peer byte-packed bit-loop") and e.seconds), None)
    best = min((e.seconds for e in entries if e.seconds), default=None)
    for e in entries:
        if e.seconds is None:
            continue
        e.extra["bit_macs_per_s"] = macs / e.seconds
        if ceiling:
            e.extra["vs_popcount_ceiling"] = e.extra["bit_macs_per_s"] / ceiling
        if seed:
            e.extra["x_seed001"] = seed / e.seconds
        if best:
            e.extra["vs_best"] = e.seconds / best
    return report_of("gram", entries, machine_info(), {**workload, "bit_macs": macs}, limits)


def format_table(report: dict[str, Any]) -> str:
    """Rates of every row: bit-MAC/s, against the popcount ceiling and seed 001's approach."""
    m, w, lim = report["machine"], report["workload"], report["limits"]
    lines = [machine_line(m),
             f"workload: N={w['n']} rows x K={w['k']} bits; rates are N*N*K / t (bit-MAC/s); "
             "device-resident rows keep CuPy's pool between runs, peaks from the first"]
    if "popcount_ceiling_bit_ops_per_s" in lim:
        lines.append(f"limit: popcount ceiling {lim['popcount_ceiling_bit_ops_per_s']:.3g} bit-ops/s "
                     f"({lim['popcount_ceiling_popc_per_s']:.3g} 32-bit popc/s)")
    lines.append(f"  {'':52s} {'seconds':>9s} {'bit-MAC/s':>10s} {'x ceil':>7s} {'x seed':>7s}  note")
    for e in report["entries"]:
        if e["seconds"] is None:
            lines.append(f"  {e['name']:52s} {'-':>9s}  skipped: {e['skipped']}")
            continue
        x = e["extra"]
        ceil = f"{x['vs_popcount_ceiling']:.2f}" if "vs_popcount_ceiling" in x else ""
        seed = f"{x['x_seed001']:.1f}" if "x_seed001" in x else ""
        note = f"timed on {x['measured_rows']} rows, scaled" if "measured_rows" in x else ""
        if e["first_run"] is not None and e["first_run"] > 1.5 * e["seconds"] and not note:
            note = f"first run {e['first_run']:.3f} s"
        if "peak_device_bytes" in x:
            note += (f"{'; ' if note else ''}peak device {x['peak_device_bytes'] / 1e9:.2f} GB "
                     "(pool)")
        if "peak_process_bytes" in x:
            note += f", {x['peak_process_bytes'] / 1e9:.2f} GB (driver, this process)"
        lines.append(f"  {e['name']:52s} {e['seconds']:9.4f} {x['bit_macs_per_s']:10.3g} "
                     f"{ceil:>7s} {seed:>7s}  {note}")
    return "\n".join(lines)
