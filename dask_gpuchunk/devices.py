"""Which devices this process can use, and the ``device=`` argument every operator takes.

A GPU counts as visible when CuPy imports and the CUDA runtime reports at least one device;
numba's CUDA simulator does not count (it runs kernels, not chunk pipelines).
"""

from __future__ import annotations

import functools
from typing import Literal, get_args

__all__ = [
    "DEVICES",
    "check_device_name",
    "Device",
    "GPUNotAvailableError",
    "gpu_count",
    "gpu_available",
    "check_device",
    "check_device_for_graph",
    "cluster_protocol",
    "cluster_worker_addresses",
    "cluster_workers",
    "distributed_client_active",
]

Device = Literal["auto", "gpu", "cpu"]
DEVICES: tuple[str, ...] = get_args(Device)


class GPUNotAvailableError(RuntimeError):
    """``device="gpu"`` was asked for where no CUDA GPU is visible."""


@functools.lru_cache(maxsize=1)
def _probe_gpus() -> tuple[int, str]:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        return 0, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver, no device, CUDA_VISIBLE_DEVICES=""
        return 0, f"the CUDA runtime reports no device ({type(exc).__name__}: {exc})"
    if count == 0:
        return 0, "the CUDA runtime reports no device"
    return count, ""


def gpu_count() -> int:
    """Number of CUDA GPUs visible to this process (0 where CuPy or a driver is missing).

    Examples
    --------
    >>> gpu_count() >= 0
    True
    """
    return _probe_gpus()[0]


def gpu_available() -> bool:
    """Whether at least one CUDA GPU is visible to this process."""
    return gpu_count() > 0


def check_device_name(device: str) -> str:
    """``device`` if it is ``"auto"``, ``"gpu"`` or ``"cpu"``, else ``ValueError``.

    Examples
    --------
    >>> check_device_name("tpu")
    Traceback (most recent call last):
    ...
    ValueError: device must be one of 'auto', 'gpu', 'cpu'; got 'tpu'
    """
    if not isinstance(device, str) or device not in DEVICES:
        raise ValueError(f"device must be one of 'auto', 'gpu', 'cpu'; got {device!r}")
    return device


def check_device(device: str) -> str:
    """Validate a ``device=`` argument and return it.

    ``"gpu"`` where no GPU is visible raises :class:`GPUNotAvailableError` saying why.

    Examples
    --------
    >>> check_device("cpu")
    'cpu'
    >>> check_device("tpu")
    Traceback (most recent call last):
    ...
    ValueError: device must be one of 'auto', 'gpu', 'cpu'; got 'tpu'
    """
    check_device_name(device)
    if device == "gpu" and not gpu_available():
        reason = _probe_gpus()[1]
        raise GPUNotAvailableError(
            f"device='gpu' was requested but no CUDA GPU is visible: {reason}. "
            "Use device='auto' to run on the CPU where no GPU is present, or install the "
            "GPU extra (pip install 'dask-gpuchunk[cuda12]' or '[cuda13]')."
        )
    return device


def distributed_client_active() -> bool:
    """Whether a ``distributed`` client is the default: graphs then run on its workers."""
    try:
        from distributed import default_client

        default_client()
        return True
    except Exception:  # distributed missing, or no client
        return False


def cluster_workers() -> int:
    """How many workers the default ``distributed`` client's cluster has now (at least 1;
    1 without a client): how many tasks of a graph can run at once on different GPUs.

    Examples
    --------
    >>> cluster_workers()
    1
    """
    return max(len(cluster_worker_addresses()), 1)


def cluster_worker_addresses() -> list[str]:
    """The addresses of the default ``distributed`` client's workers now, sorted; empty
    without a client (or where its scheduler does not answer).

    Examples
    --------
    >>> cluster_worker_addresses()
    []
    """
    try:
        from distributed import default_client

        client = default_client()
    except Exception:  # distributed missing, or no client
        return []
    try:
        return sorted(client.scheduler_info(n_workers=-1).get("workers", ()))
    except Exception:  # an asynchronous client, or the scheduler did not answer
        return []


def cluster_protocol() -> str | None:
    """The scheme of the default ``distributed`` client's scheduler address (``"tls"``,
    ``"tcp"``, ``"ucx"``, ``"inproc"``); ``None`` without a client.

    Examples
    --------
    >>> cluster_protocol() is None
    True
    """
    try:
        from distributed import default_client

        address = default_client().scheduler.address
    except Exception:  # distributed missing, or no client
        return None
    return address.split("://", 1)[0] if "://" in address else "tcp"


def check_device_for_graph(device: str) -> str:
    """Validate ``device=`` when a graph is built: like :func:`check_device`, except that
    ``"gpu"`` is accepted without a local GPU while a distributed client is active (its
    workers may have GPUs the client lacks; they check again when they run the chunks).

    Examples
    --------
    >>> check_device_for_graph("auto")
    'auto'
    """
    if not isinstance(device, str) or device not in DEVICES:
        raise ValueError(f"device must be one of 'auto', 'gpu', 'cpu'; got {device!r}")
    # gpu_available() is cached; looking for a client is not (it raises when there is none).
    if device == "gpu" and not gpu_available() and not distributed_client_active():
        check_device(device)
    return device
