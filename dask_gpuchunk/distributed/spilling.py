"""Spilling that holds the device budget in a dask-cuda worker.

dask-cuda moves stored results from the device to host memory when more are stored than the
worker's ``device_memory_limit``, and back when a task needs them. Two things let a worker
still run its device out of memory, and :func:`hold_budget` changes both:

- What running tasks allocate is not counted: stored results up to the limit plus the chunks
  of running tasks can exceed the device. Here a CuPy allocation that fails first returns
  CuPy's cached blocks to the device, then moves stored results to the host, least recently
  used first, trying again after each; it fails only when nothing stored is left on the device.
  Under a pool cap (``CUPY_GPU_MEMORY_LIMIT``) CuPy counts its cached free blocks against the
  cap and raises before it frees any (its pool frees them only when the driver itself is out
  of memory), so without the first step a worker could fail with the cap's worth "allocated",
  most of it blocks cached for the streams of other threads.
- Without RMM, distributed brings a spilled CuPy array back through numba's allocator
  (``numba.cuda.to_device``): outside CuPy's pool, so outside a pool cap
  (``CUPY_GPU_MEMORY_LIMIT``) and out of reach of the retry above, and freed late (numba defers
  frees until a fifth of the device is pending: 28 GB on an H200, where nvidia-smi showed a
  worker with an 8 GiB pool holding 23 GB). Here it comes back through CuPy's pool.

Over UCX the same holds for chunks received from another worker: distributed-ucxx receives
each into a new ``rmm.DeviceBuffer`` (a ``cudaMalloc``, and a ``cudaFree`` that waits for the
whole device when the chunk is released); :func:`receive_through_pool` makes it CuPy's
allocator's (the pool, or RMM's where RMM is CuPy's allocator).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _compat

from ..runtime import budget
from ..devices import gpu_available

__all__ = ["allocate_or_yield", "hold_budget", "receive_through_pool", "unspill_through_pool"]

#: distributed-ucxx's own allocator of received device frames, where
#: :func:`receive_through_pool` replaced it (for measuring one against the other).
ucx_own_allocator: Any = None


def _evict_one(stored: Any) -> bool:
    """Move the least recently used result of a dask-cuda worker's device LRU
    (:func:`dask_gpuchunk.runtime.budget.stored_results_lru`) to the host; ``False`` when nothing is
    left to move."""
    try:
        _, _, weight = stored.evict()
    except KeyError:  # empty
        return False
    budget.spilled_on_failure["bytes"] += int(weight)
    budget.spilled_on_failure["results"] += 1
    return True


def allocate_or_yield(pool: Any, nbytes: int, stored: Any, out_of_memory: type[Exception]
                      ) -> Any:
    """``pool.malloc(nbytes)``; where it fails (``out_of_memory``), the pool's cached blocks
    returned to the device and tried again, then one stored result moved to the host at a
    time (``stored``: the worker's device LRU), returning the blocks it leaves, until it fits;
    ``out_of_memory`` again when nothing stored is left."""
    try:
        return pool.malloc(nbytes)
    except out_of_memory:
        pass
    while True:
        pool.free_all_blocks()  # what a freed or evicted result left cached in the pool
        try:
            return pool.malloc(nbytes)
        except out_of_memory:
            if not _evict_one(stored):
                raise


def unspill_through_pool(header: dict[str, Any], frames: list[Any]) -> Any:
    """Distributed's ``dask_deserialize`` of a CuPy array (a host copy of its bytes and its
    ``__cuda_array_interface__``), allocating the device copy from CuPy's pool."""
    import cupy

    (frame,) = frames
    host = np.frombuffer(memoryview(frame).cast("B"), dtype=np.uint8)
    device = cupy.empty(host.nbytes, dtype=np.uint8)
    device.set(host)
    return cupy.ndarray(shape=header["shape"], dtype=header["typestr"], memptr=device.data,
                        strides=header["strides"])


def hold_budget(worker: Any) -> bool:
    """In a dask-cuda worker with a device limit: make failing CuPy allocations move stored
    results to the host, bring spilled CuPy arrays back through CuPy's pool, and tell the
    budget that stored results yield (:data:`dask_gpuchunk.runtime.budget.stored_results_yield`).
    Returns whether it did (``False``: no GPU, or no dask-cuda device buffer)."""
    stored = budget.stored_results_lru(worker)
    if not gpu_available() or stored is None:
        return False
    import cupy
    pool = cupy.get_default_memory_pool()
    if getattr(cupy.cuda.get_allocator(), "__self__", pool) is not pool:
        # Another allocator is CuPy's (RMM's, through dask-cuda's rmm_allocator_external_lib_
        # list): its own pool and limits hold the device, not CuPy's.
        return False

    def malloc(nbytes: int) -> Any:
        return allocate_or_yield(pool, nbytes, stored, cupy.cuda.memory.OutOfMemoryError)

    cupy.cuda.set_allocator(malloc)
    _compat.register_cupy_deserializer(unspill_through_pool)
    budget.stored_results_yield = True
    return True


def _receive_buffer(nbytes: int) -> Any:
    import cupy

    return cupy.empty(nbytes, dtype=np.uint8)


def receive_through_pool(worker: Any) -> bool:
    """In a worker talking UCX with a GPU: chunks received from other workers are allocated
    by CuPy's allocator (its pool: no ``cudaMalloc`` / ``cudaFree`` per chunk, counted by a
    pool cap and yielding as :func:`hold_budget` makes it), not distributed-ucxx's
    ``rmm.DeviceBuffer``. Returns whether it did."""
    global ucx_own_allocator
    if not gpu_available() or not str(getattr(worker, "address", "")).startswith("ucx"):
        return False
    previous = _compat.set_ucx_device_allocator(_receive_buffer)
    if previous is None:
        return False
    if previous is not _receive_buffer:
        ucx_own_allocator = previous
    return True
