"""Device detection and the device= argument."""

from __future__ import annotations

import pytest

import dask_gpuchunk as dg
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


def test_the_public_choices_are_typed_as_the_literals_that_list_them():
    import typing

    from dask_gpuchunk._kernels.gram import METHODS, Method
    from dask_gpuchunk._kernels.similarity import METRICS, Metric
    from dask_gpuchunk.devices import DEVICES, Device

    assert typing.get_args(Device) == DEVICES and typing.get_args(Method) == METHODS
    assert typing.get_args(Metric) == METRICS
    for func, wanted in [(dg.gram, {"method": Method, "device": Device}),
                         (dg.bitpack, {"device": Device}),
                         (dg.similarity, {"metric": Metric, "method": Method, "device": Device}),
                         (dg.map_kernel, {"device": Device}),
                         (type(dg.multiply).__call__, {"device": Device})]:
        hints = typing.get_type_hints(func)
        assert {name: hints[name] for name in wanted} == wanted, func
