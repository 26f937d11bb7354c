"""Three ways to move a .npy's row chunks from the page cache to a GPU, timed per chunk (GPU
machine): what the package does now and two that skip its host copy.

    python tools/staging_path_probe.py --rows 65536 --bits 262144 --chunk-rows 4096 \\
        [--processes 1,4] [--out file.json]

``read``: the package's reader (``preadv`` into a pinned buffer, 16 MiB pieces on
``gpuchunk.file-read-threads`` threads), then ``cupy.asarray`` of it. ``register``: the chunk's
bytes mapped (``mmap``, read-only) and page-locked where they lie (``cudaHostRegister`` with
``cudaHostRegisterReadOnly``), one H2D copy straight out of the page cache, then unlocked and
unmapped. ``pageable``: ``cupy.asarray`` of the mapped bytes (the driver stages them itself).
Each process of ``--processes N`` moves every chunk to GPU ``i % gpus``, as N GPU workers each
reading all the words do; the file is read once first, so the page cache holds it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import time
from pathlib import Path

import numpy as np

READ_ONLY = 8  # cudaHostRegisterReadOnly
READ_ONLY_SUPPORTED = 113  # cudaDevAttrHostRegisterReadOnlySupported


def _mapped(fd: int, offset: int, length: int) -> tuple[mmap.mmap, np.ndarray]:
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, length + offset - start, prot=mmap.PROT_READ, offset=start)
    return mm, np.frombuffer(mm, np.uint8)[offset - start:]


def _one_process(args: tuple, barrier: object, results: object) -> None:
    try:
        results.put(_moved(args, barrier))
    except Exception as e:  # noqa: BLE001 - a way the machine refuses, reported
        barrier.abort()
        results.put({"error": f"{type(e).__name__}: {e}"})


def _moved(args: tuple, barrier: object) -> dict:
    path, index, gpus, chunk_rows, way = args
    import cupy

    from dask_gpuchunk.io import from_npy, npy_reader_of, read_header

    cupy.cuda.Device(index % gpus).use()
    header = read_header(path)
    rows, row_bytes = header.shape[0], header.nbytes // header.shape[0]
    reader = npy_reader_of(from_npy(path, chunks=(chunk_rows, -1)))
    stream = cupy.cuda.Stream(non_blocking=True)
    fd = os.open(path, os.O_RDONLY)
    seconds = []
    supported = cupy.cuda.runtime.deviceGetAttribute(READ_ONLY_SUPPORTED, index % gpus)
    kept = []
    cupy.empty(1).sum()  # the context and the pool made before the clock starts
    barrier.wait(60)
    began = time.time()
    try:
        for start in range(0, rows, chunk_rows):
            stop = min(start + chunk_rows, rows)
            t0 = time.perf_counter()
            with stream:
                if way == "read":
                    kept.append(cupy.asarray(reader[slice(start, stop), :]))
                else:
                    mm, view = _mapped(fd, header.offset + start * row_bytes,
                                       (stop - start) * row_bytes)
                    out = cupy.empty(view.nbytes, np.uint8)
                    if way == "register":
                        cupy.cuda.runtime.hostRegister(view.ctypes.data, view.nbytes, READ_ONLY)
                        cupy.cuda.runtime.memcpyAsync(out.data.ptr, view.ctypes.data, view.nbytes,
                                                      1, stream.ptr)
                        stream.synchronize()
                        cupy.cuda.runtime.hostUnregister(view.ctypes.data)
                    else:
                        out.set(view, stream=stream)
                    stream.synchronize()
                    del view
                    mm.close()
                    kept.append(out)
                stream.synchronize()
            seconds.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return {"seconds": sum(seconds), "slowest_chunk": max(seconds), "began": began,
            "ended": time.time(), "bytes": header.nbytes,
            "read_only_register_supported": supported}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--bits", type=int, default=262144)
    parser.add_argument("--chunk-rows", type=int, default=4096)
    parser.add_argument("--processes", default="1,4")
    parser.add_argument("--ways", default="read,register,pageable")
    parser.add_argument("--path", type=Path, default=Path("/tmp/staging-probe.npy"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not args.path.exists():
        words = np.lib.format.open_memmap(args.path, mode="w+", dtype=np.uint64,
                                          shape=(args.rows, args.bits // 64))
        rng = np.random.default_rng(5)
        for start in range(0, args.rows, 4096):
            words[start:start + 4096] = rng.integers(0, 2**63, words[start:start + 4096].shape,
                                                     dtype=np.uint64)
        words.flush()
        del words
    with open(args.path, "rb") as f:  # into the page cache
        while f.read(1 << 26):
            pass
    import cupy

    gpus = cupy.cuda.runtime.getDeviceCount()
    results = []
    ctx = multiprocessing.get_context("spawn")
    for n in (int(p) for p in args.processes.split(",")):
        for way in args.ways.split(","):
            for _ in range(2):  # the first warms; the second is kept
                barrier, queue = ctx.Barrier(n), ctx.Queue()
                procs = [ctx.Process(target=_one_process, args=(
                    (str(args.path), i, gpus, args.chunk_rows, way), barrier, queue))
                    for i in range(n)]
                for proc in procs:
                    proc.start()
                each = [queue.get(timeout=300) for _ in procs]
                for proc in procs:
                    proc.join()
            errors = [e["error"] for e in each if "error" in e]
            each = [e for e in each if "error" not in e]
            window = (max(e["ended"] for e in each) - min(e["began"] for e in each)
                      if each else None)
            total = sum(e["bytes"] for e in each)
            entry = {"processes": n, "way": way, "seconds_all": window,
                     "gb_per_s_all": round(total / window / 1e9, 2) if each else None,
                     "per_process_seconds": [round(e["seconds"], 3) for e in each],
                     "slowest_chunk": max((e["slowest_chunk"] for e in each), default=None),
                     "read_only_register_supported": each[0]["read_only_register_supported"]
                     if each else None, "errors": errors}
            results.append(entry)
            print(json.dumps(entry), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
