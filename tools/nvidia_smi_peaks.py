"""Peak GPU memory sampled from nvidia-smi, for the figure tools (``python tools/...``)."""

from __future__ import annotations

import subprocess
import threading


class NvidiaSmiPeaks:
    """Peak memory (MiB) per key, from ``nvidia-smi --query-<what>=<key>,used_memory`` every
    0.2 s while the ``with`` block runs: ``NvidiaSmiPeaks("gpu", "index", "memory.used")`` per
    GPU, ``NvidiaSmiPeaks("compute-apps", "pid", "used_memory")`` per process."""

    def __init__(self, what: str, key: str, used: str) -> None:
        self.query = f"--query-{what}={key},{used}"
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", self.query, "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, check=False).stdout
            for line in out.strip().splitlines():
                try:
                    key, used = (int(v) for v in line.split(","))
                except ValueError:  # "[N/A]" or a header where a process has just gone
                    continue
                self.peak[key] = max(self.peak.get(key, 0), used)
            self._stop.wait(0.2)

    def __enter__(self) -> NvidiaSmiPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
