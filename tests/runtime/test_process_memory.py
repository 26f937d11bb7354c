"""The device memory the driver counts for a process (dask_gpuchunk.runtime.process_memory)."""

from __future__ import annotations

import subprocess
import time
from types import SimpleNamespace

import pytest

from dask_gpuchunk.runtime import process_memory

MiB = 2**20


@pytest.fixture
def fresh_watcher(monkeypatch):
    """A watcher of its own, so a test's fake readings never reach the process's real one."""
    watcher = process_memory._Watcher()
    monkeypatch.setattr(process_memory, "_WATCHER", watcher)
    return watcher


def test_nvidia_smi_readings_are_summed_for_this_pid_only(monkeypatch):
    listing = "123, 100\n456, 7\n123, 20\n789, [N/A]\n"
    monkeypatch.setattr(subprocess, "run",
                        lambda *a, **k: SimpleNamespace(stdout=listing, returncode=0))
    assert process_memory._nvidia_smi_used(123) == 120 * MiB
    assert process_memory._nvidia_smi_used(456) == 7 * MiB
    # A process the driver does not list (another PID namespace): unknown, not zero.
    assert process_memory._nvidia_smi_used(789) is None
    assert process_memory._nvidia_smi_used(1) is None


def test_watch_keeps_the_highest_reading_until_reset(monkeypatch, fresh_watcher):
    readings = iter([5 * MiB, 40 * MiB, 10 * MiB])
    done = []

    def read(pid):
        try:
            return next(readings)
        except StopIteration:
            done.append(True)
            raise RuntimeError("driver gone") from None  # ends the sampler

    monkeypatch.setattr(process_memory, "_reader", lambda: (read, 0.001))
    assert process_memory.watch()
    assert process_memory.watch()  # once per process
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    fresh_watcher.thread.join(timeout=10)
    monkeypatch.setattr(process_memory, "_reader", lambda: (lambda pid: 3 * MiB, 0.001))
    assert process_memory.peak_bytes() == 40 * MiB
    process_memory.reset_peak()
    assert process_memory.peak_bytes() == 3 * MiB  # the reading at that moment


def test_nothing_to_read_with_gives_none(monkeypatch, fresh_watcher):
    monkeypatch.setattr(process_memory, "_reader", lambda: None)
    assert not process_memory.watch()
    assert process_memory.used_bytes() is None
    assert process_memory.peak_bytes() is None


def test_a_failing_reader_is_not_available(monkeypatch):
    def broken(pid):
        raise OSError("no driver")

    monkeypatch.setattr(process_memory, "_reader", lambda: (broken, 0.1))
    assert process_memory.used_bytes() is None


@pytest.mark.gpu
def test_the_driver_counts_an_allocation_of_this_process():
    import cupy

    cupy.zeros(1)  # a CUDA context: before it, the driver lists no process
    if process_memory.used_bytes() is None:
        pytest.skip("the driver lists no process under this process's id here")
    process_memory.watch()
    before = process_memory.used_bytes()
    block = cupy.cuda.runtime.malloc(256 * MiB)  # outside CuPy's pool: only the driver sees it
    try:
        time.sleep(0.5)
        assert process_memory.used_bytes() >= before + 256 * MiB
        assert process_memory.peak_bytes() >= before + 256 * MiB
    finally:
        cupy.cuda.runtime.free(block)
