"""``dask-gpuchunk bench similarity``: nearest neighbours and thresholded pairs of binary
fingerprints, ours beside the dense Gram's rate, a ceiling and the peers, in pairs per second.

Workload (defaults, the similarity issue's size): ``n = 10**6`` random fingerprints of 2048
bits at 7.5 % density (Morgan fingerprints set 5-10 % of their bits), packed in
``np.packbits`` order; the first ``n / 64`` rows have near twins (1 % of their bits flipped:
Tanimoto about 0.9), so that the threshold finds pairs (random rows at this density score about
0.04 against each other). The queries are database rows with 2 % of their bits flipped. On a
GPU the words sit on the device, in chunks of ``chunk_rows`` rows, as a user's persisted array.

Rows, one table, one run (each rate is unique pairs scored per second: ``n * (n - 1) / 2 / t``
for all pairs, each unordered pair once, as the kernels score it; ``queries * n / t`` for
queries x database and the peers' rows, which score every pair they are given):

* ours: all-pairs top-k and threshold, queries x database top-k and threshold, through
  ``dg.similarity`` (the default method: the selection in the wgmma kernel's epilogue on
  Hopper, bmma's elsewhere the GPU has 1-bit tensor cores);
* ours, on a GPU: one block of ``chunk_rows`` rows in its parts, by each kernel with a
  selection epilogue (:mod:`dask_gpuchunk.bench.similarity_blocks`);
* ours: the dense Gram's counts of the same all-pairs blocks, each written to device memory and
  dropped: what scoring costs when the counts are written out;
* peers, timed on a subset and reported as a rate (CuPy, NumPy, RDKit, FPSim2, nvMolKit,
  FAISS; :mod:`dask_gpuchunk.bench.similarity_peers`), each where it is installed and runs;
* limit: our bmma kernel's 1-bit tensor-core rate on a long-K Gram (bit-MAC/s), divided by the
  bits of a pair: the pairs per second no kernel of ours can pass on this GPU.

Ours are checked exactly on sampled rows against NumPy on the host (counts by
``bitwise_count``, the documented float32 formula, a stable sort); the peers' Tanimotos against
the same counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .report import machine_info, machine_line, report_of
from .similarity_blocks import block_entries
from .similarity_peers import tanimoto_rows, time_peers
from .timing import Bench, Entry

__all__ = ["check_top_k", "format_table", "make_fingerprints", "run"]

#: Rows made or compared at a time on the device (a float32 copy of 10**6 x 2048 bits is 8 GB).
PIECE = 65536


def make_fingerprints(n: int, bits: int, density: float, seed: int = 1, on_gpu: bool = False,
                      twins: int | None = None) -> np.ndarray:
    """``n`` packed fingerprints (``uint8`` words, ``np.packbits`` order) of ``bits`` bits at
    ``density``; the first ``twins`` rows (default ``n // 64``) have near twins right after them
    (1 % of their bits flipped). Made on the GPU a piece at a time where ``on_gpu``.

    Examples
    --------
    >>> w = make_fingerprints(640, 64, 0.1)
    >>> w.shape, w.dtype
    ((640, 8), dtype('uint8'))
    >>> bool((w[10:20] != w[:10]).any()) and 0.05 < float(np.unpackbits(w).mean()) < 0.15
    True
    """
    if bits % 8:
        raise ValueError(f"bits must be a multiple of 8, got {bits}")
    twins = n // 64 if twins is None else twins
    if on_gpu:
        import cupy

        rng = cupy.random.default_rng(seed)

        def piece(rows: int, p: float) -> np.ndarray:
            b = (rng.random((rows, bits), dtype=cupy.float32) < p).astype(cupy.uint8)
            return cupy.packbits(b.ravel()).reshape(rows, bits // 8).get()
    else:
        host = np.random.default_rng(seed)

        def piece(rows: int, p: float) -> np.ndarray:
            return np.packbits(host.random((rows, bits), dtype=np.float32) < p, axis=1)

    words = np.concatenate([piece(min(PIECE, n - s), density) for s in range(0, n, PIECE)]
                           or [np.zeros((0, bits // 8), np.uint8)])
    if twins:
        words[twins:2 * twins] = words[:twins] ^ piece(twins, 0.01)
    return words


def check_top_k(indices: Any, scores: Any, truth: np.ndarray, sample: np.ndarray, k: int,
                 exclude: np.ndarray | None) -> None:
    """Rows ``sample`` of a top-k against ``truth`` (their exact scores), stable tie rule."""
    got_i, got_s = (np.asarray(a.get() if hasattr(a, "get") else a)[sample]
                    for a in (indices, scores))
    for j, row in enumerate(sample):
        want = truth[j].astype(np.float64)
        if exclude is not None:
            want[exclude[j]] = -np.inf
        order = np.argsort(-want, kind="stable")[:k]
        if not (np.array_equal(got_i[j], order) and np.array_equal(got_s[j], want[order])):
            raise AssertionError(f"top-k of row {row} differs from NumPy's")


def _check_pairs(pairs: tuple[Any, ...], truth: np.ndarray, sample: np.ndarray,
                 threshold: float, exclude: np.ndarray | None) -> None:
    rows, cols, scores = (np.asarray(a.get() if hasattr(a, "get") else a) for a in pairs)
    for j, row in enumerate(sample):
        keep = truth[j] >= np.float32(threshold)
        if exclude is not None:
            keep[exclude[j]] = False
        mine = rows == row
        want = np.nonzero(keep)[0]
        if not (np.array_equal(cols[mine], want) and np.array_equal(scores[mine],
                                                                     truth[j][want])):
            raise AssertionError(f"threshold pairs of row {row} differ from NumPy's")


def run(
    n: int = 1_000_000,
    bits: int = 2048,
    density: float = 0.075,
    queries: int = 10_000,
    chunk_rows: int = 32768,
    k: int = 10,
    threshold: float = 0.7,
    peer_rows: int = 65536,
    repeat: int = 2,
    skip: tuple[str, ...] = (),
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the similarity table and return the report (see
    :func:`dask_gpuchunk.bench.report.save`)."""
    import dask

    from ..arrays import asarray
    from ..bits.similarity import similarity

    bench = Bench(repeat, skip, log)
    table = "similarity"
    gpu = bench.has_gpu
    log(f"similarity: {n:,} fingerprints of {bits} bits at density {density}, "
        f"{queries:,} queries ...")
    words = make_fingerprints(n, bits, density, seed=1, on_gpu=gpu)
    pick = np.random.default_rng(2)
    from_db = pick.choice(n, size=queries, replace=queries > n)
    flips = make_fingerprints(queries, bits, 0.02, seed=3, on_gpu=gpu, twins=0)
    query_words = words[from_db] ^ flips
    sample = np.unique(np.concatenate([pick.choice(max(n // 32, 1), 4),
                                       pick.choice(n, 4)]))
    q_sample = np.unique(pick.choice(queries, 4)) if queries else np.zeros(0, int)
    # The sampled rows' and queries' exact scores in one pass over the database.
    truth, q_truth = np.split(tanimoto_rows(words, np.concatenate(
        [words[sample], query_words[q_sample]])), [len(sample)])
    q_hamming = np.array([np.bitwise_count(words ^ row).sum(axis=1, dtype=np.int64)
                          for row in query_words[q_sample]]).reshape(len(q_sample), len(words))
    limits: dict[str, float] = {}
    if gpu:
        import cupy

        def place(w: np.ndarray) -> Any:
            (x,) = dask.persist(asarray(cupy.asarray(w), (chunk_rows, w.shape[1])))
            return x
    else:
        def place(w: np.ndarray) -> Any:
            return asarray(w, (chunk_rows, w.shape[1]))
    x, qx = place(words), place(query_words)
    where = "device-resident" if gpu else "host"
    held: list[Any] = []  # the last result, for its check

    def computed(*args: Any, **kw: Any) -> Callable[[], None]:
        def once() -> None:
            held[:] = [dask.compute(*similarity(*args, packed=True, **kw))]
            _sync(gpu)
        return once

    all_pairs, cross = float(n) * (n - 1) / 2, float(queries) * n  # unique pairs
    exclude = sample[:, None]
    rows = [  # name, pairs scored, what to compute, its check, whether it finds pairs
        (f"ours all-pairs top-{k} ({where})", all_pairs, computed(x, top_k=k),
         lambda got: check_top_k(*got, truth, sample, k, exclude), False),
        (f"ours all-pairs threshold {threshold} ({where})", all_pairs,
         computed(x, threshold=threshold),
         lambda got: _check_pairs(got, truth, sample, threshold, exclude), True),
        (f"ours queries x database top-{k} ({where})", cross, computed(qx, x, top_k=k),
         lambda got: check_top_k(*got, q_truth, q_sample, k, None), False),
        (f"ours queries x database threshold {threshold} ({where})", cross,
         computed(qx, x, threshold=threshold),
         lambda got: _check_pairs(got, q_truth, q_sample, threshold, None), True),
        # Hamming, best = nearest: beside FAISS's binary index (checked as negated scores)
        (f"ours queries x database Hamming top-{k} ({where})", cross,
         computed(qx, x, top_k=k, metric="hamming"),
         lambda got: check_top_k(got[0], -np.asarray(getattr(got[1], "get", lambda: got[1])()),
                                  -q_hamming, q_sample, k, None), False),
    ]
    for name, pairs, once, check, finds_pairs in rows:
        e = bench.timed(table, name, once, check=lambda check=check: check(held[0]))
        if e is not None:
            e.extra["pairs"] = pairs
            if finds_pairs and held:
                e.extra["pairs_found"] = int(held[0][0].shape[0])
        held.clear()
    ends = np.cumsum(x.chunks[0]).tolist()
    chunks = list(dask.compute(*(x[e - c:e] for c, e in zip(x.chunks[0], ends))))
    if gpu:
        cupy.get_default_memory_pool().free_all_blocks()
    e = bench.timed(table, f"ours dense counts of the all-pairs blocks ({where})",
                    lambda: _dense_blocks(chunks, gpu))
    if e is not None:
        e.extra["pairs"] = all_pairs
    if gpu:
        x = qx = chunks = None
        cupy.get_default_memory_pool().free_all_blocks()
    block_entries(bench, table, words, chunk_rows, k, threshold)
    if gpu:
        cupy.get_default_memory_pool().free_all_blocks()
        if bench.want("ceiling"):
            log("1-bit tensor-core ceiling ...")
            limits.update(tensor_core_ceiling())
            if "bmma_bit_macs_per_s" in limits:
                limits["ceiling_pairs_per_s"] = limits["bmma_bit_macs_per_s"] / bits
    time_peers(bench, table, words, query_words, peer_rows, k, gpu, threshold)
    return _report(bench.entries, limits, n=n, bits=bits, density=density, queries=queries,
                   chunk_rows=chunk_rows, k=k, threshold=threshold, peer_rows=peer_rows)


def _sync(gpu: bool) -> None:
    if gpu:
        import cupy

        cupy.cuda.Device().synchronize()


def _dense_blocks(chunks: list[Any], gpu: bool) -> None:
    """Every all-pairs block's counts (on and above the diagonal), one block at a time,
    computed and dropped: the dense Gram's work without scoring (and without Dask, whose
    threads would hold several 1 GiB blocks at once)."""
    from ..bits.gram import block_counts

    for i, a in enumerate(chunks):
        for b in chunks[i:]:
            block_counts(a, b)
    _sync(gpu)


def tensor_core_ceiling(rows: int = 8192, kbits: int = 65536, repeat: int = 5
                        ) -> dict[str, float]:
    """Our bmma kernel's rate on a Gram whose time is all multiply-accumulate (long rows):
    ``rows * rows * kbits / t`` bit-MAC/s, the whole ``C`` computed. Empty where the GPU has no
    1-bit tensor cores."""
    import cupy

    from .._kernels.bmma import bmma_cuda, bmma_supported

    if not bmma_supported():
        return {}
    a = cupy.asarray(np.random.default_rng(0).integers(0, 2**64, size=(rows, kbits // 64),
                                                       dtype=np.uint64, endpoint=False))
    c = cupy.empty((rows, rows), dtype=np.int32)
    bmma_cuda(a, a, c)
    best = float("inf")
    for _ in range(repeat):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        bmma_cuda(a, a, c)
        cupy.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - t0)
    return {"bmma_bit_macs_per_s": float(rows) * rows * kbits / best, "bmma_seconds": best}


def _report(entries: list[Entry], limits: dict[str, float], **workload: Any) -> dict[str, Any]:
    ceiling = limits.get("ceiling_pairs_per_s")
    dense = next((e.extra["pairs"] / e.seconds for e in entries
                  if e.name.startswith("ours dense") and e.seconds), None)
    for e in entries:
        if e.seconds is None or "pairs" not in e.extra:
            continue
        e.extra["pairs_per_s"] = e.extra["pairs"] / e.seconds
        if ceiling:
            e.extra["vs_ceiling"] = e.extra["pairs_per_s"] / ceiling
        if dense is not None:
            e.extra["vs_dense"] = e.extra["pairs_per_s"] / dense
    return report_of("similarity", entries, machine_info(), workload, limits)


def format_table(report: dict[str, Any]) -> str:
    """Seconds and pairs per second of every row, against the dense counts and the ceiling."""
    m, w, lim = report["machine"], report["workload"], report["limits"]
    lines = [machine_line(m),
             f"workload: {w['n']:,} fingerprints of {w['bits']} bits (density {w['density']}), "
             f"{w['queries']:,} queries, {w['chunk_rows']:,}-row chunks, top-{w['k']}, "
             f"threshold {w['threshold']}; Tanimoto; pairs/s are unique pairs (all pairs: "
             "n (n - 1) / 2)"]
    if "ceiling_pairs_per_s" in lim:
        lines.append(f"limit: bmma kernel {lim['bmma_bit_macs_per_s']:.3g} bit-MAC/s on a long-K "
                     f"Gram = {lim['ceiling_pairs_per_s']:.3g} pairs/s at {w['bits']} bits")
    lines.append(f"  {'':62s} {'seconds':>9s} {'pairs/s':>9s} {'x dense':>7s} {'x ceil':>6s}"
                 "  note")
    for e in report["entries"]:
        if e["seconds"] is None:
            lines.append(f"  {e['name']:62s} {'-':>9s}  skipped: {e['skipped']}")
            continue
        x = e["extra"]
        rate = f"{x['pairs_per_s']:.3g}" if "pairs_per_s" in x else ""
        dense = f"{x['vs_dense']:.2f}" if "vs_dense" in x else ""
        ceil = f"{x['vs_ceiling']:.2f}" if "vs_ceiling" in x else ""
        note = []
        if "pairs_found" in x:
            note.append(f"{x['pairs_found']:,} pairs found")
        if e["kind"] == "peer" and "pairs" in x:
            note.append(f"timed on {x['pairs']:.3g} pairs")
        if e["first_run"] is not None and e["first_run"] > 1.5 * e["seconds"]:
            note.append(f"first run {e['first_run']:.2f} s")
        lines.append(f"  {e['name']:62s} {e['seconds']:9.4f} {rate:>9s} {dense:>7s} {ceil:>6s}"
                     f"  {'; '.join(note)}")
    return "\n".join(lines)
