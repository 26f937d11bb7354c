"""The ``fingerprints`` job: a SMILES file to packed fingerprints (chemfp's ``.fps``, with the
molecules' ids, or a ``.npy`` of the words alone) that the similarity job reads."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..io import temporary_output
from ..io.files import publish
from ..io.fingerprint_files import (
    FINGERPRINT_KINDS,
    Fingerprints,
    read_smiles,
    smiles_fingerprints,
    write_fps,
)
from .common import InputError, Job, OutputError, Progress, _check_output

__all__ = ["fingerprints_job"]

#: How many ids of SMILES RDKit could not parse the summary names.
UNPARSED_NAMED = 5


def fingerprints_job(smiles: str | os.PathLike, out: str | os.PathLike, *,
                     kind: str = "morgan", bits: int = 2048, radius: int = 2,
                     overwrite: bool = False) -> Job:
    """Check the files of a fingerprints job now; return the job, to run as ``job(progress)``.

    ``smiles``: a SMILES file (``SMILES id`` a line). ``out``: an ``.fps`` file (fingerprints
    and ids; the similarity job then writes the ids beside its results) or a ``.npy`` of the
    packed words (``uint8``, ``bits / 8`` a row; the ids are not kept). SMILES that RDKit cannot
    parse are left out, and named in the summary.
    """
    if kind not in FINGERPRINT_KINDS:
        raise ValueError(f"--kind must be one of {', '.join(FINGERPRINT_KINDS)}; got {kind!r}")
    if not isinstance(bits, int) or bits < 8 or bits % 8:
        raise ValueError(f"--bits must be a multiple of 8; got {bits!r}")
    suffix = Path(out).suffix.lower()
    if suffix not in (".fps", ".npy"):
        raise OutputError(f"output {out}: fingerprints go to an .fps file (with the molecules' "
                          "ids) or a .npy file (the words alone)")
    if not os.path.isfile(smiles):
        raise InputError(f"input {smiles}: no such file")
    target = _check_output(out, [smiles], overwrite, 0, {})

    def run(progress: Progress) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            molecules, ids = read_smiles(smiles)
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"input {smiles}: {exc}") from None
        report = (None if progress is None
                  else (lambda done, total: progress(done, total, "molecules")))
        words, parsed = smiles_fingerprints(molecules, kind=kind, bits=bits, radius=radius,
                                            progress=report)
        kept = Fingerprints(words[parsed], ids[parsed], bits)
        if suffix == ".fps":
            type_ = f"RDKit-{kind}" + (f" radius={radius}" if kind == "morgan" else "")
            write_fps(target, kept, type_=f"{type_} fpSize={bits}", overwrite=overwrite)
        else:
            with temporary_output(target) as (tmp, fd, key):
                with open(fd, "wb", closefd=False) as f:
                    np.save(f, kept.words)
                publish(tmp, target, key, overwrite)
        seconds = time.perf_counter() - t0
        unparsed = ids[~parsed]
        return {
            "command": "fingerprints",
            "inputs": [{"path": str(smiles), "molecules": len(molecules)}],
            "output": {"path": str(target), "shape": list(kept.words.shape), "dtype": "uint8"},
            "kind": kind, "bits": bits, "radius": radius,
            "unparsed": int(unparsed.size),
            "unparsed_ids": [str(i) for i in unparsed[:UNPARSED_NAMED]],
            "seconds": seconds,
            "molecules_per_s": len(molecules) / seconds if seconds else None,
        }

    return run
