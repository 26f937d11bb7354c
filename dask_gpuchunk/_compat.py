"""Every private or undocumented name of dask, distributed and dask-cuda the package touches,
in one place, each with the releases it was checked on.

A new dask / distributed / dask-cuda release that moves one of these breaks this module alone;
``tests/test_compat.py`` calls each against the installed releases (CI runs it on the oldest
and newest the package declares, the GPU checks on the GPU machine's). Public, documented API
(``dask.array``, ``distributed.Client``, ``Worker.log_event``, ``distributed.protocol``'s
``dask_serialize`` / ``dask_deserialize`` registries, active memory manager policies) is used
directly where it is needed, not from here.

Checked on: dask and distributed 2026.7.1 (CI's oldest job, the GPU machine) and 2026.8.0
(CI's newest job); dask-cuda 26.10.0 with zict 3.0.0 and distributed-ucxx 0.52.0 (the GPU
machine).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

__all__ = ["ARRAY_EXPR_MODULE", "alias_task_type", "common_blockdim", "default_clients",
           "device_results_lru", "flatten_keys", "forget_default_clients", "fused_task_keys",
           "is_array_expression",
           "parse_gufunc_signature",
           "reduce_replicas_policy", "register_cupy_deserializer", "register_device_object",
           "set_ucx_device_allocator", "slices_from_chunks",
           "suggestion_key", "worker_threads"]

#: The module of dask's array expressions (``array.query-planning: True``); 2026.7.1, 2026.8.0.
ARRAY_EXPR_MODULE = "dask.array._array_expr"


def alias_task_type() -> type:
    """``dask._task_spec.Alias``: a graph node that names another key (what linear fusion
    leaves behind). Private module; ``dask.task_spec`` re-exports ``Task`` and ``TaskRef`` but
    not ``Alias`` in 2026.7.1 and 2026.8.0."""
    from dask._task_spec import Alias

    return Alias


def fused_task_keys(node: Any) -> tuple[Hashable, ...]:
    """The keys of the tasks that dask's linear fusion joined into ``node`` (a task of
    ``dask._task_spec._execute_subgraph``, whose first argument is the dictionary of the
    fused tasks), or ``node``'s own key for any other node (2026.7.1, 2026.8.0)."""
    from dask._task_spec import _execute_subgraph

    if getattr(node, "func", None) is _execute_subgraph and isinstance(node.args[0], dict):
        return tuple(node.args[0])
    return (node.key,)


def flatten_keys(keys: Any) -> list[Hashable]:
    """The keys of a nested list of keys (``dask.core.flatten``, undocumented; 2026.7.1,
    2026.8.0)."""
    from dask.core import flatten

    return list(flatten(keys))


def parse_gufunc_signature(signature: str) -> tuple[list[tuple[str, ...]], Any]:
    """A generalized ufunc signature's core dimensions of the inputs and the outputs
    (``dask.array.gufunc._parse_gufunc_signature``; 2026.7.1, 2026.8.0)."""
    from dask.array.gufunc import _parse_gufunc_signature

    return _parse_gufunc_signature(signature)


def common_blockdim(spans: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The chunks of one axis that several arrays' chunks along it all fit
    (``dask.array.core.common_blockdim``, undocumented; 2026.7.1, 2026.8.0)."""
    from dask.array.core import common_blockdim as blockdim

    return blockdim(spans)


def slices_from_chunks(chunks: tuple[tuple[int, ...], ...]) -> list[tuple[slice, ...]]:
    """Each block's slices of an array of ``chunks``, in C order of the blocks
    (``dask.array.core.slices_from_chunks``, undocumented; 2026.7.1, 2026.8.0)."""
    from dask.array.core import slices_from_chunks as slices

    return slices(chunks)


def is_array_expression(x: Any) -> bool:
    """Whether ``x`` is a dask array of the array query planning (its graph made when
    computed; arrays of unknown lengths are refused there)."""
    return type(x).__module__.startswith(ARRAY_EXPR_MODULE)


def worker_threads(worker: Any) -> int:
    """The threads a distributed worker runs tasks on (``Worker.state.nthreads``: the worker
    state machine, undocumented; 2026.7.1, 2026.8.0)."""
    return int(worker.state.nthreads)


def device_results_lru(worker: Any) -> Any:
    """The zict LRU of results a dask-cuda worker keeps on the device (``worker.data`` is
    dask-cuda's ``DeviceHostFile``; its ``device_buffer.fast`` has ``n``, the bytes it holds,
    and ``evict()``), or ``None`` for any other worker or store (JIT-unspilling's
    ``ProxifyHostFile`` has none). dask-cuda 26.10.0 with zict 3.0.0."""
    buffer = getattr(getattr(worker, "data", None), "device_buffer", None)
    fast = getattr(buffer, "fast", None)
    return fast if fast is not None and hasattr(fast, "n") else None


def register_device_object(cls: type, holds_device_memory: Callable[[Any], bool]) -> bool:
    """Tell dask-cuda's spilling whether an object of ``cls`` holds device memory
    (``dask_cuda.is_device_object.is_device_object``, a dispatch undocumented as API;
    26.10.0). Only where dask-cuda is already imported (a dask-cuda worker imports it first):
    importing it here would bring dask's dataframes and pandas into every process. Returns
    whether it registered."""
    module = sys.modules.get("dask_cuda.is_device_object")
    if module is None:
        return False
    module.is_device_object.register(cls)(holds_device_memory)
    return True


def reduce_replicas_policy() -> type:
    """``distributed.active_memory_manager.ReduceReplicas``, the class a policy of ours
    extends; its ``run`` yields ``(op, TaskState, candidates)`` suggestions (2026.7.1,
    2026.8.0)."""
    from distributed.active_memory_manager import ReduceReplicas

    return ReduceReplicas


def suggestion_key(suggestion: Sequence[Any]) -> Hashable:
    """The key of the task an active memory manager suggestion ``(op, task, candidates)``
    is about (``TaskState.key``, scheduler state; 2026.7.1, 2026.8.0)."""
    return suggestion[1].key


def register_cupy_deserializer(deserialize: Callable[[dict[str, Any], list[Any]], Any]) -> None:
    """Put ``deserialize(header, frames)`` in place of distributed's own ``dask_deserialize``
    of a CuPy array. It reads distributed's header of one (``shape``, ``typestr``,
    ``strides``; one frame of the bytes), undocumented (2026.7.1, 2026.8.0). distributed's
    module registers first, here, so that it cannot replace ours later."""
    import cupy
    import distributed.protocol.cupy  # noqa: F401 - its registration, replaced below
    from distributed.protocol.serialize import dask_deserialize

    dask_deserialize.register(cupy.ndarray)(deserialize)


def default_clients() -> set[int]:
    """The ids of the clients distributed keeps as defaults now (``distributed.client.
    _global_clients``, undocumented; 2026.7.1, 2026.8.0)."""
    from distributed import client

    return {id(c) for c in list(client._global_clients.values())}


def forget_default_clients(keep: set[int]) -> None:
    """Take every default client but those of ``keep`` (:func:`default_clients`) off
    distributed's defaults: a ``Client`` that failed to connect registers itself first, and
    a later ``compute`` without a client then waited on it forever
    (``distributed.client._del_global_client``; 2026.7.1, 2026.8.0)."""
    import contextlib

    from distributed import client

    for made in list(client._global_clients.values()):
        if id(made) not in keep:
            client._del_global_client(made)
            # Closed now, briefly: left to its finalizer, it waited 30 s and printed a
            # traceback as the process ended.
            with contextlib.suppress(Exception):
                made.close(timeout=1)


def set_ucx_device_allocator(allocate: Callable[[int], Any] | None) -> Callable[[int], Any] | None:
    """Make distributed-ucxx receive device frames into ``allocate(nbytes)`` (any object with
    ``__cuda_array_interface__``); returns the allocator it replaced, ``None`` where
    distributed-ucxx is not loaded (the worker talks another protocol). ``allocate=None``
    reads the current one only. distributed-ucxx keeps it in the module global
    ``distributed_ucxx.ucxx.device_array``, set once by ``init_once`` when the first UCX comm
    starts (undocumented; 0.52.0): its own is ``rmm.DeviceBuffer(size=n)``, a ``cudaMalloc``
    per received chunk outside CuPy's pool unless RMM's pool is CuPy's allocator too."""
    module = sys.modules.get("distributed_ucxx.ucxx")
    if module is None or getattr(module, "ucxx", None) is None:  # not initialised here
        return None
    previous = module.device_array
    if allocate is not None:
        module.device_array = allocate
    return previous
