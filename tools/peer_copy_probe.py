"""How fast the GPUs of a node hand each other chunks through CUDA IPC, beside each process
staging every chunk from host memory itself: what sharing a Gram's words between the workers
of a node could save.

    python tools/peer_copy_probe.py [--chunks 16] [--mb 128] [--out peer.json]

One process per GPU (``CUDA_VISIBLE_DEVICES`` rotated as dask-cuda's workers have it). Each
makes its share of ``--chunks`` chunks of ``--mb`` MiB on its GPU (chunk ``i`` on process
``i % gpus``), takes their IPC handles, and then, all processes at once:

* ``peer``: copies every other process's chunks to its own GPU (open the handle, one copy,
  close), checked by a checksum taken where each chunk was made;
* ``host``: copies every chunk from a pinned host buffer, as each worker stages all the words
  itself today;
* ``opens_on_threads``: every other process's handle opened, then closed, on 1, 2 and 4
  threads at once: whether the driver opens handles side by side.

Also checked: a handle opened twice in one process (CUDA counts the opens), and a chunk
whose memory went back to CuPy's pool and was written again before it was opened (its checksum
must no longer match). Needs two or more GPUs for the cross-GPU figures; on one it runs the
processes on the same GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

_MEMCPY_DEFAULT = 4


def _base_of(ptr: int) -> int:
    lib = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                            ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
    if rc:
        raise RuntimeError(f"cuMemGetAddressRange: {rc}")
    return base.value


def _checksum(chunk: Any) -> int:
    import cupy

    return int(chunk.view(cupy.uint64).sum(dtype=cupy.uint64))


def _worker(rank: int, gpus: int, devices: int, chunks: int, mb: int, tickets: Any,
            barrier: Any, results: Any) -> None:
    order = [(rank + i) % devices for i in range(devices)]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, order))
    import cupy

    runtime = cupy.cuda.runtime
    words = mb << 20
    mine = {}
    for i in range(rank, chunks, max(gpus, 1)):
        rng = cupy.random.default_rng(i)
        chunk = rng.integers(0, 2**63, size=words // 8, dtype=cupy.int64).view(cupy.uint64)
        base = _base_of(chunk.data.ptr)
        tickets[i] = (rank, runtime.ipcGetMemHandle(base), chunk.data.ptr - base,
                      _checksum(chunk))
        mine[i] = chunk
    runtime.deviceSynchronize()
    barrier.wait()
    report: dict[str, Any] = {"rank": rank, "pci": runtime.getDeviceProperties(0)["pciBusID"]}
    stream = cupy.cuda.Stream(non_blocking=True)
    out = cupy.empty(words // 8, cupy.uint64)
    wrong = 0
    parts = {"open": 0.0, "copy": 0.0, "close": 0.0}
    t0 = time.perf_counter()
    moved = 0
    for i in range(chunks):
        owner, handle, offset, checksum = tickets[i]
        if owner == rank:
            continue
        t = time.perf_counter()
        ptr = runtime.ipcOpenMemHandle(handle)
        parts["open"] += time.perf_counter() - t
        t = time.perf_counter()
        runtime.memcpyAsync(out.data.ptr, ptr + offset, words, _MEMCPY_DEFAULT, stream.ptr)
        stream.synchronize()
        parts["copy"] += time.perf_counter() - t
        t = time.perf_counter()
        runtime.ipcCloseMemHandle(ptr)
        parts["close"] += time.perf_counter() - t
        wrong += _checksum(out) != checksum
        moved += words
    seconds = time.perf_counter() - t0
    report["peer"] = {"bytes": moved, "seconds": round(seconds, 4),
                      "gb_per_s": round(moved / seconds / 1e9, 1) if seconds else None,
                      "checksums_wrong": wrong,
                      **{k: round(v, 4) for k, v in parts.items()}}
    # The handles opened and closed on several threads at once: whether the driver does
    # opens side by side (a read-ahead could then open more than one peer's chunk at a time).
    from concurrent.futures import ThreadPoolExecutor

    others = [tickets[i][1] for i in range(chunks) if tickets[i][0] != rank]
    report["opens_on_threads"] = {}
    for threads in (1, 2, 4):
        barrier.wait()
        with ThreadPoolExecutor(threads) as pool:
            t = time.perf_counter()
            pointers = list(pool.map(runtime.ipcOpenMemHandle, others))
            opened_s = time.perf_counter() - t
            t = time.perf_counter()
            list(pool.map(runtime.ipcCloseMemHandle, pointers))
            closed_s = time.perf_counter() - t
        report["opens_on_threads"][threads] = {
            "handles": len(others), "open_s": round(opened_s, 4), "close_s": round(closed_s, 4)}
    barrier.wait()
    # Again with every handle opened first and peer access enabled by hand: the copies alone.
    for device in range(1, devices):
        if runtime.deviceCanAccessPeer(0, device):
            try:
                runtime.deviceEnablePeerAccess(device)
            except runtime.CUDARuntimeError as error:
                report.setdefault("enable_peer_errors", []).append(repr(error))
    opened = {i: runtime.ipcOpenMemHandle(tickets[i][1]) for i in range(chunks)
              if tickets[i][0] != rank}
    barrier.wait()
    t0 = time.perf_counter()
    for i, ptr in opened.items():
        runtime.memcpyAsync(out.data.ptr, ptr + tickets[i][2], words, _MEMCPY_DEFAULT, stream.ptr)
    stream.synchronize()
    seconds = time.perf_counter() - t0
    report["peer_copies_only"] = {"seconds": round(seconds, 4),
                                  "gb_per_s": round(len(opened) * words / seconds / 1e9, 1)}
    t0 = time.perf_counter()
    for i, ptr in opened.items():
        owner = tickets[i][0]
        runtime.memcpyPeerAsync(out.data.ptr, 0, ptr + tickets[i][2], (owner - rank) % devices,
                                words, stream.ptr)
    stream.synchronize()
    seconds = time.perf_counter() - t0
    report["memcpy_peer"] = {"seconds": round(seconds, 4),
                             "gb_per_s": round(len(opened) * words / seconds / 1e9, 1)}
    for ptr in opened.values():
        runtime.ipcCloseMemHandle(ptr)
    barrier.wait()
    pinned = cupy.cuda.alloc_pinned_memory(words)
    t0 = time.perf_counter()
    for _ in range(chunks):
        runtime.memcpyAsync(out.data.ptr, pinned.ptr, words, 1, stream.ptr)
    stream.synchronize()
    seconds = time.perf_counter() - t0
    report["host"] = {"bytes": chunks * words, "seconds": round(seconds, 4),
                      "gb_per_s": round(chunks * words / seconds / 1e9, 1)}
    barrier.wait()
    # A handle opened twice in one process; then a chunk whose memory was freed to the pool
    # and written again before another process opened it.
    other = next((i for i in range(chunks) if tickets[i][0] != rank), None)
    if other is not None:
        owner, handle, offset, checksum = tickets[other]
        first = runtime.ipcOpenMemHandle(handle)
        second = runtime.ipcOpenMemHandle(handle)
        report["opened_twice_same_pointer"] = first == second
        runtime.ipcCloseMemHandle(second)
        runtime.ipcCloseMemHandle(first)
    barrier.wait()
    if rank == 0:
        for i in list(mine):
            ptr = mine[i].data.ptr
            del mine[i]
            again = cupy.zeros(words // 8, cupy.uint64)
            report["reused_same_address"] = again.data.ptr == ptr
            mine[i] = again
            break
    runtime.deviceSynchronize()
    barrier.wait()
    if rank != 0:
        owner, handle, offset, checksum = tickets[0]
        try:
            ptr = runtime.ipcOpenMemHandle(handle)
            runtime.memcpyAsync(out.data.ptr, ptr + offset, words, _MEMCPY_DEFAULT, stream.ptr)
            stream.synchronize()
            runtime.ipcCloseMemHandle(ptr)
            report["stale_checksum_matches"] = _checksum(out) == checksum
        except Exception as error:  # noqa: BLE001 - what a stale handle does is the figure
            report["stale_open_error"] = repr(error)
    barrier.wait()
    results.put(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--gpus", type=int, default=0, help="processes (0: every GPU)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    gpus = args.gpus
    if not gpus:
        import subprocess

        gpus = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                  check=True).stdout.strip().splitlines())
    devices, gpus = gpus, max(gpus, 2)
    context = mp.get_context("spawn")
    with context.Manager() as manager:
        tickets, barrier, results = manager.dict(), context.Barrier(gpus), context.Queue()
        processes = [context.Process(target=_worker, args=(rank, gpus, devices, args.chunks, args.mb,
                                                           tickets, barrier, results))
                     for rank in range(gpus)]
        for process in processes:
            process.start()
        reports = sorted((results.get(timeout=300) for _ in processes), key=lambda r: r["rank"])
        for process in processes:
            process.join()
    for report in reports:
        print(json.dumps(report), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"chunks": args.chunks, "mb": args.mb, "processes": gpus,
                                        "reports": reports}, indent=1))


if __name__ == "__main__":
    main()
