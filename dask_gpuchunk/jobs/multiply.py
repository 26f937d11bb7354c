"""The multiply job: ``out = a * b`` (NumPy broadcasting) from two ``.npy`` files (or Zarr
stores) into a third, chunk by chunk.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .._kernels.elementwise import check_dtype
from ..devices import gpu_available
from ..elementwise_ops import multiply
from ..io import npy_bytes
from .common import (
    InputError,
    Job,
    Progress,
    check_gpus_where_it_runs,
    _check_output,
    _header,
    _native_str,
    _output_options,
    _read,
    _row_chunks,
    _run,
    _start_warmup,
    _write,
)

__all__ = ["multiply_files", "multiply_job"]

def _warm_multiply(a_shape: tuple[int, ...], a_dtype: str, b_shape: tuple[int, ...],
                   b_dtype: str, device: str) -> None:
    """Compile the kernels a multiply job will use, on tiny arrays broadcast like its inputs."""
    def small(shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.ones(tuple(min(n, 2) for n in shape), dtype=dtype)

    a, b = small(a_shape, a_dtype), small(b_shape, b_dtype)
    for where in ("cpu", "gpu") if device == "auto" else (device,):
        if where == "cpu" or gpu_available():
            multiply(a, b, device=where)  # NumPy in: computed at once


def multiply_files(a: str | os.PathLike, b: str | os.PathLike, out: str | os.PathLike, *,
                   progress: Progress = None, **options: Any) -> dict[str, Any]:
    """``out = a * b`` (NumPy broadcasting) from two ``.npy`` files into a third, chunk by chunk.

    Options as :func:`multiply_job`, which checks the files; this runs the job it returns.
    """
    return multiply_job(a, b, out, **options)(progress)


def multiply_job(
    a: str | os.PathLike,
    b: str | os.PathLike,
    out: str | os.PathLike,
    *,
    device: str = "auto",
    chunk_size: str | int = "200MB",
    overwrite: bool = False,
    compression: str = "none",
    zarr_format: int = 3,
) -> Job:
    """Check the files of ``out = a * b`` now; return the job, to run as ``job(progress)``.

    Inputs and output are ``.npy`` files or Zarr stores (names ending in ``.zarr``; the
    output's ``compression`` and ``zarr_format`` as for :func:`dask_gpuchunk.to_zarr`).
    Raises :class:`InputError` or :class:`OutputError` where the files do not fit; the result
    is written through :func:`dask_gpuchunk.to_npy` or :func:`dask_gpuchunk.to_zarr` (never
    half-written).
    """
    ha, hb = _header(a, "input A"), _header(b, "input B")
    for h, what in ((ha, "input A"), (hb, "input B")):
        try:
            check_dtype(h.dtype.newbyteorder("=") if not h.dtype.isnative else h.dtype, what)
        except TypeError as exc:
            raise InputError(str(exc)) from None
    try:
        shape = np.broadcast_shapes(ha.shape, hb.shape)
    except ValueError:
        raise InputError(f"shapes {ha.shape} (A) and {hb.shape} (B) do not broadcast together") from None
    output = _output_options(out, compression, zarr_format)
    out_dtype = multiply.result_dtype(ha.dtype, hb.dtype)
    target = _check_output(out, [a, b], overwrite, npy_bytes(out_dtype, shape), output)
    # A product is memory-bound: device="auto" runs it on the CPU unless the inputs are
    # already pinned, so only device="gpu" reads them into page-locked memory.
    pinned = device == "gpu"
    x = _read(a, chunks=_row_chunks(ha, chunk_size), pinned=pinned)
    y = _read(b, chunks=_row_chunks(hb, chunk_size), pinned=pinned)
    # The graph is built when the job runs, where its cluster is known (the submitting process
    # may see no GPU where the workers do); its dtype now, from CPU-side rules.
    out_dtype = multiply.result_dtype(x.dtype, y.dtype)
    moved = ha.nbytes + hb.nbytes + int(np.prod(shape, dtype=np.int64)) * out_dtype.itemsize
    result = None

    def run(progress: Progress) -> dict[str, Any]:
        nonlocal result
        check_gpus_where_it_runs("", device)
        result = multiply(x, y, device=device)
        seconds = _run(
            lambda: _write(result, target, overwrite, progress, output),
            lambda: _start_warmup(_warm_multiply, ha.shape, _native_str(ha.dtype), hb.shape,
                                  _native_str(hb.dtype), device),
        )
        return _multiply_summary(seconds)

    def _multiply_summary(seconds: float) -> dict[str, Any]:
        return {
        "command": "multiply",
        "inputs": [{"path": str(a), "shape": list(ha.shape), "dtype": str(ha.dtype)},
                   {"path": str(b), "shape": list(hb.shape), "dtype": str(hb.dtype)}],
        "output": {"path": str(target), "shape": list(shape), "dtype": str(out_dtype)},
        "chunks": int(np.prod(result.numblocks)),
        "device": device,
        "seconds": seconds,
        "bytes_moved": moved,
        "gb_per_s": moved / seconds / 1e9 if seconds else None,
        }

    return run
