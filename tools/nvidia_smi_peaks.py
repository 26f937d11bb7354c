"""Peak GPU memory sampled from nvidia-smi, for the figure tools (``python tools/...``)."""

from __future__ import annotations

import threading

from dask_gpuchunk.process_memory import nvidia_smi_table


class NvidiaSmiPeaks:
    """Peak memory (MiB) per key, from ``nvidia-smi --query-<what>=<key>,used_memory`` every
    0.2 s while the ``with`` block runs: ``NvidiaSmiPeaks("gpu", "index", "memory.used")`` per
    GPU, ``NvidiaSmiPeaks("compute-apps", "pid", "used_memory")`` per process."""

    def __init__(self, what: str, key: str, used: str) -> None:
        self.query = f"{what}={key},{used}"
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, used in nvidia_smi_table(self.query).items():
                self.peak[key] = max(self.peak.get(key, 0), used)
            self._stop.wait(0.2)

    def __enter__(self) -> NvidiaSmiPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
