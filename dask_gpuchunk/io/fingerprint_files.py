"""Fingerprints in the forms chemists have them: chemfp's FPS files, SMILES files through
RDKit, and lists of RDKit bit vectors, as packed words (``uint8`` rows, bit ``i`` of a
fingerprint in bit ``i % 8`` of byte ``i // 8``: chemfp's and RDKit's FPS order) with the
molecules' ids beside them.

Tanimoto, Dice, cosine and Hamming count bits, so any one bit order serves as long as every
fingerprint compared has it; FPS files written by chemfp, RDKit or :func:`write_fps` all do.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .files import publish
from .npy_writing import temporary_output

__all__ = ["FINGERPRINT_KINDS", "FpsError", "Fingerprints", "bit_vector_words", "bit_vectors_as_words",
           "is_bit_vector_list", "read_fpsim2", "read_fps", "read_smiles",
           "smiles_fingerprints", "write_fps", "write_fpsim2"]

#: The fingerprints :func:`smiles_fingerprints` makes (RDKit's generators).
FINGERPRINT_KINDS = ("morgan", "rdkit", "atompair", "torsion")

#: Molecules per chunk of :func:`smiles_fingerprints`.
_MOLECULES_PER_CALL = 20_000


class FpsError(ValueError):
    """An FPS (or FPSim2) file that cannot be read: names the file, the line and what is
    wrong."""


class Fingerprints(NamedTuple):
    """Packed fingerprints ``words`` (``uint8`` ``(n, bytes)``), their ``ids`` (``str``
    ``(n,)``) and their width in bits."""

    words: np.ndarray
    ids: np.ndarray
    num_bits: int


def is_bit_vector_list(x: Any) -> bool:
    """Whether ``x`` is a list or tuple of RDKit bit vectors (``ExplicitBitVect``)."""
    return (isinstance(x, (list, tuple)) and len(x) > 0
            and type(x[0]).__name__ in ("ExplicitBitVect", "SparseBitVect")
            and hasattr(x[0], "GetNumBits"))


def bit_vector_words(vectors: Sequence[Any]) -> np.ndarray:
    """RDKit bit vectors as packed words, ``uint8`` ``(n, ceil(bits / 8))``; all must have
    one width.

    Examples
    --------
    >>> from rdkit import DataStructs
    >>> v = DataStructs.ExplicitBitVect(12); v.SetBitsFromList([0, 9])
    >>> bit_vector_words([v, DataStructs.ExplicitBitVect(12)])
    array([[1, 2],
           [0, 0]], dtype=uint8)
    """
    from rdkit import DataStructs

    widths = {v.GetNumBits() for v in vectors}
    if len(widths) != 1:
        raise ValueError(f"the bit vectors have different widths: {sorted(widths)}")
    (bits,) = widths
    hexes = "".join(DataStructs.BitVectToFPSText(v) for v in vectors)
    return np.frombuffer(bytes.fromhex(hexes), dtype=np.uint8).reshape(len(vectors),
                                                                        -(-bits // 8)).copy()


def bit_vectors_as_words(x: Any, y: Any, packed: bool) -> tuple[Any, Any, bool]:
    """An operator's inputs ``x`` and ``y`` (``y`` may be ``None``) with lists of RDKit bit
    vectors as packed words, and whether they hold packed words now; both such lists, or
    neither (``TypeError``)."""
    given = [is_bit_vector_list(v) for v in (x, y) if v is not None]
    if not any(given):
        return x, y, packed
    if not all(given):
        raise TypeError("give x and y both as lists of RDKit bit vectors, or neither")
    return bit_vector_words(x), None if y is None else bit_vector_words(y), True


def read_fps(path: str | os.PathLike) -> Fingerprints:
    """A chemfp FPS file (``#FPS1`` header lines, then ``HEX<tab>ID`` a line): its
    fingerprints and ids, read whole (a million 2048-bit fingerprints: 0.5 GB of text, 256 MB
    of words).

    Raises
    ------
    FpsError
        Not an FPS file, hex that is not hex or of another width than the first line's (or
        than ``#num_bits``), a line without an id; each names the line.
    """
    path = Path(path)
    with open(path, "rb") as f:
        text = f.read()
    lines = text.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    header: dict[str, str] = {}
    first = 0
    for first, line in enumerate(lines):  # noqa: B007 - the first data line is wanted after
        if not line.startswith(b"#"):
            break
        name, _, value = line[1:].decode("utf-8", "replace").strip().partition("=")
        header[name] = value
    else:
        first = len(lines)
    if lines and not lines[0].startswith(b"#FPS1"):
        raise FpsError(f"{path} is not an FPS file: its first line is not #FPS1")
    data = [line.rstrip(b"\r") for line in lines[first:]]
    if not data:
        bits = int(header.get("num_bits", 0) or 0)
        return Fingerprints(np.zeros((0, -(-bits // 8)), np.uint8), np.array([], dtype=str),
                            bits)
    width = data[0].find(b"\t")
    if width <= 0 or width % 2:
        raise FpsError(f"{path}, line {first + 1}: expected HEX<tab>ID")
    bits = int(header.get("num_bits", width * 4))
    if -(-bits // 8) * 2 != width:
        raise FpsError(f"{path}: #num_bits={bits} but line {first + 1} holds {width * 4} bits")
    for i, line in enumerate(data):
        if len(line) <= width or line[width:width + 1] != b"\t":
            raise FpsError(f"{path}, line {first + i + 1}: expected {width} hex digits, a tab "
                           "and an id")
    try:
        words = bytes.fromhex(b"".join(line[:width] for line in data).decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        for i, line in enumerate(data):
            try:
                bytes.fromhex(line[:width].decode("ascii"))
            except (ValueError, UnicodeDecodeError):
                raise FpsError(f"{path}, line {first + i + 1}: not hex digits") from None
        raise
    ids = np.array([line[width + 1:].split(b"\t")[0].decode("utf-8") for line in data])
    return Fingerprints(np.frombuffer(words, np.uint8).reshape(len(data), width // 2).copy(),
                        ids, bits)


#: Each byte's bits in reverse order.
_REVERSED_BITS = np.array([int(f"{b:08b}"[::-1], 2) for b in range(256)], dtype=np.uint8)

#: Rows of an FPSim2 table read at once.
_FPSIM2_ROWS = 1 << 16


def read_fpsim2(path: str | os.PathLike) -> Fingerprints:
    """An FPSim2 database (``.h5``, PyTables: ``pip install tables``, which FPSim2 needs too):
    its fingerprints in FPS bit order (FPSim2 keeps bit ``i`` of a fingerprint at bit
    ``63 - i % 64`` of its word ``i // 64``) and its ``fp_id`` as the ids, in the file's row
    order (FPSim2 sorts its rows by popcount)."""
    try:
        import tables
    except ImportError:
        raise ImportError("reading an FPSim2 .h5 needs PyTables: pip install tables") from None
    try:
        with tables.open_file(os.fspath(path), mode="r") as f:
            table = f.root.fps
            names = [n for n in table.colnames if n[:1] == "f" and n[1:].isdigit()]
            if not names or "fp_id" not in table.colnames:
                raise FpsError(f"{path} is not an FPSim2 database: its fps table has no "
                               "fp_id and f1, f2, ... columns")
            names.sort(key=lambda n: int(n[1:]))
            config = f.root.config[:] if "config" in f.root else []
            words = np.empty((table.nrows, 8 * len(names)), dtype=np.uint8)
            ids = np.empty(table.nrows, dtype=np.int64)
            for start in range(0, table.nrows, _FPSIM2_ROWS):
                rows = table.read(start, min(start + _FPSIM2_ROWS, table.nrows))
                stacked = np.stack([rows[n] for n in names], axis=1).astype(">u8")
                words[start:start + len(rows)] = _REVERSED_BITS[stacked.view(np.uint8)]
                ids[start:start + len(rows)] = rows["fp_id"]
    except (tables.HDF5ExtError, tables.NoSuchNodeError, OSError) as exc:
        raise FpsError(f"{path} is not an FPSim2 database ({exc})") from None
    params = config[1] if len(config) > 1 and isinstance(config[1], dict) else {}
    bits = int(params.get("fpSize", params.get("nBits", 64 * len(names))))
    return Fingerprints(words, ids, bits)


def write_fpsim2(path: str | os.PathLike, fingerprints: Fingerprints, *,
                 fp_type: str = "Morgan", fp_params: dict[str, Any] | None = None,
                 overwrite: bool = False) -> None:
    """``fingerprints`` (integer ids) as an FPSim2 database that FPSim2's engines load, sorted
    by popcount as FPSim2 sorts its own (FPSim2 and PyTables needed: ``pip install fpsim2``).
    ``fp_type`` and ``fp_params`` are what FPSim2 records (and uses for SMILES queries);
    queries given as RDKit bit vectors need only the width to match. An existing ``path`` is
    replaced only with ``overwrite``."""
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    try:
        import tables
        from FPSim2 import __version__ as fpsim2_version
        from FPSim2.io.backends.pytables import create_schema, sort_db_file
    except ImportError:
        raise ImportError("writing an FPSim2 database needs FPSim2: pip install fpsim2") from None
    words, ids, bits = fingerprints
    width = -(-bits // 64)
    padded = np.zeros((len(words), 8 * width), dtype=np.uint8)
    padded[:, :words.shape[1]] = words
    # FPS order back to FPSim2's: each byte's bits reversed, each 8 bytes one big-endian word.
    fpsim2_words = _REVERSED_BITS[padded].view(">u8").astype(np.uint64)
    popcounts = np.bitwise_count(padded).sum(axis=1, dtype=np.int64)
    try:
        import rdkit
        rdkit_version = rdkit.__version__
    except ImportError:
        rdkit_version = ""
    filters = tables.Filters(complib="blosc2", complevel=9, fletcher32=False)
    with tables.open_file(os.fspath(path), mode="w") as f:
        table = f.create_table(f.root, "fps", create_schema(bits), "Table storing fps",
                               filters=filters)
        config = f.create_vlarray(f.root, "config", atom=tables.ObjectAtom())
        for item in (fp_type, fp_params or {"radius": 2, "fpSize": bits}, rdkit_version,
                     fpsim2_version):
            config.append(item)
        for start in range(0, len(words), _FPSIM2_ROWS):
            stop = min(start + _FPSIM2_ROWS, len(words))
            table.append([(int(i), *map(int, row), int(c)) for i, row, c in
                          zip(ids[start:stop], fpsim2_words[start:stop], popcounts[start:stop])])
        table.cols.popcnt.create_index(kind="full")
    sort_db_file(os.fspath(path))


def write_fps(path: str | os.PathLike, fingerprints: Fingerprints, *, type_: str = "",
              overwrite: bool = False) -> None:
    """``fingerprints`` as an FPS file, written beside ``path`` and renamed onto it when
    complete (never half-written; an existing file replaced only with ``overwrite``)."""
    words, ids, bits = fingerprints
    head = f"#FPS1\n#num_bits={bits}\n" + (f"#type={type_}\n" if type_ else "")
    all_hex, width = np.ascontiguousarray(words).tobytes().hex(), 2 * words.shape[1]
    body = "".join(f"{all_hex[r * width:(r + 1) * width]}\t{i}\n" for r, i in enumerate(ids))
    target = Path(path)
    with temporary_output(target) as (tmp, fd, key):
        with open(fd, "w", closefd=False, encoding="utf-8") as f:
            f.write(head + body)
        publish(tmp, target, key, overwrite)


def read_smiles(path: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """A SMILES file: ``SMILES [id]`` a line (whitespace between; blank lines and ``#``
    lines skipped; a line without an id gets its line number). Returns the SMILES and ids."""
    smiles, ids = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            parts = line.split(None, 1)
            if not parts or parts[0].startswith("#"):
                continue
            smiles.append(parts[0])
            ids.append(parts[1].strip() if len(parts) > 1 else str(number))
    return smiles, np.array(ids, dtype=str)


def _generator(kind: str, bits: int, radius: int) -> Any:
    from rdkit.Chem import rdFingerprintGenerator as gens

    if kind == "morgan":
        return gens.GetMorganGenerator(radius=radius, fpSize=bits)
    if kind == "rdkit":
        return gens.GetRDKitFPGenerator(fpSize=bits)
    if kind == "atompair":
        return gens.GetAtomPairGenerator(fpSize=bits)
    if kind == "torsion":
        return gens.GetTopologicalTorsionGenerator(fpSize=bits)
    raise ValueError(f"kind must be one of {', '.join(FINGERPRINT_KINDS)}; got {kind!r}")


def smiles_fingerprints(smiles: Sequence[str], *, kind: str = "morgan", bits: int = 2048,
                        radius: int = 2, processes: int | None = None,
                        progress: Callable[[int, int], None] | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """RDKit fingerprints of ``smiles`` as packed words ``uint8`` ``(n, bits / 8)``, and a
    boolean mask of the SMILES RDKit could parse (the others' rows are all zeros).

    RDKit parses SMILES holding Python's lock (~90 us a drug-like molecule): chunks of
    :data:`_MOLECULES_PER_CALL` run in ``processes`` processes (default: one per core where
    there are several chunks, else this one). ``progress(done, total)`` is called as chunks
    finish.

    Examples
    --------
    >>> words, parsed = smiles_fingerprints(["CCO", "not a molecule", "c1ccccc1"], bits=64)
    >>> words.shape, parsed.tolist(), int(words[1].sum())
    ((3, 8), [True, False, True], 0)
    """
    if not isinstance(bits, int) or bits < 1 or bits % 8:
        raise ValueError(f"bits must be a positive multiple of 8; got {bits!r}")
    _generator(kind, bits, radius)  # an unknown kind refused here, not in a process
    starts = range(0, len(smiles), _MOLECULES_PER_CALL)
    chunks = [list(smiles[i:i + _MOLECULES_PER_CALL]) for i in starts]
    processes = min(len(chunks), processes or os.cpu_count() or 1)
    words = np.zeros((len(smiles), bits // 8), dtype=np.uint8)
    parsed = np.zeros(len(smiles), dtype=bool)
    done = 0

    def keep(start: int, result: tuple[np.ndarray, np.ndarray]) -> None:
        nonlocal done
        words[start:start + len(result[0])], parsed[start:start + len(result[1])] = result
        done += len(result[0])
        if progress is not None:
            progress(done, len(smiles))

    if processes <= 1:
        for start, chunk in zip(starts, chunks):
            keep(start, _chunk_fingerprints(chunk, kind, bits, radius))
        return words, parsed
    # spawn: a fork of a process with threads (Dask's, RDKit's) may hold a lock forever.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        running = {pool.submit(_chunk_fingerprints, chunk, kind, bits, radius): start
                   for start, chunk in zip(starts, chunks)}
        for future in concurrent.futures.as_completed(running):
            keep(running[future], future.result())
    return words, parsed


def _chunk_fingerprints(smiles: list[str], kind: str, bits: int, radius: int
                        ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`smiles_fingerprints` of one chunk, in this process."""
    from rdkit import Chem, DataStructs, RDLogger

    generator = _generator(kind, bits, radius)
    words = np.zeros((len(smiles), bits // 8), dtype=np.uint8)
    RDLogger.DisableLog("rdApp.*")  # a bad SMILES is reported by the mask, not on stderr
    try:
        mols = [Chem.MolFromSmiles(s) for s in smiles]
    finally:
        RDLogger.EnableLog("rdApp.*")
    parsed = np.array([m is not None for m in mols], dtype=bool)
    good = [m for m in mols if m is not None]
    if good:
        hexes = "".join(DataStructs.BitVectToFPSText(v)
                        for v in generator.GetFingerprints(good, numThreads=1))
        words[parsed] = np.frombuffer(bytes.fromhex(hexes), np.uint8).reshape(len(good), -1)
    return words, parsed
