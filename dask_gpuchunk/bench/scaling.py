"""``dask-gpuchunk bench scaling``: the Gram and the similarity top-k on one GPU and on every
GPU of this node, each size on a ``dg.local_cluster`` of its own, in one run, with each row's
speed-up over the smallest size. Where no GPU is visible the same rows run on local clusters
of CPU workers (the sizes then count workers): a check of the bench itself, not a figure.

The inputs are written once into a temporary folder: random packed bits for the Gram, the
similarity bench's fingerprints for the top-k. Rows, on every size:

* ``gram, words on the GPUs``: the ``.npy``'s chunks moved to the GPUs and persisted over the
  workers (untimed), then ``dg.gram(words, packed=True).sum()``;
* ``gram from the .npy, kept on the device``: ``dg.gram(dg.from_npy(...), packed=True,
  keep_on_device=True).sum()``;
* ``gram from the .npy``: the same with C's blocks summed on the host (the default);
* ``gram's graph on trivial words``: the first row's graph (as many row chunks, grouped as
  its blocks were) over words of 4 rows of 64 bits a chunk, persisted where the first row's
  were: what Dask's scheduling of that graph costs with next to no work in it, the floor under
  the Gram's rows that a second GPU cannot shorten;
* ``similarity top-k from the .npy``: ``dg.similarity(dg.from_npy(...), packed=True,
  top_k=k)``, both results computed to this process.

Timed: the compute alone, the median of ``repeat`` runs after one that compiles. Checked: the
Gram's sum against the column counts (``sum(C)`` is the sum over bit columns of the square of
the ones in each) and two of its rows against NumPy; the top-k's sampled rows against NumPy's
exact Tanimotos. Throughput of the top-k is counted in unique pairs, ``n (n - 1) / 2``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.backend import to_host
from .report import machine_info, machine_line, report_of
from .similarity import check_top_k, make_fingerprints
from .similarity_peers import tanimoto_rows
from .timing import Bench, Entry

__all__ = ["FLOOR_ROW", "GRAM_ROWS", "TOP_K_ROW", "floor_total", "floor_words", "format_table",
           "gram_expectations", "run", "worker_counters"]

TABLE = "scaling"
GRAM_ROWS = ("gram, words on the GPUs", "gram from the .npy, kept on the device",
             "gram from the .npy")
FLOOR_ROW = "gram's graph on trivial words"
#: Rows a chunk and bytes a row of the trivial words of :data:`FLOOR_ROW`.
FLOOR_CHUNK_ROWS, FLOOR_ROW_BYTES = 4, 8
TOP_K_ROW = "similarity top-k from the .npy"


def gram_expectations(packed: np.ndarray, sample: np.ndarray, slab: int = 1024
                      ) -> tuple[int, np.ndarray]:
    """What a Gram of the packed bits ``packed`` must give: the sum of every count (the ones in
    each bit column, squared, summed; read ``slab`` rows at a time) and rows ``sample`` of C.

    Examples
    --------
    >>> bits = np.random.default_rng(0).integers(0, 2, (9, 16), dtype=np.uint8)
    >>> total, rows = gram_expectations(np.packbits(bits, axis=1), np.array([2]), slab=4)
    >>> c = bits.astype(np.int64) @ bits.T
    >>> total == int(c.sum()), bool((rows == c[[2]]).all())
    (True, True)
    """
    ones = np.zeros(packed.shape[1] * 8, np.int64)
    for start in range(0, len(packed), slab):
        ones += np.unpackbits(packed[start:start + slab], axis=1).sum(axis=0, dtype=np.int64)
    rows = np.stack([np.bitwise_count(packed & packed[r]).sum(axis=1, dtype=np.int64)
                     for r in sample])
    return int((ones * ones).sum()), rows


def _to_device(block: np.ndarray) -> Any:
    import cupy

    return cupy.asarray(block)


def _persisted_on_gpus(client: Any, words: Any) -> Any:
    """``words``' chunks moved to the GPUs and persisted over the workers of ``client``."""
    import cupy
    from distributed import wait

    words = client.persist(words.map_blocks(_to_device, dtype=words.dtype,
                                            meta=cupy.empty((0, 0), words.dtype)))
    wait(words)
    return words


def _on_host(x: Any) -> Any:
    """A dask array's blocks as NumPy, made where they are (a GPU's blocks leave it as bytes)."""
    return x.map_blocks(to_host, dtype=x.dtype, meta=np.empty((0,) * x.ndim, x.dtype))


def _cluster_options(size: int, gpus: bool, protocol: str | None,
                     threads_per_gpu: int | str | None = None) -> dict[str, Any]:
    """``dg.local_cluster``'s options for a cluster of ``size`` GPUs (or CPU workers) talking
    ``protocol`` (``None``: its default, TLS; ``"tcp"``: plain TCP; ``"ucx"``), with
    ``threads_per_gpu`` Dask threads per GPU worker (``None``: the cluster's default).

    Examples
    --------
    >>> _cluster_options(2, True, "ucx", "cores")
    {'gpus': 2, 'threads_per_gpu': 'cores', 'protocol': 'ucx'}
    >>> _cluster_options(2, False, "tcp", 4)
    {'n_workers': 2, 'threads_per_worker': 1, 'secure': False}
    """
    options: dict[str, Any] = ({"gpus": size} if gpus
                               else {"n_workers": size, "threads_per_worker": 1})
    if gpus and threads_per_gpu is not None:
        options["threads_per_gpu"] = threads_per_gpu
    if protocol == "ucx":
        options["protocol"] = "ucx"
    elif protocol == "tcp":
        options["secure"] = False
    return options


def worker_counters() -> dict[str, int]:
    """What this process did so far that a row's time may hide: chunks rerun alone after the
    device ran out (``retried_alone``), stored results moved to the host for an allocation
    (``spilled_bytes``), words read to a device or the host (``words_read_bytes``).

    Examples
    --------
    >>> sorted(worker_counters())
    ['retried_alone', 'spilled_bytes', 'words_read_bytes']
    """
    from ..runtime.budget import retried_alone, spilled_on_failure
    from ..runtime.resident import resident_stats

    return {"retried_alone": retried_alone["chunks"],
            "spilled_bytes": spilled_on_failure["bytes"],
            "words_read_bytes": sum(s["bytes_read"] for s in resident_stats().values())}


def _counted(client: Any, run: Callable[[], Entry | None]) -> Entry | None:
    """``run()``'s entry with the workers' :func:`worker_counters` over it (warm-up and
    checks included), summed over the workers."""
    before = client.run(worker_counters)
    entry = run()
    after = client.run(worker_counters)
    if entry is not None:
        entry.extra["workers_did"] = {k: sum(after[w][k] - before[w][k] for w in after)
                                      for k in next(iter(after.values()), {})}
    return entry


def _gram_rows(bench: Bench, client: Any, path: Path, chunk_rows: int, where: str,
               expected: tuple[int, np.ndarray, np.ndarray]) -> tuple[int, ...] | None:
    """The Gram's three rows on the cluster of ``client``, each checked. Returns the first
    row's groups, as counts of row chunks (``None`` where none ran)."""
    from ..bits.gram import gram
    from ..io import from_npy

    total, sample, rows = expected
    groups: tuple[int, ...] | None = None
    for name in GRAM_ROWS:
        full = f"{name}, {where}"
        if not bench.want(full):
            continue
        if name != GRAM_ROWS[2] and not bench.has_gpu:
            bench.add(Entry(TABLE, full, "ours", skipped="no CUDA GPU visible"))
            continue
        words = from_npy(path, chunks=(chunk_rows, -1))
        if name == GRAM_ROWS[0]:
            words = _persisted_on_gpus(client, words)
        c = gram(words, packed=True, keep_on_device=name == GRAM_ROWS[1])
        held: list[Any] = []

        def once(c: Any = c, held: list[Any] = held) -> None:
            held[:] = [client.compute(c.sum(), sync=True)]

        def check(c: Any = c, held: list[Any] = held) -> None:
            if int(held[0]) != total:
                raise AssertionError(f"sum of C {int(held[0])}, expected {total}")
            got = client.compute(_on_host(c[sample]), sync=True)
            if not np.array_equal(got, rows):
                raise AssertionError("sampled rows of C differ from NumPy's")

        entry = _counted(client, lambda: bench.timed(TABLE, full, once, check=check))
        if entry is not None:
            entry.extra.update(row=name, workers=where, c_row_blocks=list(c.chunks[0]))
        if groups is None:
            groups = tuple(-(-rows // chunk_rows) for rows in c.chunks[0])
        del words, c
    return groups


def floor_words(groups: Sequence[int], seed: int = 0) -> tuple[np.ndarray, tuple[int, ...], int]:
    """Random words for :data:`FLOOR_ROW`: as many row chunks as ``groups`` (counts of chunks
    per group) add up to, each :data:`FLOOR_CHUNK_ROWS` rows of :data:`FLOOR_ROW_BYTES` bytes;
    their row chunks and the ``block_rows`` that groups them the same way.

    Examples
    --------
    >>> from dask_gpuchunk.bits.gram import grouped_row_chunks
    >>> words, chunks, block_rows = floor_words((3, 3, 1))
    >>> words.shape, grouped_row_chunks(chunks, block_rows)
    ((28, 8), (12, 12, 4))
    """
    chunks = (FLOOR_CHUNK_ROWS,) * int(sum(groups))
    words = np.random.default_rng(seed).integers(0, 256, (sum(chunks), FLOOR_ROW_BYTES),
                                                 dtype=np.uint8)
    return words, chunks, FLOOR_CHUNK_ROWS * max(groups)


def floor_total(words: np.ndarray) -> int:
    """The sum of the Gram of small packed ``words``, by NumPy.

    Examples
    --------
    >>> floor_total(np.array([[0b11000000], [0b01000000]], dtype=np.uint8))  # [[2, 1], [1, 1]]
    5
    """
    bits = np.unpackbits(words, axis=1).astype(np.int64)
    return int((bits @ bits.T).sum())


def _floor_row(bench: Bench, client: Any, groups: Sequence[int], where: str) -> None:
    """:data:`FLOOR_ROW` on the cluster of ``client``: the grouped Gram of
    :func:`floor_words`, persisted (on the GPUs where there are), ``C.sum()`` checked."""
    import dask.array as da
    from distributed import wait

    from ..bits.gram import gram

    name = f"{FLOOR_ROW}, {where}"
    if not bench.want(name):
        return
    host, chunks, block_rows = floor_words(groups)
    words = da.from_array(host, chunks=(chunks, -1))
    if bench.has_gpu:
        words = _persisted_on_gpus(client, words)
    else:
        words = client.persist(words)
        wait(words)
    total = floor_total(host)
    s = gram(words, packed=True, block_rows=block_rows).sum()
    held: list[Any] = []

    def once() -> None:
        held[:] = [client.compute(s, sync=True)]

    def check() -> None:
        if int(held[0]) != total:
            raise AssertionError(f"sum of C {int(held[0])}, expected {total}")

    entry = bench.timed(TABLE, name, once, check=check)
    if entry is not None:
        entry.extra.update(row=FLOOR_ROW, workers=where, groups=list(groups),
                           tasks=len(dict(s.__dask_graph__())))


def _top_k_row(bench: Bench, client: Any, path: Path, chunk_rows: int, k: int, where: str,
               sample: np.ndarray, truth: np.ndarray) -> None:
    from ..bits.similarity import similarity
    from ..io import from_npy

    name = f"{TOP_K_ROW}, {where}"
    if not bench.want(name):
        return
    result = similarity(from_npy(path, chunks=(chunk_rows, -1)), packed=True, top_k=k)
    held: list[Any] = []

    def once() -> None:
        held[:] = client.compute([_on_host(a) for a in result], sync=True)

    entry = _counted(client, lambda: bench.timed(
        TABLE, name, once, check=lambda: check_top_k(*held, truth, sample, k, sample[:, None])))
    if entry is not None:
        n = len(truth[0])
        entry.extra.update(row=TOP_K_ROW, workers=where, pairs=n * (n - 1) / 2)


def run(gpus: Sequence[int] = (), rows: int = 65536, bits: int = 262144, chunk_rows: int = 4096,
        fingerprints: int = 1_000_000, fingerprint_bits: int = 2048,
        fingerprint_chunk_rows: int = 32768, k: int = 10, protocol: str | None = None,
        threads_per_gpu: int | str | None = None, repeat: int = 3, skip: tuple[str, ...] = (),
        workdir: str | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the scaling table on clusters of each size in ``gpus`` (default: one GPU and all
    of them; two CPU workers where no GPU is visible) and return the report (see
    :func:`dask_gpuchunk.bench.report.save`); ``fingerprints=0`` leaves the top-k out;
    ``threads_per_gpu`` as :func:`~dask_gpuchunk.distributed.cluster.local_cluster`'s."""
    from ..devices import gpu_count
    from ..distributed.cluster import local_cluster

    bench = Bench(repeat, skip, log)
    visible = gpu_count() if bench.has_gpu else 0
    sizes = sorted(set(gpus)) or ([1, visible] if visible > 1 else [1] if visible else [1, 2])
    if min(sizes) < 1 or (visible and max(sizes) > visible):
        raise ValueError(f"cluster sizes {sizes}: between 1 and the {visible or 'any'} "
                         f"{'GPUs visible' if visible else 'CPU workers'}")
    unit = "GPU" if visible else "CPU worker"
    rng = np.random.default_rng(5)
    with tempfile.TemporaryDirectory(prefix="dask-gpuchunk-scaling-", dir=workdir) as tmp:
        bits_path, fps_path = Path(tmp) / "bits.npy", Path(tmp) / "fingerprints.npy"
        log(f"scaling: {rows:,} x {bits:,} bits for the Gram, {fingerprints:,} fingerprints "
            f"of {fingerprint_bits} bits, on {', '.join(map(str, sizes))} {unit}(s) ...")
        packed = rng.integers(0, 256, size=(rows, bits // 8), dtype=np.uint8)
        np.save(bits_path, packed)
        sample = np.sort(rng.choice(rows, 2, replace=False))
        total, sample_rows = gram_expectations(packed, sample)
        del packed
        if fingerprints:
            words = make_fingerprints(fingerprints, fingerprint_bits, 0.075, seed=1,
                                      on_gpu=bool(visible))
            np.save(fps_path, words)
            fp_sample = np.sort(rng.choice(fingerprints, 4, replace=False))
            truth = tanimoto_rows(words, words[fp_sample])
            del words
        for size in sizes:
            where = f"{size} {unit}{'s' if size > 1 else ''}"
            with local_cluster(dashboard_address=None,
                               **_cluster_options(size, bool(visible), protocol,
                                                 threads_per_gpu)) as client:
                groups = _gram_rows(bench, client, bits_path, chunk_rows, where,
                                    (total, sample, sample_rows))
                if groups is not None:
                    _floor_row(bench, client, groups, where)
                if fingerprints:
                    _top_k_row(bench, client, fps_path, fingerprint_chunk_rows, k, where,
                               fp_sample, truth)
    _speedups(bench.entries)
    return report_of("scaling", bench.entries, machine_info(),
                     {"sizes": sizes, "unit": unit, "protocol": protocol or "tls",
                      "threads_per_gpu": threads_per_gpu or "default", "rows": rows,
                      "bits": bits, "chunk_rows": chunk_rows, "fingerprints": fingerprints,
                      "fingerprint_bits": fingerprint_bits,
                      "fingerprint_chunk_rows": fingerprint_chunk_rows, "k": k}, {})


def _speedups(entries: list[Entry]) -> None:
    """Each timed row's speed-up over the same row on the smallest cluster (the first run)."""
    first: dict[str, float] = {}
    for e in entries:
        if e.seconds is None or "row" not in e.extra:
            continue
        base = first.setdefault(e.extra["row"], e.seconds)
        e.extra["speedup"] = base / e.seconds


def format_table(report: dict[str, Any]) -> str:
    """The scaling table as plain text: each row's seconds and speed-up."""
    w = report["workload"]
    lines = [machine_line(report["machine"]),
             f"scaling over {w['protocol']}: gram of {w['rows']:,} x {w['bits']:,} bits in "
             f"{w['chunk_rows']:,}-row chunks; top-{w['k']} of {w['fingerprints']:,} "
             f"fingerprints (unique pairs/s)",
             f"  {'':58s} {'seconds':>9s} {'speed-up':>8s}  note"]
    for e in report["entries"]:
        if e["seconds"] is None:
            lines.append(f"  {e['name']:58s} {'-':>9s} {'':>8s}  skipped: {e['skipped']}")
            continue
        x = e["extra"]
        note = f"{x['pairs'] / e['seconds']:.3g} pairs/s" if "pairs" in x else ""
        if "tasks" in x:
            note += f"{x['tasks']} tasks"
        did = x.get("workers_did", {})
        if did:  # over the row's every compute: warm-up, timed runs, checks
            note += (f"{'; ' if note else ''}workers read {did['words_read_bytes'] / 1e9:.1f} "
                     f"GB of words, spilled {did['spilled_bytes'] / 1e9:.1f} GB, reran "
                     f"{did['retried_alone']} chunks alone")
        lines.append(f"  {e['name']:58s} {e['seconds']:9.4f} {x.get('speedup', 1):8.2f}  "
                     f"{note}")
    return "\n".join(lines)
