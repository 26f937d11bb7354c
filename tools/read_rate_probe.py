"""How fast this disk gives back two cold 4 GB .npy files, read in different ways (GPU machine).

    python tools/read_rate_probe.py --dir /tmp/rp [--gb 4] [--region-mb 200] [--out file.json]

Every variant reads the same bytes (two files of ``--gb`` GB, float64 rows) starting from a clean
page cache (sync, drop caches). Variants: ``np.load`` of each file in turn (what NumPy's side of
the multiply comparison does); the multiply job's pattern (``preadv`` of one region of
``--region-mb`` into its own array, regions of both files taken in order, ``a_i`` then ``b_i``,
by a pool of T threads) for several T; the same with ``posix_fadvise(SEQUENTIAL)``; the same
with each region read in 8 MB pieces.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
from write_rate_probe import clean  # a sibling script: sync, then drop the page cache


def pooled_reads(regions: list[tuple[Path, int, int]], threads: int, advice: int | None,
                 piece: int | None) -> None:
    """Read every (path, offset, length) into a new array, ``threads`` at a time, in order."""
    todo: queue.Queue = queue.Queue()
    for r in regions:
        todo.put(r)

    def worker() -> None:
        while True:
            try:
                path, offset, length = todo.get_nowait()
            except queue.Empty:
                return
            out = np.empty(length, dtype=np.uint8)
            fd = os.open(path, os.O_RDONLY)
            try:
                if advice is not None:
                    os.posix_fadvise(fd, offset, length, advice)
                view = memoryview(out)
                step = piece or length
                for start in range(0, length, step):
                    got = os.preadv(fd, [view[start:start + step]], offset + start)
                    assert got == min(step, length - start)
            finally:
                os.close(fd)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/read-probe"))
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--region-mb", type=float, default=200.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = int(args.gb * 1e9 / (500 * 8))
    paths = [args.dir / "a.npy", args.dir / "b.npy"]
    rng = np.random.default_rng(0)
    for p in paths:
        np.save(p, rng.random((rows, 500)))
    offset = np.load(paths[0], mmap_mode="r").offset  # where the data starts, after the header
    nbytes = rows * 500 * 8
    region = int(args.region_mb * 1e6) // 4000 * 4000
    regions = []
    for start in range(0, nbytes, region):
        for p in paths:
            regions.append((p, offset + start, min(region, nbytes - start)))
    variants = {"np.load, one file after the other": lambda: [np.load(p) for p in paths]}
    for threads in (16, 8, 4, 2, 1):
        variants[f"regions, {threads} threads"] = (
            lambda t=threads: pooled_reads(regions, t, None, None))
    variants["regions, 16 threads, fadvise SEQUENTIAL"] = lambda: pooled_reads(
        regions, 16, os.POSIX_FADV_SEQUENTIAL, None)
    variants["regions, 16 threads, 8 MB pieces"] = lambda: pooled_reads(regions, 16, None, 8 << 20)
    variants["regions, 4 threads, 8 MB pieces"] = lambda: pooled_reads(regions, 4, None, 8 << 20)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            clean()
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
            print(f"{name:45s} {seconds[name][-1]:6.2f} s  "
                  f"{2 * nbytes / seconds[name][-1] / 1e9:5.2f} GB/s", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"bytes": 2 * nbytes, "region_bytes": region,
                                        "seconds": seconds}, indent=1))
    for p in paths:
        p.unlink()


if __name__ == "__main__":
    main()
