"""``dask-gpuchunk bench``: the elementwise, Gram and similarity benchmarks."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import click

from ..runtime.budget import cap_device_pool
from ..devices import gpu_available
from .app import main

__all__ = ["bench", "bench_elementwise", "bench_gram", "bench_scaling", "bench_similarity"]


@main.group()
def bench() -> None:
    """Benchmarks: ours, the peers and the limits, side by side in one run."""


def _run_options(name: str, repeat: int) -> Callable[[Callable], Callable]:
    """The options every benchmark takes: its timed runs, entries to skip, where its JSON and
    PNG go (``bench-NAME``) and a device-memory cap."""
    options = [
        click.option("--repeat", default=repeat, show_default=True,
                     help="Timed runs per entry (median reported)."),
        click.option("--skip", multiple=True,
                     help="Skip entries whose name contains this (repeatable)."),
        click.option("--out-dir", default=".", show_default=True,
                     type=click.Path(file_okay=False),
                     help=f"Where to write bench-{name}.json and .png."),
        click.option("--device-budget", help="Run under a device-memory cap, as on a GPU of "
                     "this size (8GiB, 2GiB): caps CuPy's pool here and in any workers "
                     "(CUPY_GPU_MEMORY_LIMIT)."),
    ]

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


@bench.command("elementwise")
@click.option("--rows", default=1_000_000, show_default=True, help="Rows of each input.")
@click.option("--cols", default=500, show_default=True, help="Columns of each input.")
@click.option("--chunk-mb", default=200.0, show_default=True, help="Chunk size in MB (rows are split).")
@click.option("--rk4-rows", default=500_000, show_default=True, help="Rows for the RK4 table.")
@_run_options("elementwise", repeat=3)
@click.option("--loop-sizes", default="16777216,10000000", show_default=True,
              help="Seed 002's RK4 loop on the GPU at these numbers of complex64 values per "
              "array (a square number runs as a square); '' skips it.")
@click.option("--loop-steps", default=20, show_default=True, help="Steps per timed loop.")
def bench_elementwise(rows: int, cols: int, chunk_mb: float, rk4_rows: int, repeat: int,
                      skip: tuple[str, ...], out_dir: str, device_budget: str | None,
                      loop_sizes: str, loop_steps: int) -> None:
    """A float64 product, an RK4-style function through every path, and seed 002's
    device-resident loop, with limits."""
    if rows < 1 or cols < 1 or rk4_rows < 1 or repeat < 1 or chunk_mb <= 0 or loop_steps < 1:
        raise click.BadParameter("sizes, --repeat, --loop-steps and --chunk-mb must be positive")
    try:
        sizes = tuple(int(v) for v in loop_sizes.split(",") if v.strip())
        if any(v < 1 for v in sizes):
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"--loop-sizes takes positive integers, got {loop_sizes!r}") from None
    _apply_device_budget(device_budget)
    from ..bench.elementwise import host_memory_needed, rows_that_fit, run
    from ..bench.limits import available_host_memory
    from ..bench.report import format_table, save

    gpu = gpu_available()
    need, have = host_memory_needed(rows, cols, rk4_rows, gpu), available_host_memory()
    if have is not None and need > 0.9 * have:
        fit_rows, fit_rk4 = rows_that_fit(int(0.8 * have), cols, gpu)
        click.echo(f"error: bench elementwise at {rows:,} x {cols} needs about {need / 1e9:.0f} "
                   f"GB of host memory and {have / 1e9:.0f} GB are available: "
                   f"--rows {fit_rows} --rk4-rows {fit_rk4} fits "
                   "(--rows 100000 --rk4-rows 50000 runs in about a minute)", err=True)
        sys.exit(2)
    report = run(rows=rows, cols=cols, chunk_mb=chunk_mb, rk4_rows=rk4_rows, repeat=repeat,
                 skip=skip, log=lambda s: click.echo(s, err=True), loop_sizes=sizes,
                 loop_steps=loop_steps)
    click.echo(format_table(report))
    for path in save(report, out_dir, "bench-elementwise", log=lambda s: click.echo(s, err=True)):
        click.echo(f"wrote {path}", err=True)


def _apply_device_budget(value: str | None) -> None:
    if value is None:
        return
    from dask.utils import parse_bytes


    try:
        nbytes = parse_bytes(value)
        if nbytes <= 0:
            raise ValueError
    except (ValueError, TypeError):
        raise click.BadParameter(f"--device-budget: cannot read {value!r} as a positive size "
                                 "(8GiB, 2GiB)") from None
    # This command's own process and the cluster workers it starts (which inherit its
    # environment): the GPU behaves as a card of that size. Asked for by the option.
    os.environ["CUPY_GPU_MEMORY_LIMIT"] = str(int(nbytes))
    cap_device_pool(nbytes)
    click.echo(f"device budget: CuPy's pool capped at {nbytes:,} bytes", err=True)


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
@click.option("--bitloop-rows", "seed_rows", default=4096, show_default=True, help="Rows for the byte-packed bit-loop peer "
              "(timed there and scaled by N**2).")
@click.option("--cpu-rows", default=1024, show_default=True, help="Rows for our CPU path (scaled).")
@_run_options("gram", repeat=3)
def bench_gram(n: int, k: int, chunk_rows: tuple[int, ...], tiles: tuple[str, ...], seed_rows: int,
               cpu_rows: int, repeat: int, skip: tuple[str, ...], out_dir: str,
               device_budget: str | None) -> None:
    """The Gram matrix A·Aᵀ of 0/1 data: every method, the peers, the popcount ceiling."""
    if min(n, k, seed_rows, cpu_rows, repeat, *(chunk_rows or (1,))) < 1:
        raise click.BadParameter("sizes, row counts and --repeat must be positive")
    _apply_device_budget(device_budget)
    from ..bench.gram import format_table as gram_table
    from ..bench.gram import run
    from ..bench.report import save

    report = run(n=n, k=k, chunk_rows=chunk_rows or (4096,), tiles=[_tile(t) for t in tiles],
                 seed_rows=seed_rows, cpu_rows=cpu_rows, repeat=repeat, skip=skip,
                 log=lambda s: click.echo(s, err=True))
    click.echo(gram_table(report))
    for path in save(report, out_dir, "bench-gram", log=lambda s: click.echo(s, err=True)):
        click.echo(f"wrote {path}", err=True)


@bench.command("similarity")
@click.option("--n", "n", default=1_000_000, show_default=True, help="Fingerprints.")
@click.option("--bits", default=2048, show_default=True, help="Bits per fingerprint (a "
              "multiple of 8).")
@click.option("--density", default=0.075, show_default=True, help="Fraction of bits set.")
@click.option("--queries", default=10_000, show_default=True, help="Queries for the queries x "
              "database rows (0: none).")
@click.option("--chunk-rows", default=32768, show_default=True, help="Rows per chunk.")
@click.option("--top-k", "k", default=10, show_default=True, help="Neighbours per row.")
@click.option("--threshold", default=0.7, show_default=True, help="Tanimoto threshold.")
@click.option("--peer-rows", default=65536, show_default=True, help="Database rows the peers "
              "(CuPy, NumPy, RDKit) are timed on.")
@_run_options("similarity", repeat=2)
def bench_similarity(n: int, bits: int, density: float, queries: int, chunk_rows: int, k: int,
                     threshold: float, peer_rows: int, repeat: int, skip: tuple[str, ...],
                     out_dir: str, device_budget: str | None) -> None:
    """Tanimoto top-k and threshold search over binary fingerprints, with peers and a
    ceiling."""
    if min(n, bits, chunk_rows, k, peer_rows, repeat) < 1 or queries < 0:
        raise click.BadParameter("sizes, --top-k and --repeat must be positive")
    if bits % 8:
        raise click.BadParameter(f"--bits must be a multiple of 8, got {bits}")
    if not 0 < density < 1 or not 0 <= threshold <= 1:
        raise click.BadParameter("--density must lie in (0, 1) and --threshold in [0, 1]")
    if k >= n:
        raise click.BadParameter(f"--top-k must be below --n ({n}), got {k}")
    _apply_device_budget(device_budget)
    from ..bench.report import save
    from ..bench.similarity import format_table as similarity_table
    from ..bench.similarity import run

    report = run(n=n, bits=bits, density=density, queries=queries, chunk_rows=chunk_rows, k=k,
                 threshold=threshold, peer_rows=peer_rows, repeat=repeat, skip=skip,
                 log=lambda s: click.echo(s, err=True))
    click.echo(similarity_table(report))
    for path in save(report, out_dir, "bench-similarity", log=lambda s: click.echo(s, err=True)):
        click.echo(f"wrote {path}", err=True)


@bench.command("scaling")
@click.option("--gpus", default="", help="Cluster sizes to run, as 1,2,4 (default: one GPU and "
              "every visible GPU; where none is visible, 1 and 2 CPU workers).")
@click.option("--protocol", type=click.Choice(["tls", "tcp", "ucx"]), default="tls",
              show_default=True, help="How the workers talk: TLS on loopback (the clusters' "
              "default), plain TCP, or UCX (distributed-ucxx installed).")
@click.option("--rows", default=65536, show_default=True, help="Rows of the Gram's bits.")
@click.option("--bits", default=262144, show_default=True, help="Bits per row of the Gram (a "
              "multiple of 8).")
@click.option("--chunk-rows", default=4096, show_default=True, help="Rows per chunk of the "
              "Gram's .npy.")
@click.option("--fingerprints", default=1_000_000, show_default=True, help="Fingerprints of "
              "2048 bits for the top-k (0: leave it out).")
@click.option("--top-k", "k", default=10, show_default=True, help="Neighbours per row.")
@click.option("--threads-per-gpu", default=None, help="Dask threads per GPU worker: a number "
              "or 'cores' (default: dg.local_cluster's).")
@_run_options("scaling", repeat=3)
def bench_scaling(gpus: str, protocol: str, rows: int, bits: int, chunk_rows: int,
                  fingerprints: int, k: int, threads_per_gpu: str | None, repeat: int,
                  skip: tuple[str, ...], out_dir: str, device_budget: str | None) -> None:
    """The Gram and the similarity top-k on one GPU and on every GPU of this node: speed-ups."""
    try:
        sizes = [int(g) for g in gpus.split(",") if g.strip()]
    except ValueError:
        raise click.BadParameter(f"--gpus takes cluster sizes as 1,2,4; got {gpus!r}") from None
    if min(rows, bits, chunk_rows, k, repeat, *sizes) < 1 or fingerprints < 0:
        raise click.BadParameter("sizes, --gpus, --top-k and --repeat must be positive")
    if bits % 8:
        raise click.BadParameter(f"--bits must be a multiple of 8, got {bits}")
    if fingerprints and k >= fingerprints:
        raise click.BadParameter(f"--top-k must be below --fingerprints ({fingerprints})")
    threads: int | str | None = threads_per_gpu
    if threads_per_gpu is not None and threads_per_gpu != "cores":
        if not threads_per_gpu.isdigit() or int(threads_per_gpu) < 1:
            raise click.BadParameter(f"--threads-per-gpu takes a number of at least 1 or "
                                     f"'cores', got {threads_per_gpu!r}")
        threads = int(threads_per_gpu)
    _apply_device_budget(device_budget)
    from ..bench.report import save
    from ..bench.scaling import format_table as scaling_table
    from ..bench.scaling import run

    try:
        report = run(gpus=sizes, rows=rows, bits=bits, chunk_rows=chunk_rows,
                     fingerprints=fingerprints, k=k,
                     protocol=None if protocol == "tls" else protocol,
                     threads_per_gpu=threads, repeat=repeat,
                     skip=skip, log=lambda s: click.echo(s, err=True))
    except ValueError as exc:  # more GPUs asked for than are visible
        raise click.BadParameter(str(exc)) from None
    click.echo(scaling_table(report))
    for path in save(report, out_dir, "bench-scaling", log=lambda s: click.echo(s, err=True)):
        click.echo(f"wrote {path}", err=True)
