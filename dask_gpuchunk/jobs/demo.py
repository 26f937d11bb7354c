"""The demo job: a small product and Gram through the same jobs, checked against NumPy.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..io import to_npy
from .common import JobError, Progress
from .gram import gram_files
from .multiply import multiply_files

__all__ = ["demo"]

def demo(
    *,
    rows: int = 500_000,
    cols: int = 50,
    bit_rows: int = 4000,
    bits: int = 20_000,
    workdir: str | os.PathLike | None = None,
    device: str = "auto",
    progress: Progress = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The main job on an embedded default: synthetic inputs, multiply and gram through files.

    Writes two float64 ``(rows, cols)`` inputs and a 0/1 ``(bit_rows, bits)`` matrix with
    :func:`dask_gpuchunk.to_npy` (generated chunk by chunk), runs :func:`multiply_files` and
    :func:`gram_files` on the current scheduler, checks sampled rows of both outputs against
    NumPy, and returns both summaries. Files go to ``workdir`` (default: a temporary directory,
    removed at the end).
    """
    import dask.array as da

    with tempfile.TemporaryDirectory(prefix="dask-gpuchunk-demo-") as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        a_path, b_path, c_path = work / "a.npy", work / "b.npy", work / "c.npy"
        bits_path, g_path = work / "bits.npy", work / "gram.npy"
        rng = da.random.default_rng(2026)
        chunk = max(1, (64 << 20) // (cols * 8))
        log(f"demo: writing inputs to {work} ...")
        t0 = time.perf_counter()
        to_npy(rng.random((rows, cols), chunks=(chunk, cols)), a_path, overwrite=True)
        to_npy(rng.random((rows, cols), chunks=(chunk, cols)), b_path, overwrite=True)
        to_npy((rng.random((bit_rows, bits), chunks=(1024, bits)) < 0.3).astype(np.uint8),
               bits_path, overwrite=True)
        t_inputs = time.perf_counter() - t0
        log("demo: multiply ...")
        mult = multiply_files(a_path, b_path, c_path, device=device, overwrite=True,
                              progress=progress)
        log("demo: gram ...")
        grm = gram_files(bits_path, g_path, device=device, chunk_rows=1024, overwrite=True,
                         progress=progress)
        sample = np.random.default_rng(0).choice(rows, size=min(rows, 64), replace=False)
        a, b, c = (np.load(p, mmap_mode="r") for p in (a_path, b_path, c_path))
        if not np.array_equal(c[sample], a[sample] * b[sample]):
            raise JobError("demo: multiply result differs from NumPy")
        bits_arr = np.load(bits_path, mmap_mode="r")
        g = np.load(g_path, mmap_mode="r")
        rows_g = np.random.default_rng(1).choice(bit_rows, size=min(bit_rows, 8), replace=False)
        full = np.asarray(bits_arr, dtype=np.float32)  # exact: sums stay below 2**24
        expected = (full[rows_g] @ full.T).astype(np.int32)
        if not np.array_equal(g[rows_g], expected):
            raise JobError("demo: gram result differs from NumPy")
        del a, b, c, bits_arr, g, full
    return {"command": "demo", "inputs_seconds": t_inputs, "multiply": mult, "gram": grm,
            "checked": {"multiply_rows": len(sample), "gram_rows": len(rows_g)},
            "files_kept": workdir is not None}
