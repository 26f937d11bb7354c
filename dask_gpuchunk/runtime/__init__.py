"""Chunk execution: where a chunk runs and how. :mod:`~dask_gpuchunk.runtime.backend` is the
dispatch every operator's chunks go through (``chunk_site``, the one rule for where a chunk
runs); its runners are :mod:`~dask_gpuchunk.runtime.cpu_runner` (numba's parallel twins),
:mod:`~dask_gpuchunk.runtime.gpu_runners` (device-resident and staged chunks) over
:mod:`~dask_gpuchunk.runtime.device_launch` (a kernel's passes and launch), sharing
:mod:`~dask_gpuchunk.runtime.chunk_layout` (a chunk's inputs laid out for its kernel);
:mod:`~dask_gpuchunk.runtime.placement` measures this machine's copies for the choice of
where a host chunk runs. Beside them: the device memory budget and its admission
(:mod:`~dask_gpuchunk.runtime.budget`; dask-cuda's RMM pool was measured no faster, so it
stays), page-locked host staging (:mod:`~dask_gpuchunk.runtime.staging`), the process's
device memory as the driver counts it (:mod:`~dask_gpuchunk.runtime.process_memory`) and
input chunks kept where the blocks that read them run (:mod:`~dask_gpuchunk.runtime.resident`).
"""
