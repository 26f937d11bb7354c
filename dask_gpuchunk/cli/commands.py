"""The job commands (``multiply``, ``gram``, ``similarity``, ``fingerprints``, ``demo``) and
``tls-credentials`` and ``clean``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click
from dask.utils import format_bytes

from .. import jobs
from ..devices import gpu_count
from ..bits.gram_blocks import METHODS
from ..io.fingerprint_files import FINGERPRINT_KINDS
from ..jobs import gram_job, multiply_job, similarity_job
from ..distributed.joining import write_credentials
from ..io.partials import partials_in, remove_partials
from .app import main
from .running import _CLUSTER_DEFAULTS, _cluster_options, _cluster_options_given, _run_job

__all__ = ["clean", "demo", "fingerprints_command", "gram_command", "multiply", "similarity_command", "tls_credentials"]


#: ``--method`` of the jobs that count shared bits (gram, similarity).
_method_option = click.option("--method", type=click.Choice(list(METHODS)),
                              default="auto", show_default=True)


def _output_options(func: Callable) -> Callable:
    options = [
        click.option("-o", "--output", required=True, type=click.Path(),
                     help="The .npy file, or Zarr store (a name ending in .zarr), to write."),
        click.option("--overwrite", is_flag=True, help="Replace the output if it exists (a "
                     "file, or a Zarr store: never another directory)."),
        click.option("--compression", default="none", show_default=True,
                     help="Zarr output: none, zstd, gzip or blosc (NAME or NAME:LEVEL)."),
        click.option("--zarr-format", type=click.Choice(["2", "3"]), default="3",
                     show_default=True, help="Zarr output: the format version to write."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@main.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@_output_options
@click.option("--chunk-size", default="200MB", show_default=True,
              help="Bytes per chunk of each input (whole rows).")
@_cluster_options
def multiply(a: str, b: str, output: str, overwrite: bool, compression: str, zarr_format: str,
             chunk_size: str, device: str, as_json: bool, **opts: Any) -> None:
    """C = A * B (NumPy broadcasting) from two .npy files or Zarr stores into OUTPUT, chunk by
    chunk."""
    from dask.utils import parse_bytes


    try:
        if parse_bytes(chunk_size) <= 0:
            raise ValueError
    except (ValueError, TypeError):
        raise click.BadParameter(f"--chunk-size: {chunk_size!r} is not a positive size "
                                 "(e.g. 200MB)") from None
    _run_job(as_json, opts, lambda: multiply_job(
        a, b, output, device=device, chunk_size=chunk_size, overwrite=overwrite,
        compression=compression, zarr_format=int(zarr_format)), device=device)


@main.command("gram")
@click.argument("bits", type=click.Path())
@_output_options
@click.option("--packed", is_flag=True, help="BITS holds packed words (any unsigned dtype, "
              "e.g. np.packbits output), not 0/1 values.")
@_method_option
@click.option("--chunk-rows", type=click.IntRange(min=1),
              help="Rows per chunk (and per output block) [default: 4096, halved while a "
              "block would not fit the GPUs' memory budget].")
@click.option("--layout", type=click.Choice(["auto", "blocks", "rows", "upper"]), default="auto",
              show_default=True, help="blocks: upper blocks, the rest transposed on the host; "
              "rows: each row slab whole in one task; upper: each row slab from the diagonal "
              "rightwards, written also transposed; auto: rows on GPUs with tensor cores "
              "when the packed input is at most 4 GiB, blocks on other GPUs, upper on the CPU.")
@_cluster_options
def gram_command(bits: str, output: str, overwrite: bool, compression: str, zarr_format: str,
                 packed: bool, method: str, chunk_rows: int, layout: str, device: str,
                 as_json: bool, **opts: Any) -> None:
    """G = A · Aᵀ (exact, int32) of the 0/1 matrix in BITS (.npy or .zarr), written to
    OUTPUT."""
    _run_job(as_json, opts, lambda: gram_job(
        bits, output, packed=packed, method=method, device=device, chunk_rows=chunk_rows,
        layout=layout, overwrite=overwrite, compression=compression,
        zarr_format=int(zarr_format)), method=method, device=device)


def _in_process_by_default(opts: dict[str, Any]) -> bool:
    """Whether a job with nothing to spill runs in this process unless told otherwise: no
    cluster option given and at most one GPU visible. A local cluster would add its start and
    close (6-8 s on the GPU machines; the perf notes (git show 85dc246:docs/perf-notes.md), items 26, 28 and 31) and give such a
    job nothing: one GPU's worker, and results of a few bytes a row."""
    return (not opts.get("in_process") and not _cluster_options_given(opts)
            and gpu_count() <= 1)


@main.command("similarity")
@click.argument("fingerprints", type=click.Path())
@click.option("--queries", type=click.Path(), default=None,
              help="Score each row of QUERIES (.npy, .zarr, .fps or FPSim2 .h5) against "
              "FINGERPRINTS; without it, all pairs of FINGERPRINTS.")
@click.option("--metric", type=click.Choice(["tanimoto", "jaccard", "dice", "cosine", "tversky",
                                             "hamming", "counts"]),
              default="tanimoto", show_default=True)
@click.option("--alpha", type=click.FloatRange(min=0), default=None,
              help="Tversky's weight of what only a row has (--metric tversky) [default: 1].")
@click.option("--beta", type=click.FloatRange(min=0), default=None,
              help="Tversky's weight of what only the other row has [default: --alpha].")
@click.option("--top-k", type=click.IntRange(min=1), default=None,
              help="Each row's K best: OUTPUT a .npz of indices and scores (n x K). With "
              "--threshold: the K best that meet it, index -1 and score NaN (-1 for hamming "
              "and counts) in the places of the missing.")
@click.option("--threshold", type=float, default=None,
              help="Every pair scoring at least T (at most T for hamming): OUTPUT a .npz of "
              "rows, cols and scores. With --top-k: a bound on the K best.")
@click.option("--dense", is_flag=True, help="Every score: OUTPUT a .npy or Zarr store (the "
              "default where neither --top-k nor --threshold is given).")
@click.option("--include-self", is_flag=True, help="All pairs: keep each row's pair with "
              "itself (left out by default).")
@_output_options
@click.option("--packed", is_flag=True, help="The inputs hold packed words (any unsigned "
              "dtype, e.g. np.packbits output), not 0/1 values.")
@_method_option
@click.option("--chunk-rows", type=click.IntRange(min=1),
              help="Rows per chunk of each input [default: 32768 on GPUs, halved while a "
              "block would not fit their memory budget; 4096 on the CPU].")
@click.option("--local-cluster", "use_local_cluster", is_flag=True,
              help="Start a local cluster even for --top-k and --threshold on one GPU (or "
              "none), which run in this process by default.")
@_cluster_options
def similarity_command(fingerprints: str, queries: str | None, metric: str,
                       alpha: float | None, beta: float | None, top_k: int | None,
                       threshold: float | None, dense: bool, include_self: bool, output: str,
                       overwrite: bool, compression: str, zarr_format: str, packed: bool,
                       method: str, chunk_rows: int | None, device: str, as_json: bool,
                       use_local_cluster: bool, **opts: Any) -> None:
    """Similarity of the binary rows in FINGERPRINTS (.npy or .zarr; or chemfp's .fps or an
    FPSim2 .h5, whose molecules' ids then go into OUTPUT beside the results): each row's top
    K, the pairs over a threshold, or every score, exact, written to OUTPUT.

    Top-k and threshold jobs keep a few bytes a row and spill nothing: with no cluster option
    and one GPU or none, they run in this process (as --in-process); --local-cluster starts a
    cluster all the same. Dense scores and several GPUs take a local cluster."""
    if dense and (top_k is not None or threshold is not None):
        raise click.UsageError("--dense writes every score; leave out --top-k and --threshold")
    if metric != "tversky" and (alpha is not None or beta is not None):
        raise click.UsageError("--alpha and --beta weigh --metric tversky only")
    if use_local_cluster and opts.get("in_process"):
        raise click.UsageError("give --local-cluster or --in-process, not both")
    joined = [f"--{k.replace('_', '-')}" for k in ("scheduler_file", "scheduler_address")
              if opts.get(k)]
    if use_local_cluster and joined:
        raise click.UsageError(f"--local-cluster starts a cluster; {joined[0]} joins one")
    if (not use_local_cluster and (top_k is not None or threshold is not None)
            and _in_process_by_default(opts)):
        opts["in_process"] = True
    _run_job(as_json, opts, lambda: similarity_job(
        fingerprints, output, queries=queries, metric=metric, top_k=top_k,
        threshold=threshold, packed=packed,
        exclude_self=(not include_self) if queries is None else None, method=method,
        device=device, chunk_rows=chunk_rows, overwrite=overwrite, compression=compression,
        zarr_format=int(zarr_format), alpha=alpha, beta=beta), method=method, device=device)


@main.command("fingerprints")
@click.argument("smiles", type=click.Path())
@click.option("-o", "--output", required=True, type=click.Path(),
              help="An .fps file (fingerprints and the molecules' ids, which the similarity "
              "job then writes beside its results) or a .npy of the packed words alone.")
@click.option("--kind", type=click.Choice(list(FINGERPRINT_KINDS)), default="morgan",
              show_default=True, help="RDKit's fingerprint generator.")
@click.option("--bits", type=click.IntRange(min=8), default=2048, show_default=True,
              help="Bits a fingerprint (a multiple of 8).")
@click.option("--radius", type=click.IntRange(min=0), default=2, show_default=True,
              help="Morgan's radius (2: ECFP4).")
@click.option("--overwrite", is_flag=True, help="Replace the output if it exists.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON line summarising the job, and no progress bar.")
def fingerprints_command(smiles: str, output: str, kind: str, bits: int, radius: int,
                         overwrite: bool, as_json: bool) -> None:
    """Fingerprints of the molecules in SMILES (a .smi file: SMILES and id a line) through
    RDKit (pip install rdkit), in a process per core, packed into OUTPUT for the similarity
    job: dask-gpuchunk fingerprints mols.smi -o fps.fps, then dask-gpuchunk similarity fps.fps
    --top-k 10 -o nn.npz (its .npz then holds the ids)."""
    from ..jobs.fingerprints import fingerprints_job

    opts = {**_CLUSTER_DEFAULTS, "in_process": True, "worker_timeout": 60}
    _run_job(as_json, opts, lambda: fingerprints_job(smiles, output, kind=kind, bits=bits,
                                                     radius=radius, overwrite=overwrite))


@main.command()
@click.option("--rows", default=500_000, show_default=True, type=click.IntRange(min=1),
              help="Rows of the two float64 inputs of the product.")
@click.option("--cols", default=50, show_default=True, type=click.IntRange(min=1))
@click.option("--bit-rows", default=4000, show_default=True, type=click.IntRange(min=1),
              help="Rows of the 0/1 matrix of the Gram job.")
@click.option("--bits", default=20_000, show_default=True, type=click.IntRange(min=1),
              help="Columns of the 0/1 matrix.")
@click.option("--workdir", type=click.Path(file_okay=False),
              help="Keep the files here (default: a temporary directory, removed).")
@_cluster_options
def demo(rows: int, cols: int, bit_rows: int, bits: int, workdir: str | None, device: str,
         as_json: bool, **opts: Any) -> None:
    """The main job on an embedded default: synthetic inputs, multiply and gram through .npy
    files on a cluster, sampled results checked against NumPy, figures printed."""
    log = (lambda s: None) if as_json else (lambda s: click.echo(s, err=True))
    _run_job(as_json, opts, lambda: lambda progress: jobs.demo(
        rows=rows, cols=cols, bit_rows=bit_rows, bits=bits, workdir=workdir, device=device,
        progress=progress, log=log))


@main.command("tls-credentials")
@click.argument("directory", type=click.Path(file_okay=False))
def tls_credentials(directory: str) -> None:
    """Write TLS credentials for a batch cluster into DIRECTORY (made, readable by you only):
    ca.pem, cert.pem and key.pem, which its scheduler, workers and jobs all present
    (--tls-ca-file, --tls-cert, --tls-key). Only holders of the key can then join it."""
    try:
        paths = write_credentials(directory)
    except (OSError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(4)
    for name, path in paths.items():
        click.echo(f"{name}: {path}")


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--dry-run", is_flag=True, help="List only; remove nothing.")
@click.option("--force", is_flag=True, help="Also remove partial files whose writer cannot be "
              "checked from here (written on another host); never one that a running process "
              "on this host writes, nor a name without the package's dgc tag.")
def clean(directory: str, dry_run: bool, force: bool) -> None:
    """List the temporary files (.partial) that killed jobs left in DIRECTORY and remove those
    whose writer is gone."""
    found = partials_in(directory)
    if not found:
        click.echo(f"no partial files in {directory}")
        return
    # Each file gets one line below; the log hears only the files that could not go.
    removed = set() if dry_run else {p.path for p in remove_partials(
        found, unknown=force, log=lambda s: click.echo(f"warning: {s}", err=True),
        log_removals=False)}
    for p in found:
        done = ("removed" if p.path in removed else
                "would remove" if dry_run and p.writer is not None and (
                    p.state() == "gone" or force and p.state() == "unknown") else "kept")
        hint = (" (--force removes it)" if done == "kept" and p.writer is not None
                and p.state() == "unknown" else "")
        click.echo(f"{done}: {p.path.name}, {format_bytes(p.nbytes)}, {p.describe()}{hint}")
