"""Chunk execution: where a chunk runs and how. :mod:`~dask_gpuchunk.runtime.backend` is the
dispatch every operator's chunks go through (``chunk_site``, the one rule for where a chunk
runs); its runners are :mod:`~dask_gpuchunk.runtime.cpu_runner` (numba's parallel twins),
:mod:`~dask_gpuchunk.runtime.gpu_runners` (device-resident and staged chunks) over
:mod:`~dask_gpuchunk.runtime.device_launch` (a kernel's passes and launch), sharing
:mod:`~dask_gpuchunk.runtime.chunk_layout` (a chunk's inputs laid out for its kernel);
:mod:`~dask_gpuchunk.runtime.placement` measures this machine's copies for the choice of
where a host chunk runs. The device memory budget, host staging and process memory stay
beside it (:mod:`dask_gpuchunk.budget`, :mod:`dask_gpuchunk.staging`,
:mod:`dask_gpuchunk.process_memory`) until the cluster engines' measurements settle which of
them RMM and dask-cuda replace.
"""
