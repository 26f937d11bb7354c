"""Gram on 1 GPU and on every GPU of this node, from a .npy of packed bits: the scaling figure.

Usage (on a machine with 2 or more GPUs):
    python tools/gram_scaling.py --rows 65536 --bits 1048576 --out $OUT/gram-scaling.json

The input is written once (packed random bits); then, on a fresh ``dg.local_cluster`` with
1 GPU and with all of them, ``dg.gram(dg.from_npy(...), packed=True)`` is reduced to its sum on
the workers (so the figure is the computation, not the output's transfer or a disk) and to a
few sampled rows, checked against NumPy. Timed twice per cluster (the first run compiles).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import dask_gpuchunk as dg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--bits", type=int, default=1 << 20)
    parser.add_argument("--chunk-rows", type=int, default=4096)
    parser.add_argument("--method", default="auto")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gram-scaling"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.workdir / "bits.npy"
    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, size=(args.rows, args.bits // 8), dtype=np.uint8)
    np.save(path, packed)
    sample = np.sort(rng.choice(args.rows, 4, replace=False))
    words = packed.view(np.uint8)
    expected_rows = np.stack([np.bitwise_count(words & words[r]).sum(axis=1, dtype=np.int64)
                              for r in sample]).astype(np.int32)
    result: dict = {"rows": args.rows, "bits": args.bits, "chunk_rows": args.chunk_rows,
                    "method": args.method, "gpus_visible": dg.gpu_count(), "runs": {}}
    for gpus in sorted({1, dg.gpu_count()}):
        with dg.local_cluster(gpus=gpus, dashboard_address=None,
                              threads_per_gpu="cores") as client:
            times = []
            for _ in range(2):
                g = dg.gram(dg.from_npy(path, chunks=(args.chunk_rows, -1)), packed=True,
                            method=args.method)
                t0 = time.perf_counter()
                _total, rows = client.compute([g.sum(dtype=np.int64), g[sample]], sync=True)
                times.append(time.perf_counter() - t0)
            exact = bool(np.array_equal(np.asarray(rows), expected_rows))
            result["runs"][gpus] = {"seconds": times, "best": min(times), "sampled_rows_exact": exact,
                                    "bit_macs_per_s": float(args.rows) ** 2 * args.bits / min(times),
                                    "workers": len(client.scheduler_info()["workers"])}
            print(json.dumps({gpus: result["runs"][gpus]}), flush=True)
    if len(result["runs"]) > 1:
        one, all_ = result["runs"][1]["best"], result["runs"][max(result["runs"])]["best"]
        result["speedup"] = one / all_
        print(f"speed-up on {max(result['runs'])} GPUs: {one / all_:.2f} x", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    path.unlink()


if __name__ == "__main__":
    main()
