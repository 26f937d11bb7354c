"""What a page-locked host buffer costs to make, and how long the process's other CUDA calls
wait meanwhile: ``cudaHostAlloc`` (the package's pinned pool today) beside anonymous memory
filled by the kernel first and then registered with CUDA (``cudaHostRegister``).

    python tools/pinned_alloc_probe.py [--mib 128] [--count 4] [--processes 1,4] [--out f.json]

The 4-GPU Gram's warm runs stalled where a worker made a new 128 MiB pinned buffer: 45-67 ms
each, several in a row taking one after another, and the worker's copies to its GPU waiting
behind them (``docs/perf-notes.md``, stop 50). Registering memory the kernel has already
filled took ~29 GB/s on the H200 machine (``../shared/DESIGN.md``): ~4.5 ms for 128 MiB, if
the filling (``MAP_POPULATE``) holds no CUDA lock. Measured here, in each of ``--processes``
processes at once (one per GPU, as dask-cuda's workers), for each way:

* ``host-alloc``: ``cudaHostAlloc`` of ``--mib`` MiB, ``--count`` times in a row;
* ``register``: ``mmap`` with ``MAP_POPULATE`` (timed apart: no CUDA call), then
  ``cudaHostRegister`` (portable);
* ``register-unfilled``: ``mmap`` without populating, then ``cudaHostRegister``, which then
  faults every page in itself;
* ``register-huge``: ``mmap`` without populating, ``madvise(MADV_HUGEPAGE)`` (transparent huge
  pages), ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14; the fill, timed apart), then
  ``cudaHostRegister``; each ``madvise``'s errno is reported (0: taken).

Beside each, a thread copies 1 MiB from a pinned buffer to the GPU over and over and logs each
copy's time: its longest is how long the allocation held the process's CUDA calls back. Copies
of 5 ms or more are listed with when they began, beside when each buffer's steps began and
ended (ms after the first buffer was asked for), to tell which step held them. Each buffer is
then checked: a copy of it to the GPU and back must match what was written into it.

On 2 x H200 (``docs/perf-notes.md``, stop 51), 128 MiB: ``host-alloc`` 55-134 ms a buffer,
every copy waiting; ``register-huge`` 28-40 ms, CUDA held 3.3-6.2 ms, no copy waiting more
than 6 ms. The package's pinned pool makes its buffers the ``register-huge`` way
(:class:`dask_gpuchunk.staging.RegisteredMemory`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from typing import Any

from dask_gpuchunk.c_library import MADV_POPULATE_WRITE, advise, map_memory, unmap

WAYS = ("host-alloc", "register", "register-unfilled", "register-huge")
_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2


def _make(way: str, nbytes: int) -> tuple[Any, int, dict[str, Any]]:
    """A page-locked buffer made ``way``: its owner (``None``: an ``mmap``), address and each
    step's [start, end] in ``time.perf_counter`` seconds (and ``madvise``'s errnos)."""
    import cupy

    steps: dict[str, Any] = {}
    if way == "host-alloc":
        t0 = time.perf_counter()
        mem = cupy.cuda.PinnedMemory(nbytes)
        steps["cuda"] = [t0, time.perf_counter()]
        return mem, cupy.cuda.PinnedMemoryPointer(mem, 0).ptr, steps
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if way == "register":
        flags |= mmap.MAP_POPULATE
    t0 = time.perf_counter()
    address = map_memory(nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags)
    if way == "register-huge":
        steps["errno_hugepage"] = advise(address, nbytes, mmap.MADV_HUGEPAGE)
        steps["errno_populate"] = advise(address, nbytes, MADV_POPULATE_WRITE)
    steps["fill"] = [t0, time.perf_counter()]
    t0 = time.perf_counter()
    cupy.cuda.runtime.hostRegister(address, nbytes, 1)  # cudaHostRegisterPortable
    steps["cuda"] = [t0, time.perf_counter()]
    return None, address, steps


def _free(way: str, owner: Any, address: int, nbytes: int) -> None:
    import cupy

    if way != "host-alloc":
        cupy.cuda.runtime.hostUnregister(address)
        unmap(address, nbytes)


def _checked(address: int, nbytes: int) -> bool:
    """Written, sent to the GPU and back: the same bytes."""
    import cupy
    import numpy as np

    runtime = cupy.cuda.runtime
    view = np.frombuffer((ctypes.c_ubyte * nbytes).from_address(address), np.uint8)
    marks = np.arange(view[::4096].size, dtype=np.uint64).astype(np.uint8) + 1
    view[::4096] = marks
    on_device = cupy.empty(nbytes, np.uint8)
    runtime.memcpy(on_device.data.ptr, address, nbytes, _HOST_TO_DEVICE)
    view[::4096] = 0
    runtime.memcpy(address, on_device.data.ptr, nbytes, _DEVICE_TO_HOST)
    return bool(np.array_equal(view[::4096], marks))


def _process(rank: int, devices: int, mib: int, count: int, ways: list[str], barrier: Any,
             results: Any) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str((rank + i) % devices)
                                                  for i in range(devices))
    import cupy
    import numpy as np

    cupy.cuda.Device(0).use()
    nbytes = mib << 20
    probe = cupy.cuda.alloc_pinned_memory(1 << 20)
    target = cupy.empty(1 << 20, np.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    out: dict[str, Any] = {"rank": rank}
    for way in ways:
        copies: list[tuple[float, float]] = []
        done = threading.Event()

        def copy_over_and_over() -> None:
            cupy.cuda.Device(0).use()
            while not done.is_set():
                t0 = time.perf_counter()
                cupy.cuda.runtime.memcpyAsync(target.data.ptr, probe.ptr, 1 << 20,
                                              _HOST_TO_DEVICE, stream.ptr)
                stream.synchronize()
                copies.append((t0, time.perf_counter() - t0))

        barrier.wait()
        copier = threading.Thread(target=copy_over_and_over, daemon=True)
        copier.start()
        time.sleep(0.05)  # the copies' own pace first
        made, started = [], time.perf_counter()
        for _ in range(count):
            t0 = time.perf_counter()
            owner, address, steps = _make(way, nbytes)
            made.append((owner, address, {**steps, "total": [t0, time.perf_counter()]}))
        ended = time.perf_counter()
        time.sleep(0.05)
        done.set()
        copier.join()
        during = [s for t, s in copies if started <= t <= ended]
        before = sorted(s for t, s in copies if t < started)
        checked = all(_checked(address, nbytes) for _, address, _ in made)

        def ms(t: float) -> float:
            return round(1e3 * (t - started), 2)

        out[way] = {
            "ms_each": [{k: round(1e3 * (v[1] - v[0]), 2) if isinstance(v, list) else v
                         for k, v in steps.items()} for _, _, steps in made],
            "steps_at_ms": [{k: [ms(v[0]), ms(v[1])] for k, v in steps.items()
                             if isinstance(v, list)} for _, _, steps in made],
            "ms_all": round(1e3 * (ended - started), 2),
            "copy_ms_before_median": round(1e3 * before[len(before) // 2], 3) if before else None,
            "copy_ms_during_max": round(1e3 * max(during), 2) if during else None,
            "long_copies_at_ms": [[ms(t), round(1e3 * s, 2)] for t, s in copies
                                  if s >= 0.005 and started - 0.05 <= t <= ended],
            "copies_during": len(during), "checked": checked}
        for owner, address, _ in made:
            _free(way, owner, address, nbytes)
    results.put(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--processes", default="1,4",
                        help="process counts to run, comma-separated (one per GPU; more "
                             "processes than GPUs share them)")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    ways = args.ways.split(",")
    unknown = set(ways) - set(WAYS)
    if unknown:
        parser.error(f"--ways: {sorted(unknown)} not among {list(WAYS)}")
    import cupy

    devices = cupy.cuda.runtime.getDeviceCount()
    context = mp.get_context("spawn")
    report: dict[str, Any] = {"mib": args.mib, "count": args.count, "devices": devices,
                              "runs": {}}
    for n in (int(p) for p in args.processes.split(",")):
        barrier, results = context.Barrier(n), context.Queue()
        procs = [context.Process(target=_process,
                                 args=(r, devices, args.mib, args.count, ways, barrier, results))
                 for r in range(n)]
        for p in procs:
            p.start()
        outs = sorted((results.get(timeout=600) for _ in procs), key=lambda o: o["rank"])
        for p in procs:
            p.join()
        report["runs"][n] = outs
        for o in outs:
            print(json.dumps({"processes": n, **o}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
