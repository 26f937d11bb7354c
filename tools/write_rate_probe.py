"""How fast this disk takes 40 GB written in different ways (run on the GPU machine).

    python tools/write_rate_probe.py --dir /tmp/wp [--gb 40] [--slab-gb 1.6] [--out file.json]

Every variant writes the same bytes into a new file, starting with a clean page cache and no
dirty pages (sync, drop caches), timed until the last write call returns (as np.save and the
jobs are timed); the file is then deleted before any writeback of it matters. Variants: NumPy's
np.save of one array; os.write of one slab buffer again and again (append); the jobs' pattern
(header, file extended to full size, one pwrite per slab at its offset) from a pageable and
from a page-locked slab; the same from two threads; pwrite without the extension; pwrite with
``posix_fadvise(DONTNEED)`` after each slab; pwrite from as many distinct buffers as slabs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np


def clean() -> None:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/write-probe"))
    parser.add_argument("--gb", type=float, default=40.0)
    parser.add_argument("--slab-gb", type=float, default=1.6)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only the variants whose name contains one of these")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    slab_bytes = int(args.slab_gb * 1e9) // 4096 * 4096
    slabs = int(args.gb * 1e9) // slab_bytes
    total = slabs * slab_bytes
    pageable = np.full(slab_bytes, 7, dtype=np.uint8)
    try:
        import cupyx

        pinned = cupyx.empty_pinned(slab_bytes, dtype=np.uint8)
        pinned[...] = 7
    except Exception:  # noqa: BLE001 - no CuPy here: the pinned variants are skipped
        pinned = None
    path = args.dir / "probe.npy"  # np.save would add the suffix

    def np_save() -> float:
        whole = np.full(total // 4, 7, dtype=np.int32)
        clean()
        t0 = time.perf_counter()
        np.save(path, whole)
        return time.perf_counter() - t0

    def append(buf: np.ndarray) -> float:
        clean()
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            for _ in range(slabs):
                f.write(memoryview(buf))
        return time.perf_counter() - t0

    def pwrite(buf: np.ndarray | list[np.ndarray], extend: bool, threads: int = 1,
               fadvise: bool = False) -> float:
        clean()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if extend:
            os.ftruncate(fd, total)
        views = [memoryview(b) for b in buf] if isinstance(buf, list) else [memoryview(buf)]

        def writer(first: int) -> None:
            for s in range(first, slabs, threads):
                view, done = views[s % len(views)], 0
                while done < slab_bytes:
                    done += os.pwrite(fd, view[done:], s * slab_bytes + done)
                if fadvise:  # start this slab's writeback now, and let its pages go once clean
                    os.posix_fadvise(fd, s * slab_bytes, slab_bytes, os.POSIX_FADV_DONTNEED)

        pool = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        os.close(fd)
        return time.perf_counter() - t0

    variants = {
        "np.save of one array": np_save,
        "append, pageable slab": lambda: append(pageable),
        "pwrite per slab into extended file, pageable": lambda: pwrite(pageable, True),
        "pwrite per slab into extended file, pinned": lambda: pwrite(pinned, True),
        "pwrite per slab, not extended, pinned": lambda: pwrite(pinned, False),
        "pwrite, 2 threads, extended, pinned": lambda: pwrite(pinned, True, 2),
        "pwrite per slab + fadvise DONTNEED, pageable": lambda: pwrite(pageable, True,
                                                                      fadvise=True),
        "pwrite per slab from distinct buffers, pageable": lambda: pwrite(
            [np.full(slab_bytes, 7, dtype=np.uint8) for _ in range(slabs)], True),
    }
    results: dict[str, list[float]] = {}
    for round_ in range(2):
        for name, fn in variants.items():
            if ("pinned" in name and pinned is None) or (
                    args.only and not any(o in name for o in args.only)):
                continue
            seconds = fn()
            path.unlink()
            results.setdefault(name, []).append(seconds)
            print(f"round {round_}: {name}: {seconds:.2f} s = {total / seconds / 1e9:.2f} GB/s",
                  flush=True)
    if args.out:
        args.out.write_text(json.dumps({"bytes": total, "slab_bytes": slab_bytes,
                                        "seconds": results}, indent=1))


if __name__ == "__main__":
    main()
