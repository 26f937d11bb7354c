"""How fast this disk takes 40 GB written in different ways (run on the GPU machine).

    python tools/write_rate_probe.py --dir /tmp/wp [--gb 40] [--slab-gb 1.6] [--out file.json]

Every variant writes the same bytes into a new file, starting with a clean page cache and no
dirty pages (sync, drop caches), timed until the last write call returns (as np.save and the
jobs are timed); the file is then deleted before any writeback of it matters. Variants: NumPy's
np.save of one array; os.write of one slab buffer again and again (append); the jobs' pattern
(header, file extended to full size, one pwrite per slab at its offset) from a pageable and
from a page-locked slab; the same from two threads; pwrite without the extension; pwrite with
``posix_fadvise(DONTNEED)`` after each slab; pwrite from as many distinct buffers as slabs.
The store variants write the same slabs (``--chunk-rows`` rows of int32 each) as the files of a
Zarr store would hold them: a file per square chunk (rows gathered by ``writev``, or copied
contiguous first), or a file per slab (one write, or ``writev`` in square-chunk order, as a
shard holding the slab's chunks would be laid out). ``--durable`` also times a ``sync`` after
each variant (the writeback the variant left behind).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    parser.add_argument("--chunk-rows", type=int, default=4096)
    parser.add_argument("--durable", action="store_true")
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

    rows = args.chunk_rows
    cols = slab_bytes // 4 // rows
    slab2d = pageable[:rows * cols * 4].view(np.int32).reshape(rows, cols)
    store = args.dir / "probe.zarr"
    iov_max = os.sysconf("SC_IOV_MAX")

    def write_pieces(file: Path, pieces: list[memoryview]) -> None:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for start in range(0, len(pieces), iov_max):
                group = pieces[start:start + iov_max]
                if os.writev(fd, group) != sum(p.nbytes for p in group):
                    raise OSError("short writev")
        finally:
            os.close(fd)

    def chunk_views(row_slab: np.ndarray) -> list[np.ndarray]:
        return [row_slab[:, c:c + rows] for c in range(0, cols, rows)]

    def store_files(per: str, how: str) -> float:
        clean()
        t0 = time.perf_counter()
        for s in range(slabs):
            folder = store / "c" / str(s)
            folder.mkdir(parents=True, exist_ok=True)
            if per == "chunk":
                for c, chunk in enumerate(chunk_views(slab2d)):
                    if how == "writev":
                        pieces = [memoryview(r).cast("B") for r in chunk]
                    else:
                        pieces = [memoryview(np.ascontiguousarray(chunk)).cast("B")]
                    write_pieces(folder / str(c), pieces)
            elif how == "write":
                write_pieces(folder / "0", [memoryview(slab2d.reshape(-1)).cast("B")])
            else:  # shard order: each square chunk's rows in turn
                write_pieces(folder / "0", [memoryview(r).cast("B") for chunk in
                                            chunk_views(slab2d) for r in chunk])
        return time.perf_counter() - t0

    variants = {
        "store: file per square chunk, writev of its rows": lambda: store_files("chunk", "writev"),
        "store: file per square chunk, copied contiguous": lambda: store_files("chunk", "copy"),
        "store: file per slab, one write": lambda: store_files("slab", "write"),
        "store: file per slab, writev in chunk order": lambda: store_files("slab", "writev"),
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
            synced = 0.0
            if args.durable:
                t0 = time.perf_counter()
                os.sync()
                synced = time.perf_counter() - t0
            shutil.rmtree(store) if store.exists() else path.unlink()
            results.setdefault(name, []).append(seconds)
            if args.durable:
                results.setdefault(name + " (sync after)", []).append(synced)
            print(f"round {round_}: {name}: {seconds:.2f} s = {total / seconds / 1e9:.2f} GB/s"
                  f" (then sync {synced:.2f} s)", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"bytes": total, "slab_bytes": slab_bytes,
                                        "seconds": results}, indent=1))


if __name__ == "__main__":
    main()
