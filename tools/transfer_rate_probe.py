"""How fast two workers of a local cluster move a chunk between them, over TLS (the default of
``dg.local_cluster``) and without it.

    python tools/transfer_rate_probe.py [--mb 512] [--out rates.json]

Two CPU workers of one thread each (no GPU needed): an array of ``--mb`` megabytes is made on the
first, then a task on the second reads it, so distributed sends it over the cluster's comm; timed
``--repeat`` times per setting (the first includes opening the connection between the workers). What a multi-GPU Gram pays for each word chunk one worker sends another.

The ``if __name__ == "__main__"`` guard matters: a local cluster's workers are spawned
processes that import this file again.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from distributed import wait

import dask_gpuchunk as dg


def _first(block: np.ndarray) -> float:
    return float(block[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {}
    for secure in (True, False):
        with dg.local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=None,
                              secure=secure) as client:
            a, b = sorted(client.scheduler_info()["workers"])
            label = "tls" if secure else "tcp"
            rates[label] = []
            for _ in range(args.repeat):
                x = client.submit(np.ones, args.mb * 1_000_000 // 8, workers=[a], pure=False)
                wait(x)
                t0 = time.perf_counter()
                client.submit(_first, x, workers=[b], pure=False).result()
                seconds = time.perf_counter() - t0
                rates[label].append(args.mb / 1000 / seconds)
                print(f"{label}: {args.mb} MB moved in {seconds:.2f} s = "
                      f"{rates[label][-1]:.2f} GB/s", flush=True)
                del x
    if args.out:
        args.out.write_text(json.dumps({"mb": args.mb, "gb_per_s": rates}, indent=1))


if __name__ == "__main__":
    main()
