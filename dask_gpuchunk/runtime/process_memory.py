"""Device memory this process holds, as the driver counts it, and its high-water mark.

CuPy's pool sees only what it allocated (:func:`dask_gpuchunk.runtime.budget.peak_bytes`); the
driver also counts the CUDA context, loaded kernel modules, cuBLAS workspaces and anything allocated
outside the pool (numba's allocator, for one). :func:`watch` starts a background thread that reads
this process's figure every ``interval`` seconds, through NVML (``pynvml``, which dask-cuda
installs) or, where that is missing, ``nvidia-smi``; :func:`peak_bytes` is the highest reading.

Where the driver lists processes under other process ids than this one sees (a container with
its own PID namespace), or neither NVML nor ``nvidia-smi`` is present, the figure is ``None``:
it is reported where available and never guessed.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import threading
import time
from typing import Any

__all__ = ["nvidia_smi_table", "peak_bytes", "reset_peak", "used_bytes", "watch"]


def _nvml_used(pid: int) -> int | None:
    import pynvml  # initialised by _reader

    total, seen = 0, False
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == pid and p.usedGpuMemory is not None:
                total, seen = total + int(p.usedGpuMemory), True
    return total if seen else None


def nvidia_smi_table(query: str) -> dict[int, int]:
    """``nvidia-smi --query-<query> --format=csv,noheader,nounits`` for a query of two integer
    fields, a key and a figure (``"compute-apps=pid,used_memory"``,
    ``"gpu=index,memory.used"``): ``{key: figure}``, figures of a repeated key added (a process
    on several GPUs), rows where the driver does not say (``[N/A]``) left out; empty where
    there is no ``nvidia-smi``.

    Examples
    --------
    >>> table = nvidia_smi_table("gpu=index,memory.used")  # {GPU index: MiB in use}
    >>> all(isinstance(k, int) and v >= 0 for k, v in table.items())
    True
    """
    try:
        out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=False, timeout=10).stdout
    except FileNotFoundError:
        return {}
    table: dict[int, int] = {}
    for line in out.strip().splitlines():
        try:
            key, figure = (int(v) for v in line.split(","))
        except ValueError:  # "[N/A]", or a process that has just gone
            continue
        table[key] = table.get(key, 0) + figure
    return table


def _nvidia_smi_used(pid: int) -> int | None:
    mib = nvidia_smi_table("compute-apps=pid,used_memory").get(pid)
    return None if mib is None else mib * 2**20


@functools.cache
def _reader() -> tuple[Any, float] | None:
    """The way to read a process's device memory here and how often to sample with it (found
    once per process)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return _nvml_used, 0.1
    except Exception:  # no pynvml, or no driver behind it
        pass
    if shutil.which("nvidia-smi"):
        # A process per reading (~30 ms of CPU): sampled less often than through NVML.
        return _nvidia_smi_used, 0.5
    return None


def used_bytes(pid: int | None = None) -> int | None:
    """Device memory (bytes, every GPU together) that the driver counts for process ``pid``
    (this one by default) now; ``None`` where it cannot be read."""
    reader = _reader()
    if reader is None:
        return None
    try:
        return reader[0](os.getpid() if pid is None else pid)
    except Exception:  # a driver or tool that fails to answer: not available
        return None


class _Watcher:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.peak: int | None = None


_WATCHER = _Watcher()


def _sample(read: Any, interval: float) -> None:
    pid = os.getpid()
    while True:
        try:
            used = read(pid)
        except Exception:  # the driver went away (shutting down): stop quietly
            return
        if used is not None:
            with _WATCHER.lock:
                _WATCHER.peak = max(_WATCHER.peak or 0, used)
        time.sleep(interval)


def watch() -> bool:
    """Start sampling this process's device memory in a daemon thread (once per process;
    later calls do nothing). Returns whether it can be read here.

    Examples
    --------
    >>> watch() in (True, False)
    True
    """
    with _WATCHER.lock:
        if _WATCHER.thread is not None:
            return True
        reader = _reader()
        if reader is None:
            return False
        _WATCHER.thread = threading.Thread(target=_sample, args=reader, daemon=True,
                                           name="dask_gpuchunk device memory")
        _WATCHER.thread.start()
        return True


def peak_bytes() -> int | None:
    """The highest device memory the driver counted for this process since :func:`watch` (or
    :func:`reset_peak`); ``None`` where nothing could be read.

    Examples
    --------
    >>> reset_peak()
    >>> peak_bytes() is None or peak_bytes() >= 0
    True
    """
    with _WATCHER.lock:
        peak = _WATCHER.peak
    if _WATCHER.thread is not None:
        now = used_bytes()  # the reading at this moment counts too
        if now is not None:
            with _WATCHER.lock:
                _WATCHER.peak = peak = max(_WATCHER.peak or 0, now)
    return peak


def reset_peak() -> None:
    """Forget the high-water mark (the sampler goes on)."""
    with _WATCHER.lock:
        _WATCHER.peak = None
