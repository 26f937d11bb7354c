"""The ``dask-gpuchunk`` command line (also ``python -m dask_gpuchunk``).

``info``
    Versions, visible GPUs, and which execution paths are active on this machine.
``bench elementwise``
    Seed 000's product and an RK4-style function through every path, beside the peers and the
    limits measured in the same run; prints a table and writes JSON and PNG.
``bench gram``
    Seed 001's Gram matrix of bit-packed 0/1 data: every method, the peers and the popcount
    ceiling, as bit multiply-accumulates per second; prints a table and writes JSON and PNG.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
from typing import Any

import click

__all__ = ["main", "environment"]


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", "?"))


def environment() -> dict[str, Any]:
    """What ``dask-gpuchunk info`` reports, as a dict.

    Examples
    --------
    >>> env = environment()
    >>> sorted(env["paths"])
    ['auto', 'cpu', 'gpu-device', 'gpu-host', 'gram']
    """
    from . import __version__
    from .devices import _probe_gpus

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
                 "(dask_gpuchunk.placement)") if count else "every chunk on the CPU (no GPU visible)",
    }
    if count:
        from .gram import resolve_method

        auto = resolve_method("auto", on_gpu=True)
        int8 = "int8 (cuBLAS int8 tensor cores)" + ("" if auto == "int8" else ": not on this GPU")
        paths["gram"] = (f"GPU methods: popcount, {int8}; method='auto' uses {auto}; "
                         "NumPy chunks computed on the GPU")
    else:
        paths["gram"] = "popcount on the CPU (method='auto'); int8 needs a GPU"
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


@main.group()
def bench() -> None:
    """Benchmarks: ours, the peers and the limits, side by side in one run."""


@bench.command("elementwise")
@click.option("--rows", default=1_000_000, show_default=True, help="Rows of each input (seed 000: 1,000,000).")
@click.option("--cols", default=500, show_default=True, help="Columns of each input.")
@click.option("--chunk-mb", default=200.0, show_default=True, help="Chunk size in MB (rows are split).")
@click.option("--rk4-rows", default=500_000, show_default=True, help="Rows for the RK4 table.")
@click.option("--repeat", default=3, show_default=True, help="Timed runs per entry (median reported).")
@click.option("--skip", multiple=True, help="Skip entries whose name contains this (repeatable).")
@click.option("--out-dir", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Where to write bench-elementwise.json and .png.")
def bench_elementwise(rows: int, cols: int, chunk_mb: float, rk4_rows: int, repeat: int,
                      skip: tuple[str, ...], out_dir: str) -> None:
    """Seed 000's product and an RK4-style function through every path, with limits."""
    if rows < 1 or cols < 1 or rk4_rows < 1 or repeat < 1 or chunk_mb <= 0:
        raise click.BadParameter("sizes, --repeat and --chunk-mb must be positive")
    from .bench.elementwise import run
    from .bench.report import format_table, save

    report = run(rows=rows, cols=cols, chunk_mb=chunk_mb, rk4_rows=rk4_rows, repeat=repeat,
                 skip=skip, log=lambda s: click.echo(s, err=True))
    click.echo(format_table(report))
    for path in save(report, out_dir, "bench-elementwise"):
        click.echo(f"wrote {path}", err=True)


def _tile(value: str) -> tuple[int, int, int, int, int]:
    parts = tuple(int(v) for v in value.split(","))
    if len(parts) != 5 or min(parts) < 1:
        raise click.BadParameter(f"--tile takes five positive integers TY,TX,RM,RN,TK; got {value!r}")
    return parts  # type: ignore[return-value]


@bench.command("gram")
@click.option("--n", "n", default=16384, show_default=True, help="Rows of the 0/1 matrix.")
@click.option("--k", "k", default=131072, show_default=True, help="Bits per row.")
@click.option("--chunk-rows", multiple=True, type=int, help="Rows per chunk for dg.gram "
              "(repeatable; default 4096).")
@click.option("--tile", "tiles", multiple=True, help="Extra popcount tile shape TY,TX,RM,RN,TK to "
              "time (repeatable).")
@click.option("--seed-rows", default=4096, show_default=True, help="Rows for seed 001's approach "
              "(timed there and scaled by N**2).")
@click.option("--cpu-rows", default=1024, show_default=True, help="Rows for our CPU path (scaled).")
@click.option("--repeat", default=3, show_default=True, help="Timed runs per entry (median reported).")
@click.option("--skip", multiple=True, help="Skip entries whose name contains this (repeatable).")
@click.option("--out-dir", default=".", show_default=True, type=click.Path(file_okay=False),
              help="Where to write bench-gram.json and .png.")
def bench_gram(n: int, k: int, chunk_rows: tuple[int, ...], tiles: tuple[str, ...], seed_rows: int,
               cpu_rows: int, repeat: int, skip: tuple[str, ...], out_dir: str) -> None:
    """Seed 001's Gram matrix A·Aᵀ of 0/1 data: every method, the peers, the popcount ceiling."""
    if min(n, k, seed_rows, cpu_rows, repeat, *(chunk_rows or (1,))) < 1:
        raise click.BadParameter("sizes, row counts and --repeat must be positive")
    from .bench.gram import format_table as gram_table
    from .bench.gram import run
    from .bench.report import save

    report = run(n=n, k=k, chunk_rows=chunk_rows or (4096,), tiles=[_tile(t) for t in tiles],
                 seed_rows=seed_rows, cpu_rows=cpu_rows, repeat=repeat, skip=skip,
                 log=lambda s: click.echo(s, err=True))
    click.echo(gram_table(report))
    for path in save(report, out_dir, "bench-gram"):
        click.echo(f"wrote {path}", err=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
