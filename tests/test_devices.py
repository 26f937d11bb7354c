"""Device detection and the device= argument."""

from __future__ import annotations

import pytest

from dask_gpuchunk.devices import GPUNotAvailableError, check_device, gpu_available, gpu_count


@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_auto_and_cpu_are_always_valid(device):
    assert check_device(device) == device


@pytest.mark.parametrize("device", ["GPU", "cuda", "", None, 0])
def test_invalid_values(device):
    with pytest.raises(ValueError, match="device must be one of"):
        check_device(device)


def test_gpu_count_agrees_with_gpu_available():
    assert (gpu_count() > 0) == gpu_available()


def test_gpu_device_matches_visibility():
    if gpu_available():
        assert check_device("gpu") == "gpu"
    else:
        with pytest.raises(GPUNotAvailableError, match="Use device='auto'"):
            check_device("gpu")
