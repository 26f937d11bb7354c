"""A Zarr store written as the ``.npy`` outputs are: private while written, never written
through a name someone else controls, published only if it is still the store the job made.

The job makes its temporary store (``.<name>.dgc-<writer>.partial``) as a directory of mode
0700 and keys it by device, inode and owner (:func:`dask_gpuchunk.io.files.file_key`). Every
write, by whichever worker, opens the store's directory without following a symlink, checks its
key, and creates each chunk below that descriptor (``openat``), every path component opened
with ``O_NOFOLLOW``: a store renamed away and replaced by another directory (one of symlinks,
say) is never written into, and a replaced store is never published (:class:`FileReplacedError`,
the jobs' exit 4). zarr is used as an encoder only: a chunk is encoded by an array of the same
metadata in memory and its bytes written here; chunks stored raw (uncompressed, little-endian)
are written straight from the block's memory. Every chunk is written, those equal to the fill
value too, and the store's attributes say so (:data:`WRITER_ATTRIBUTE`): a reader then tells a
missing chunk for damage, not for the fill value. Compressed stores carry a CRC32C checksum of
every chunk.

``--overwrite`` replaces only a Zarr array whose every entry is zarr's own
(:func:`check_replaceable`): anything else in it is named, and nothing is removed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .._kernels.gram import c_ordered
from .files import FileReplacedError, check_published, exchange, file_key, rename_own

__all__ = ["COMPRESSIONS", "WRITER_ATTRIBUTE", "StoreTarget", "check_compression",
           "check_replaceable", "chunk_key_parser", "create_store", "open_store",
           "publish_store", "remove_store", "write_chunks"]

#: The compressions ``to_zarr`` and the jobs' ``--compression`` take (``NAME`` or
#: ``NAME:LEVEL``).
COMPRESSIONS = ("none", "zstd", "gzip", "blosc")

#: The compression levels each compressor takes.
_LEVELS = {"zstd": range(1, 23), "gzip": range(0, 10), "blosc": range(0, 10)}


def check_compression(compression: str, zarr_format: int) -> tuple[str, int | None]:
    """``(name, level)`` of ``NAME[:LEVEL]`` (:data:`COMPRESSIONS`); ``ValueError`` for an
    unknown name, a level that is not a whole number of the compressor's range, or a format
    other than 2 and 3.

    Examples
    --------
    >>> check_compression("zstd:7", 3), check_compression("none", 2)
    (('zstd', 7), ('none', None))
    >>> check_compression("zstd:99", 3)
    Traceback (most recent call last):
    ...
    ValueError: compression level 99 of zstd is out of its range, 1 to 22
    """
    if zarr_format not in (2, 3):
        raise ValueError(f"zarr_format must be 2 or 3, got {zarr_format!r}")
    name, _, level = compression.partition(":")
    if name not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)} (NAME or "
                         f"NAME:LEVEL); got {compression!r}")
    if not level:
        return name, None
    try:
        value = int(level)
    except ValueError:
        raise ValueError(f"compression level {level!r} is not a whole number") from None
    levels = _LEVELS.get(name)
    if levels is None:
        raise ValueError("compression 'none' takes no level")
    if value not in levels:
        raise ValueError(f"compression level {value} of {name} is out of its range, "
                         f"{levels.start} to {levels.stop - 1}")
    return name, value


#: The attribute this package writes into its stores: ``{"all_chunks": true, "shape": [...]}``.
WRITER_ATTRIBUTE = "dask_gpuchunk"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StoreTarget(NamedTuple):
    """A temporary store being written: its path, its directory's key, and the parameters its
    array was made with (:func:`create_store`), from which each process makes its encoder."""

    root: str
    key: tuple[int, int, int]
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    compression: str
    zarr_format: int


def _compressors(compression: str, zarr_format: int) -> tuple[Any, Any]:
    """zarr's ``(compressors, filters)`` for ``NAME[:LEVEL]``: a compressed store's chunks end
    in a CRC32C checksum (format 3: a codec after the compressor; format 2: a filter before
    it, which checks the decompressed bytes)."""
    name, level = check_compression(compression, zarr_format)
    if name == "none":
        return None, None
    if zarr_format == 2:
        import numcodecs

        compressor = {"zstd": lambda: numcodecs.Zstd(level=3 if level is None else level),
                      "gzip": lambda: numcodecs.GZip(level=5 if level is None else level),
                      "blosc": lambda: numcodecs.Blosc(
                          cname="zstd", clevel=5 if level is None else level)}[name]()
        return compressor, [numcodecs.CRC32C()]
    from zarr import codecs

    compressor = {"zstd": lambda: codecs.ZstdCodec(level=3 if level is None else level),
                  "gzip": lambda: codecs.GzipCodec(level=5 if level is None else level),
                  "blosc": lambda: codecs.BloscCodec(
                      cname="zstd", clevel=5 if level is None else level)}[name]()
    return [compressor, codecs.Crc32cCodec()], None


def _new_encoder(target: StoreTarget) -> tuple[Any, dict]:
    """An array of ``target``'s metadata in memory, and the dict its store keeps keys in."""
    import zarr
    from zarr.storage import MemoryStore

    kept: dict = {}
    compressors, filters = _compressors(target.compression, target.zarr_format)
    options: dict[str, Any] = {"compressors": compressors}
    if filters is not None:
        options["filters"] = filters
    array = zarr.create_array(MemoryStore(kept), shape=target.shape, chunks=target.chunks,
                              dtype=np.dtype(target.dtype), fill_value=0,
                              zarr_format=target.zarr_format,
                              config={"write_empty_chunks": True}, **options)
    return array, kept


_encoders = threading.local()


def _encoder(target: StoreTarget) -> tuple[Any, dict]:
    """This thread's encoder for ``target``'s metadata (made once per thread and store)."""
    cache = getattr(_encoders, "cache", None)
    if cache is None:
        cache = _encoders.cache = {}
    params = target[2:]
    found = cache.get(params)
    if found is None:
        cache.clear()  # one store at a time per thread, as the tasks write them
        found = cache[params] = _new_encoder(target)
    return found


def raw_chunks(metadata: Any, dtype: np.dtype) -> bool:
    """Whether chunks of an array of this zarr ``metadata`` are stored as their values' bytes
    (C order, little-endian, no filter or compressor): then a whole chunk's file is written
    straight from the block's memory."""
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and not np.little_endian):
        return False
    if metadata.zarr_format == 2:
        return metadata.compressor is None and not metadata.filters and metadata.order == "C"
    codecs = getattr(metadata, "codecs", ())
    return (len(codecs) == 1 and type(codecs[0]).__name__ == "BytesCodec"
            and str(getattr(codecs[0].endian, "value", "little") or "little") == "little")


# ---- files below a directory descriptor ---------------------------------------------------


def _open_dir_at(parent: int, name: str, create: bool) -> int:
    """The directory ``name`` below ``parent``, made first where ``create``; never through a
    symlink."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o777, dir_fd=parent)
    return os.open(name, _DIR_FLAGS, dir_fd=parent)


def _write_at(root: int, key: str, pieces: list[memoryview]) -> None:
    """The bytes ``pieces`` into a new file at ``key`` (``"c/0/1"``) below directory ``root``,
    each component opened below the last one without following symlinks."""
    *folders, name = key.split("/")
    opened: list[int] = []
    try:
        parent = root
        for folder in folders:
            parent = _open_dir_at(parent, folder, create=True)
            opened.append(parent)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o666, dir_fd=parent)
        try:
            _write_all(fd, pieces)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        # Only another's hand puts a symlink or a file where the job makes a chunk or folder.
        raise FileReplacedError(exc.errno, f"{key} in the job's temporary store is a symbolic "
                                "link or a file someone put there; nothing is written "
                                "through it") from None
    finally:
        for fd_dir in opened:
            os.close(fd_dir)


def _write_all(fd: int, pieces: list[memoryview]) -> None:
    """Every byte of ``pieces`` to ``fd``, gathered by ``writev`` (short writes resumed)."""
    batch = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
    for start in range(0, len(pieces), batch):
        group = pieces[start:start + batch]
        written = os.writev(fd, group)
        for piece in group:
            if written >= piece.nbytes:
                written -= piece.nbytes
                continue
            rest = piece[written:]
            while rest.nbytes:
                rest = rest[os.write(fd, rest):]
            written = 0


def _open_directory(root: str | os.PathLike, consequence: str) -> int:
    """The job's temporary store ``root`` opened as a directory, not through a symlink:
    :class:`FileReplacedError` (saying ``consequence``) where its name no longer holds a
    directory (moved away, removed, a symlink or a file in its place)."""
    try:
        return os.open(root, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            raise FileReplacedError(exc.errno, f"the job's temporary store {root} was removed "
                                    "or replaced (the job failed or was stopped, or someone "
                                    f"moved it); {consequence}") from None
        raise


def _open_own(target: StoreTarget, consequence: str) -> int:
    """:func:`_open_directory` of the job's store, checked to be the directory the job made
    (its key): :class:`FileReplacedError` (saying ``consequence``) otherwise."""
    fd = _open_directory(target.root, consequence)
    if file_key(os.fstat(fd)) != tuple(target.key):
        os.close(fd)
        raise FileReplacedError(errno.ESTALE, f"the job's temporary store {target.root} was "
                                f"replaced by another directory; {consequence}")
    return fd


@contextlib.contextmanager
def _opened(target: StoreTarget) -> Iterator[int]:
    """The store's directory, opened without following a symlink and checked to be the one
    the job made (:class:`FileReplacedError` otherwise: nothing is written)."""
    fd = _open_own(target, "this chunk is not written")
    try:
        yield fd
    finally:
        os.close(fd)


# ---- the store ------------------------------------------------------------------------------


def create_store(tmp: Path, shape: tuple[int, ...], chunks: tuple[int, ...], dtype: np.dtype,
                 compression: str, zarr_format: int) -> StoreTarget:
    """Make the temporary store ``tmp`` (mode 0700, which must not exist) with its metadata:
    the :class:`StoreTarget` the writing tasks take."""
    os.mkdir(tmp, 0o700)
    # Moved away between the mkdir and the open: what is left there is not the job's.
    fd = _open_directory(tmp, "nothing is written into it")
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077 or os.listdir(fd):
            # Renamed away between the mkdir and the open, another's directory in its place:
            # not ours to write into nor to remove.
            raise FileReplacedError(errno.ESTALE, f"the job's temporary store {tmp} was "
                                    "replaced as it was made; nothing is written into it")
        target = StoreTarget(os.fspath(tmp), file_key(st), tuple(int(n) for n in shape),
                             tuple(int(c) for c in chunks), np.dtype(dtype).str, compression,
                             zarr_format)
        try:
            array, kept = _new_encoder(target)
            array.attrs[WRITER_ATTRIBUTE] = {"all_chunks": True, "shape": list(target.shape)}
            for key, value in kept.items():  # the metadata documents, nothing else yet
                _write_at(fd, key, [memoryview(value.to_bytes())])
        except BaseException:
            remove_store(target, fd)  # a full disk, a Ctrl-C: nothing left behind
            raise
    finally:
        os.close(fd)
    return target


def write_chunks(target: StoreTarget, block: np.ndarray, region: tuple[slice, ...]) -> None:
    """Each chunk of ``region`` (aligned to chunk boundaries) from the host ``block``, into
    the store ``target`` names (:func:`_opened`): a whole chunk of a raw store straight from
    the block, the rest (edge chunks, which zarr stores padded, and encoded stores) encoded in
    memory first."""
    if block.size == 0:  # the upper layout's last strip has nothing under the diagonal
        return
    array, kept = _encoder(target)
    raw = raw_chunks(array.metadata, np.dtype(target.dtype))
    chunks, shape = target.chunks, target.shape
    first = [r.start // c for r, c in zip(region, chunks)]
    last = [-(-r.stop // c) for r, c in zip(region, chunks)]
    with _opened(target) as root:
        for coords in np.ndindex(*(b - a for a, b in zip(first, last))):
            coords = tuple(a + i for a, i in zip(first, coords))
            lo = [c * size for c, size in zip(coords, chunks)]
            hi = [min(a + size, n) for a, size, n in zip(lo, chunks, shape)]
            local = tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, region))
            key = array.metadata.encode_chunk_key(coords)
            if raw and all(b - a == size for a, b, size in zip(lo, hi, chunks)):
                _write_at(root, key, _pieces(block[local]))
                continue
            array[tuple(slice(a, b) for a, b in zip(lo, hi))] = block[local]
            _write_at(root, key, [memoryview(kept.pop(key).to_bytes())])


def _pieces(data: np.ndarray) -> list[memoryview]:
    """``data``'s bytes in C order: its rows where only the leading axes are strided (no
    copy), else one contiguous piece."""
    if data.ndim >= 2 and not data.flags.c_contiguous and data[0].flags.c_contiguous:
        return [memoryview(np.ascontiguousarray(row)).cast("B") for row in data]
    return [memoryview(c_ordered(data)).cast("B")]


def _umask() -> int:
    """This process's umask, read without changing it where Linux tells it."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_store(target: StoreTarget, dest: Path, overwrite: bool) -> None:
    """Rename the finished store onto ``dest``, only if its name still holds the directory
    the job made (:class:`FileReplacedError` otherwise, nothing published). Without
    ``overwrite`` never over anything; with it, only over a Zarr array of zarr's entries alone
    (:func:`check_replaceable`), swapped in one step where the file system can, the old store
    then removed."""
    root = Path(target.root)
    # Checked and made readable through one descriptor: a store moved away after the check
    # is never chmodded by name, and is refused by the rename below.
    fd = _open_own(target, "nothing was published")
    try:
        os.fchmod(fd, 0o777 & ~_umask())  # as a new directory's
    finally:
        os.close(fd)
    if not overwrite or not os.path.lexists(dest):
        rename_own(root, dest)
        check_published(root, dest, target.key)
        return
    check_replaceable(dest)
    old = file_key(os.lstat(dest))
    exchange(root, dest)
    if file_key(os.lstat(dest)) != tuple(target.key):  # swapped between the check and here
        exchange(root, dest)
        raise FileReplacedError(errno.ESTALE, f"the job's temporary store {root} was replaced "
                                "as it was published; nothing was published")
    # The old store, now under the temporary name; only it is removed.
    if file_key(os.lstat(root)) == old:
        shutil.rmtree(root)


def open_store(target: StoreTarget) -> int:
    """A descriptor of the store's directory, checked to be the one the job made: kept by the
    job while it writes, so that :func:`remove_store` finds its entries wherever the directory
    is moved."""
    return _open_own(target, "nothing is written into it")


def remove_store(target: StoreTarget, fd: int) -> bool:
    """Remove what the job wrote: the entries below its directory ``fd`` (:func:`open_store`,
    wherever it now is), and the directory itself where its name still holds it. Whether the
    name no longer holds the job's store (removed, or another directory in its place, which
    is never touched)."""
    for name in os.listdir(fd):
        # A write still running may add an entry meanwhile: the caller tries again.
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(name, dir_fd=fd).st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
    try:
        if file_key(os.lstat(target.root)) != tuple(target.key):
            return True
        os.rmdir(target.root)
    except FileNotFoundError:
        return True
    except OSError:  # a write that began before the removal made an entry again
        return False
    return True


# ---- what --overwrite may replace -------------------------------------------------------------


def chunk_key_parser(metadata: dict) -> Any:
    """From an array's metadata document (``zarr.json`` or ``.zarray``, parsed), a function
    telling whether a path relative to the store is one of its chunk keys (indices within its
    chunk grid)."""
    shape = [int(n) for n in metadata["shape"]]
    if metadata.get("zarr_format") == 3:
        grid = metadata["chunk_grid"]["configuration"]["chunk_shape"]
        encoding = metadata.get("chunk_key_encoding", {"name": "default"})
        separator = encoding.get("configuration", {}).get("separator",
                                                          "/" if encoding["name"] == "default"
                                                          else ".")
        prefix = "c" if encoding["name"] == "default" else ""
    else:
        grid = metadata["chunks"]
        separator = metadata.get("dimension_separator") or "."
        prefix = ""
    counts = [max(-(-n // max(int(c), 1)), 1) if n else 0 for n, c in zip(shape, grid)]

    def is_chunk(relative: str) -> bool:
        text = relative
        if prefix:
            if text == prefix and not shape:
                return True
            if not text.startswith(prefix + separator):
                return False
            text = text[len(prefix) + len(separator):]
        parts = text.split(separator) if shape else [text]
        if not shape:
            return parts == ["0"]
        if len(parts) != len(shape) or not all(p.isdigit() for p in parts):
            return False
        return all(int(p) < n for p, n in zip(parts, counts))

    return is_chunk


_METADATA_FILES = {"zarr.json", ".zarray", ".zattrs"}


def check_replaceable(path: Path) -> None:
    """``FileExistsError`` unless ``path`` is a Zarr array store whose every entry is zarr's
    own: its metadata documents and chunk keys within its grid, in directories that only
    hold such keys. A group, a symlink, or any other file is named and nothing removed."""
    if path.is_symlink() or not path.is_dir():
        raise FileExistsError(f"{path} is not a Zarr store; only a Zarr array "
                              "store is replaced")
    document = None
    for name in ("zarr.json", ".zarray"):
        candidate = path / name
        if candidate.is_file() and not candidate.is_symlink():
            try:
                document = json.loads(candidate.read_text())
            except (OSError, ValueError):
                document = None
            break
    if (not isinstance(document, dict) or "shape" not in document
            or document.get("node_type", "array") != "array"):
        raise FileExistsError(f"{path} is not a Zarr array store (a group, or no "
                              "readable array metadata); only a Zarr array store is replaced")
    try:
        is_chunk = chunk_key_parser(document)
    except (KeyError, TypeError, ValueError):
        raise FileExistsError(f"{path}: its array metadata cannot be read; it is "
                              "not replaced") from None
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(folder, name)
            relative = os.path.relpath(full, path).replace(os.sep, "/")
            st = os.lstat(full)
            if stat.S_ISDIR(st.st_mode):
                continue  # judged by what it holds
            if stat.S_ISREG(st.st_mode) and (
                    (folder == os.fspath(path) and name in _METADATA_FILES) or is_chunk(relative)):
                continue
            raise FileExistsError(f"{path} holds {relative}, which is not "
                                  "zarr's; the store is not replaced (remove or move it first)")
