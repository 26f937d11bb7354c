"""The limits a bench measures: sized to fit a capped device."""

from __future__ import annotations

from dask_gpuchunk.bench import limits


def test_device_copies_fit_a_capped_device():
    assert limits.copy_bytes(4 << 30, 2 << 30) * 2 <= (2 << 30) // 2
    assert limits.copy_bytes(1 << 30, 8 << 30) == 1 << 30
    assert limits.copy_bytes(1 << 30, None) == 1 << 30
    assert limits.copy_bytes(4 << 30, 3 << 30) % (1 << 20) == 0
