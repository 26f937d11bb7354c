"""The similarity job: each row's top k, the pairs over a threshold, or every score, of a
file's fingerprints (``.npy``, Zarr, chemfp's ``.fps``, FPSim2's ``.h5``), into a file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import dask
import numpy as np

from ..arrays import asarray
from ..config import listed_graphs
from ..devices import distributed_client_active
from ..bits.gram import bitpack
from ..io import npy_bytes, npy_reader_of
from ..io.npz_writing import npz_bytes, write_npz
from ..io.zarr_files import is_zarr_path
from ..progress import BlockProgress
from ..runtime.backend import to_host
from .common import (
    InputError,
    Job,
    OutputError,
    Progress,
    _ArrayInfo,
    _bits_header,
    _budgets_where_it_runs,
    _check_counting_options,
    check_gpus_where_it_runs,
    _check_output,
    _output_options,
    _read,
    _read_fps,
    _run,
    _start_warmup,
    _write,
    is_fps_path,
    job_errors,
)
from .gram import CHUNK_ROWS, MIN_CHUNK_ROWS

__all__ = ["similarity_job"]

def _similarity_words(x: Any, packed: bool, device: str, on_gpu: bool, selection: bool
                      ) -> Any:
    """A similarity job's input rows as the job computes on them: packed (unless ``packed``)
    into whole-row chunks, on the GPUs where ``on_gpu``; for a ``selection`` (top-k or threshold) of
    a ``.npy``'s words left as they are where graphs are listed, since its blocks then read those
    themselves where they run, once per worker (:mod:`dask_gpuchunk.runtime.resident`): none are
    sent between workers."""
    if not packed:
        x = bitpack(x, device="cpu" if device == "cpu" else "auto")
    x = x.rechunk({1: -1})
    if not on_gpu or (selection and listed_graphs() and npy_reader_of(x) is not None):
        return x
    return x.map_blocks(_on_device, dtype=x.dtype, meta=x._meta)


def _on_host_all(result: tuple[Any, ...]) -> tuple[Any, ...]:
    """A top-k's or threshold's arrays with NumPy blocks, made on the worker that holds each
    (:func:`dask_gpuchunk.runtime.backend.to_host`)."""
    return tuple(a.map_blocks(to_host, dtype=a.dtype, meta=np.empty((0,) * a.ndim, a.dtype))
                 for a in result)


#: Rows a chunk of the similarity job's warm-up: more than a target's candidate slots in the
#: fused top-k (:data:`dask_gpuchunk._kernels.bmma_select.SLOTS`), so that its empty rows, which
#: tie with every row, overflow them and the exact redo of such targets is compiled too (its
#: ~2 s of kernels had compiled in a first 10^6-row job's last task).
WARM_UP_ROWS = 96


def _warm_similarity(dtype: str, width: int, packed: bool, queries: bool, on_gpu: bool,
                     from_npy_file: bool = False, **options: Any) -> None:
    """Compile the kernels a similarity job runs (``options``: :func:`similarity`'s), on
    random rows of its input's ``dtype`` and ``width`` (packed words, or 0/1 values) in three
    row chunks (two of queries), made ready as the job makes its inputs (``from_npy_file``:
    read back from a small ``.npy`` in a temporary folder, as the job reads its ``.npy``), in
    this thread (dask's synchronous scheduler).

    A first job's tasks otherwise each compiled the CuPy kernels they met first, the same ones
    in every thread at once: on an H100 machine (16 threads), 91 NVRTC compiles of 40 s; each
    kernel is now compiled once, here, and its tasks find it made. Rows made in memory missed
    the kernels of a ``.npy``'s read and of the top-k chain over it: ~1.7 s of a first 7.0 s
    job's compiles, in its tasks."""
    from ..bits.similarity import compile_selection_ahead, similarity

    top_k = options.get("top_k")
    if on_gpu:  # the longest compile first, beside the rest
        compile_selection_ahead(options.get("method", "auto"), top_k, options.get("threshold"),
                                options.get("metric", "tanimoto"))
    rows = max(WARM_UP_ROWS, (top_k or 0) + 1)
    rng = np.random.default_rng(0)
    dt = np.dtype(dtype)
    values = (rng.integers(0, np.iinfo(dt).max, (3 * rows, width), dtype=dt.newbyteorder("="),
                           endpoint=True) if packed
              else rng.integers(0, 2, (3 * rows, width))).astype(dt)
    values.reshape(3, rows, width)[:, -4:] = 0  # empty rows: they tie with every row

    with tempfile.TemporaryDirectory(prefix="dask-gpuchunk-warm-up-") as folder:
        def words_of(v: np.ndarray, name: str) -> Any:
            if from_npy_file:
                path = os.path.join(folder, f"{name}.npy")
                np.save(path, v)
                x = _read(path, chunks=(rows, -1))
            else:
                x = asarray(v, chunks=(rows, -1))
            return _similarity_words(x, packed, options.get("device", "auto"), on_gpu,
                                     top_k is not None or options.get("threshold") is not None)

        result = similarity(words_of(values, "x"),
                            words_of(values[:2 * rows], "y") if queries else None,
                            packed=True, **options)
        dask.compute(_on_host_all(result) if isinstance(result, tuple) else result,
                     scheduler="sync")


# : Rows per chunk of a similarity job on GPUs, halved while a block would not fit the workers' :
# budget (:func:`dask_gpuchunk.bits.similarity.block_bytes`); 4,096 on the CPU. Measured on an H200
# under an : 8 GiB cap, the API on device words: all-pairs top-10 of 10**6 x 2048 bits in 2.8 s in :
# 16,384-row chunks, 2.0 s in 32,768-row ones (threshold 0.7: 3.95 s, 1.63 s). A row chunk's : first
# block, selected on the plain path, once held all its counts (4 GiB in 32,768-row : chunks); its
# counts are now taken in slices. The job from a .npy in process (H100, 8 GiB : cap): 6.4 s end to
# end in 32,768-row chunks, 8.3 s in 16,384-row ones.
SIMILARITY_CHUNK_ROWS = 32768


def _on_device(block: Any) -> Any:
    """A chunk of packed words moved to this worker's GPU once (each block of a similarity
    then runs on device words instead of staging both of its chunks again)."""
    import cupy

    return cupy.asarray(block)


def _check_similarity_inputs(paths: list[Any], headers: list[Any], packed: bool,
                             top_k: int | None, threshold: float | None, metric: str,
                             exclude_self: bool) -> None:
    """What :func:`dask_gpuchunk.similarity` checks of its arguments, in the command line's
    words, before any cluster starts: ``--queries`` and FINGERPRINTS of the same bits,
    ``--top-k`` within the candidates, ``--threshold`` within the metric's scores."""
    from .._kernels.similarity import FLOAT_METRICS

    (n, width), dtype = headers[-1].shape, headers[-1].dtype
    if len(headers) == 2 and (headers[0].shape[1] != width or headers[0].dtype != dtype):
        what = "words" if packed else "bits"
        raise InputError(f"--queries {paths[0]} has {headers[0].shape[1]} {what} of "
                         f"{headers[0].dtype} a row, FINGERPRINTS {paths[1]} {width} of {dtype}: "
                         "they must be fingerprints of the same kind")
    candidates = n - 1 if exclude_self else n
    if top_k is not None and candidates < 1:
        raise InputError(f"FINGERPRINTS {paths[-1]} has {n:,} row(s): no candidates for --top-k"
                         + (" other than each row itself" if exclude_self and n else ""))
    if top_k is not None and not 1 <= top_k <= candidates:
        raise ValueError(f"--top-k must be between 1 and {candidates:,} (the candidates of each "
                         f"row in {paths[-1]}); got {top_k}")
    bits = width * dtype.itemsize * 8 if packed else width
    high = 1.0 if metric in FLOAT_METRICS else bits
    if threshold is not None and not 0 <= threshold <= high:
        raise ValueError(f"--threshold for --metric {metric} must be from 0 to {high}; got "
                         f"{threshold}")


def similarity_job(
    fingerprints: str | os.PathLike,
    out: str | os.PathLike,
    *,
    queries: str | os.PathLike | None = None,
    metric: str = "tanimoto",
    top_k: int | None = None,
    threshold: float | None = None,
    packed: bool = False,
    exclude_self: bool | None = None,
    method: str = "auto",
    device: str = "auto",
    chunk_rows: int | None = None,
    overwrite: bool = False,
    compression: str = "none",
    zarr_format: int = 3,
    alpha: float | None = None,
    beta: float | None = None,
) -> Job:
    """Check the files of a similarity job now; return the job, to run as ``job(progress)``.

    All pairs of ``fingerprints`` (``.npy`` or ``.zarr``, 0/1 data or with ``packed`` packed
    words), or each row of ``queries`` against them (:func:`dask_gpuchunk.similarity`). With
    ``top_k``: ``out`` is a ``.npz`` of ``indices`` and ``scores`` ``(n, top_k)`` (with
    ``threshold`` too, those short of it masked as :func:`dask_gpuchunk.similarity` does);
    with ``threshold`` alone: a ``.npz`` of ``rows``, ``cols`` and ``scores``; else the dense scores into
    a ``.npy`` or Zarr store. ``chunk_rows``: rows per chunk of each input; ``None``:
    :data:`SIMILARITY_CHUNK_ROWS` on GPUs, halved while a block would not fit the workers'
    budget, 4,096 on the CPU. On GPUs the packed words are moved to the devices once: for
    top-k of a packed ``.npy``, read there by each worker (none sent between workers).
    ``alpha``, ``beta``: Tversky's weights (``metric="tversky"``), as
    :func:`dask_gpuchunk.similarity` takes them.
    """
    from .._kernels.similarity import score_dtype
    from ..bits.similarity import METRICS, similarity
    from ..bits.similarity import block_bytes as similarity_block_bytes

    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")
    _check_counting_options(method, device, chunk_rows)
    paths = [fingerprints] if queries is None else [queries, fingerprints]
    fps = {i: _read_fps(path) for i, path in enumerate(paths) if is_fps_path(path)}
    if fps and len(fps) < len(paths) and not packed:
        raise InputError("an .fps or FPSim2 .h5 file holds packed words: give the other input "
                         "as packed words too (--packed), or as such a file")
    packed = packed or bool(fps)
    headers = [_ArrayInfo(fps[i].words.shape, fps[i].words.dtype) if i in fps
               else _bits_header(path, packed, "similarity") for i, path in enumerate(paths)]
    n, m = headers[0].shape[0], headers[-1].shape[0]
    _check_similarity_inputs(paths, headers, packed, top_k, threshold, metric,
                             (queries is None) if exclude_self is None else exclude_self)
    dense = top_k is None and threshold is None
    suffix = Path(out).suffix
    if dense and suffix == ".npz":
        raise OutputError(f"output {out}: dense scores go to a .npy file or a Zarr store; "
                          "top-k and threshold results to a .npz")
    if not dense and suffix != ".npz":
        raise OutputError(f"output {out}: top-k and threshold results go to a .npz file")
    dtype = score_dtype(metric)
    output = _output_options(out, compression, zarr_format) if dense else {}
    nbytes = (npy_bytes(dtype, (n, m)) if dense else npz_bytes({
        "indices": _ArrayInfo((n, int(top_k)), np.dtype(np.int64)),
        "scores": _ArrayInfo((n, int(top_k)), np.dtype(dtype))}) if top_k is not None else 0)
    target = _check_output(out, paths, overwrite, nbytes, output)

    def words_of(i: int, rows: int, on_gpu: bool) -> Any:
        import dask.array as da

        read = (da.from_array(fps[i].words, chunks=(rows, -1)) if i in fps
                else _read(paths[i], chunks=(rows, -1)))
        return _similarity_words(read, packed, device, on_gpu,
                                 top_k is not None or threshold is not None)

    def run(progress: Progress) -> dict[str, Any]:
        check_gpus_where_it_runs(method, device)
        budgets = _budgets_where_it_runs() if device != "cpu" else []
        rows = chunk_rows or (SIMILARITY_CHUNK_ROWS if budgets else CHUNK_ROWS)
        h = headers[0]  # 64-bit words per row
        width = -(-h.shape[1] * h.dtype.itemsize // 8) if packed else -(-h.shape[1] // 64)
        if budgets and chunk_rows is None:
            # "auto": wgmma, bmma or int8, as the workers' GPUs have them; the largest.
            methods = ["wgmma", "bmma", "int8"] if method == "auto" else [method]
            while rows > MIN_CHUNK_ROWS and max(similarity_block_bytes(
                    rows, width, each, top_k, threshold, metric) for each in methods
            ) > min(budgets):
                rows //= 2
        x = words_of(0, rows, bool(budgets))
        y = None if queries is None else words_of(1, rows, bool(budgets))
        t0 = time.perf_counter()
        options = dict(metric=metric, top_k=top_k, threshold=threshold,
                       exclude_self=exclude_self, method=method, device=device, alpha=alpha,
                       beta=beta)
        warm = (h.dtype.str, h.shape[1], packed, queries is not None, bool(budgets),
                not is_zarr_path(paths[0]) and not fps)
        if distributed_client_active():  # each worker compiles while the words are read
            warming = _start_warmup(_warm_similarity, *warm, **options)  # noqa: F841
        else:
            try:
                _warm_similarity(*warm, **options)
            except Exception as exc:  # noqa: BLE001 - the job meets the same code, and says
                logging.getLogger("dask_gpuchunk").debug("similarity warm-up: %r", exc)
        result = similarity(x, y, packed=True, **options)
        if dense:
            _run(lambda: _write(result, target, overwrite, progress, output))
            pairs_found = None
        else:
            # All pairs: the blocks on and above the diagonal; queries: each pair of chunks.
            cx, cy = len(x.chunks[0]), len(x.chunks[0] if y is None else y.chunks[0])
            blocks = cx * (cx + 1) // 2 if y is None else cx * cy
            report = ((lambda done, total: progress(done, total, "blocks"))
                      if progress is not None else None)
            watching = (contextlib.nullcontext() if report is None
                        else BlockProgress(blocks, report))
            names = ("indices", "scores") if top_k is not None else ("rows", "cols", "scores")
            arrays = dict(zip(names, result))
            # The molecules' ids of .fps inputs: indices, cols index ids; rows query_ids.
            if len(paths) - 1 in fps:
                arrays["ids"] = fps[len(paths) - 1].ids
            if queries is not None and 0 in fps:
                arrays["query_ids"] = fps[0].ids
            # Each worker writes its row chunks into the .npz: no result passes through here.
            with job_errors(), watching:
                shapes = write_npz(target, arrays, overwrite)
            pairs_found = None if top_k is not None else int(shapes["rows"][0])
            if report is not None:
                report(blocks, blocks)
        seconds = time.perf_counter() - t0
        shape = ([n, m] if dense else [n, int(top_k)] if top_k is not None
                 else [pairs_found])
        return {
            "command": "similarity",
            "inputs": [{"path": str(p), "shape": list(h.shape), "dtype": str(h.dtype),
                        "packed": packed} for p, h in zip(paths, headers)],
            "output": {"path": str(target), "shape": shape, "dtype": str(dtype)},
            "metric": metric,
            **({"alpha": alpha, "beta": beta} if metric == "tversky" else {}),
            "top_k": top_k,
            "threshold": threshold,
            "pairs_found": pairs_found,
            "chunk_rows": rows,
            "seconds": seconds,
            # unique pairs: all pairs once each, n (n - 1) / 2; queries x database n m
            "pairs_per_s": (n * (n - 1) / 2 if queries is None else n * m) / seconds
            if seconds else None,
        }

    return run
