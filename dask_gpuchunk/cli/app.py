"""The ``dask-gpuchunk`` group and its ``info``: versions, GPUs and the paths active here."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
from typing import Any

import click

from .. import __version__
from ..devices import _probe_gpus
from ..bits.gram_blocks import compute_capability, resolve_method

__all__ = ["environment", "info", "main"]


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:
        return None
    try:  # the installed distribution's version (click deprecates its __version__)
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:  # cupy is installed as cupy-cuda12x, ...
        return str(getattr(mod, "__version__", "?"))


def environment() -> dict[str, Any]:
    """What ``dask-gpuchunk info`` reports, as a dict.

    Examples
    --------
    >>> env = environment()
    >>> sorted(env["paths"])
    ['auto', 'cpu', 'gpu-device', 'gpu-host', 'gram']
    """
    versions = {"dask_gpuchunk": __version__, "python": platform.python_version()}
    for name in ("numpy", "numba", "numba_cuda", "dask", "distributed", "cupy", "dask_cuda", "click"):
        versions[name] = _version(name)
    count, reason = _probe_gpus()
    gpus = []
    if count:
        import cupy

        for i in range(count):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            gpus.append({"index": i, "name": p["name"].decode(), "memory_bytes": int(p["totalGlobalMem"]),
                         "compute_capability": f"{p['major']}.{p['minor']}",
                         "multiprocessors": int(p["multiProcessorCount"])})
    import numba

    try:
        from numba.cuda import config as cuda_config

        simulator = bool(cuda_config.ENABLE_CUDASIM)
    except Exception:
        simulator = False
    cpu = f"numba njit(parallel=True), {numba.config.NUMBA_NUM_THREADS} threads"
    gpu_state = "active" if count else f"inactive: {reason}"
    paths = {
        "cpu": f"active: {cpu}",
        "gpu-host": f"{gpu_state}" + ("; NumPy chunks staged through pinned buffers, "
                                      "4 chunks per GPU at once, each on its own stream" if count else ""),
        "gpu-device": f"{gpu_state}" + ("; CuPy chunks computed on the device, queued on the "
                                        "current stream like CuPy operations" if count else ""),
        "auto": ("CuPy chunks on the GPU; NumPy chunks on the device the measured rule picks "
                 "(dask_gpuchunk.runtime.placement)") if count else "every chunk on the CPU (no GPU visible)",
    }
    if count:
        auto = resolve_method("auto", on_gpu=True)
        cc = "%d.%d" % compute_capability()
        why = {"wgmma": " (a Hopper: warpgroup 1-bit MMA; dg.gram measured 2.8 x bmma on a "
                        "long-row Gram, H200; top-k and threshold similarity run bmma's "
                        "fused kernel)",
               "bmma": f" (compute capability {cc}: wgmma needs 9.0)",
               "int8": f" (no 1-bit MMA on this GPU: compute capability {cc} < 8.0)",
               "popcount": f" (no int8 or 1-bit MMA on this GPU: compute capability {cc} < 7.5)"}
        paths["gram"] = (f"GPU methods: popcount, int8 (cuBLAS int8 tensor cores, cc >= 7.5), "
                         f"bmma (1-bit tensor cores, cc >= 8.0), wgmma (Hopper's warpgroup "
                         f"1-bit tensor cores, cc 9.0); method='auto' uses {auto}{why[auto]}; "
                         f"NumPy chunks computed on the GPU")
    else:
        paths["gram"] = "popcount on the CPU (method='auto'); int8, bmma and wgmma need a GPU"
    return {
        "versions": versions,
        "gpus": gpus,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "numba_cuda_simulator": simulator,
        "cpu_count": os.cpu_count(),
        "paths": paths,
    }


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="dask-gpuchunk")
def main() -> None:
    """Numba CUDA kernels over Dask arrays larger than GPU memory."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
def info(as_json: bool) -> None:
    """Versions, visible GPUs and the active execution paths."""
    env = environment()
    if as_json:
        click.echo(json.dumps(env))
        return
    click.echo("versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v))
    missing = [k for k, v in env["versions"].items() if v is None]
    if missing:
        click.echo("not installed: " + ", ".join(missing))
    if env["gpus"]:
        for g in env["gpus"]:
            click.echo(f"GPU {g['index']}: {g['name']}, {g['memory_bytes'] / 2**30:.1f} GiB, "
                       f"compute capability {g['compute_capability']}, {g['multiprocessors']} SMs")
    else:
        click.echo("GPUs: none visible")
    if env["numba_cuda_simulator"]:
        click.echo("numba CUDA simulator: ON (NUMBA_ENABLE_CUDASIM=1)")
    click.echo(f"CPU cores: {env['cpu_count']}")
    click.echo("execution paths:")
    for name, state in env["paths"].items():
        click.echo(f"  {name:10s} {state}")
