"""What the command-line tests share: a job run as a user runs it, the inputs they write, the
leftovers a killed job may leave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from helpers import random_bits

__all__ = ["PYTHON", "leftovers", "run_cli", "setup_bad", "write_inputs"]

PYTHON = [sys.executable, "-m", "dask_gpuchunk"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command in a fresh process, as a user runs it."""
    return subprocess.run([*PYTHON, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def write_inputs(rng: np.random.Generator, d: Path) -> tuple[Path, np.ndarray, np.ndarray, np.ndarray]:
    """The jobs' inputs in ``d``: a, b (a row that broadcasts), 0/1 bits and them packed."""
    a = rng.random((2000, 30))
    b = rng.random((1, 30))  # broadcast along the rows
    bits = random_bits(rng, (300, 1043), 0.4)
    for name, arr in (("a", a), ("b", b), ("bits", bits)):
        np.save(d / f"{name}.npy", arr)
    np.save(d / "packed.npy", np.packbits(bits, axis=1))
    return d, a, b, bits


def setup_bad(d: Path) -> None:
    """The bad-input cases' files in ``d``."""
    np.save(d / "a.npy", np.ones((10, 4)))
    np.save(d / "b.npy", np.ones((10, 4)))
    np.save(d / "mismatch.npy", np.ones((7, 4)))
    np.save(d / "half.npy", np.ones((10, 4), np.float16))
    np.save(d / "strings.npy", np.array(["a", "b"]))
    np.save(d / "obj.npy", np.array([{}, 1], dtype=object))
    np.save(d / "vec.npy", np.ones(10, np.uint8))
    np.save(d / "floats.npy", np.ones((4, 9)))
    np.save(d / "signed.npy", np.ones((4, 9), np.int16))
    bad_bits = np.ones((6, 70), np.uint8)
    bad_bits[4, 66] = 2
    np.save(d / "badbits.npy", bad_bits)
    np.save(d / "bits.npy", np.ones((6, 70), np.uint8))
    np.save(d / "bits71.npy", np.ones((3, 71), np.uint8))
    np.save(d / "norows.npy", np.ones((0, 70), np.uint8))
    (d / "zerochunks.zarr").mkdir()
    (d / "zerochunks.zarr" / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [4, 4], "chunks": [0, 4], "dtype": "<f8", "order": "C",
        "compressor": None, "filters": None, "fill_value": 0}))
    np.save(d / "exists.npy", np.zeros(3))
    np.save(d / "long.npy", np.ones((200_001, 1)))
    (d / "text.npy").write_text("not numpy at all")
    (d / "empty.npy").write_bytes(b"")
    np.save(d / "trunc.npy", np.ones((100, 100)))
    os.truncate(d / "trunc.npy", 500)
    (d / "corrupt.npy").write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': nonsense")
    # A header that claims 2**64 bytes (which wraps to 0 in int64) in a 128-byte file.
    text = repr({"descr": "|u1", "fortran_order": False, "shape": (2**32, 2**32)}).encode()
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    (d / "liar.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text)
    os.mkfifo(d / "fifo.npy")
    (d / "empty.json").write_text("")
    (d / "garbage.json").write_text("garbage{")
    (d / "noaddr.json").write_text('{"type": "Scheduler"}')
    (d / "adir").mkdir()
    (d / "readonly").mkdir()
    os.chmod(d / "readonly", 0o500)


def leftovers(d: Path) -> list[str]:
    """The job's temporary files left in ``d``."""
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".partial"))
