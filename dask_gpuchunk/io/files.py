"""Files that are never clobbered, swapped or silently changed under a job.

* **Inputs are pinned**: :func:`identity` records a file's device, inode, size and modification
  time; :func:`check_unchanged` (at the end of a job) and :func:`open_pinned` (in each reading
  task) raise :class:`InputChangedError`, naming the file, where it changed since.
* **Temporary outputs are private**: :func:`create_exclusive` makes a new file with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` (never through a symlink another user planted), and
  :func:`open_same` reopens it only where the path still names that very file.
* **Publishing never clobbers**: :func:`publish` renames the finished file onto its target with
  ``renameat2(RENAME_NOREPLACE)`` (a hard link and an unlink where the file system lacks it), so
  a target that appeared during the job is kept and :class:`FileExistsError` raised. With
  ``overwrite``, only a regular file is replaced, and the new file takes its permission bits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "FileIdentity",
    "FileReplacedError",
    "InputChangedError",
    "check_published",
    "check_unchanged",
    "create_exclusive",
    "exchange",
    "file_key",
    "identity",
    "open_pinned",
    "open_same",
    "publish",
    "refuse_unless_regular",
    "rename_noreplace",
    "rename_own",
]


class InputChangedError(OSError):
    """An input file was replaced or modified while a job read it."""


class FileReplacedError(OSError):
    """A job's temporary file no longer is the file the job created (swapped by someone)."""


class FileIdentity(NamedTuple):
    """What says a file is the one a job started with."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def identity(path: str | os.PathLike) -> FileIdentity:
    """The identity of the file at ``path`` now (symlinks followed, as a reader's ``open``).

    Examples
    --------
    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     identity(f.name).size
    0
    """
    return FileIdentity.of(os.stat(path))


def _changed(path: str | os.PathLike, pinned: FileIdentity, now: FileIdentity) -> InputChangedError:
    what = ("was replaced by another file" if now[:2] != pinned[:2]
            else "was modified")
    return InputChangedError(
        errno.ESTALE, f"input {os.fspath(path)} {what} during the job (size {pinned.size} -> "
        f"{now.size} bytes); nothing was written from it")


def check_unchanged(path: str | os.PathLike, pinned: FileIdentity) -> None:
    """Raise :class:`InputChangedError` if ``path`` is no longer the file ``pinned`` names, or
    was modified since (its size or modification time moved)."""
    try:
        now = identity(path)
    except FileNotFoundError:
        raise InputChangedError(errno.ENOENT, f"input {os.fspath(path)} was removed during the "
                                "job; nothing was written from it") from None
    if now != pinned:
        raise _changed(path, pinned, now)


def open_pinned(path: str | os.PathLike, pinned: FileIdentity) -> int:
    """Open ``path`` for reading; :class:`InputChangedError` where it is not the pinned file."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    now = FileIdentity.of(os.fstat(fd))
    if now != pinned:
        os.close(fd)
        raise _changed(path, pinned, now)
    return fd


def create_exclusive(path: str | os.PathLike, mode: int = 0o666) -> int:
    """Create ``path``, which must not exist (not even as a dangling symlink), for writing:
    its descriptor. The process's umask applies to ``mode``."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   mode)


def file_key(st: os.stat_result) -> tuple[int, int, int]:
    """``(device, inode, owner)`` of a file: which file a job created. The owner counts because
    a freed inode number is soon given to the next new file, which another user may make."""
    return st.st_dev, st.st_ino, st.st_uid


def open_same(path: str | os.PathLike, key: tuple[int, int, int]) -> int:
    """Open ``path`` for writing, not through a symlink, only if it is still the file ``key``
    (:func:`file_key`) names (:class:`FileReplacedError` otherwise)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOENT):
            raise FileReplacedError(exc.errno, f"the job's temporary file {os.fspath(path)} "
                                    "was removed or replaced by a symlink") from None
        raise
    if file_key(os.fstat(fd)) != tuple(key):
        os.close(fd)
        raise FileReplacedError(errno.ESTALE, f"the job's temporary file {os.fspath(path)} was "
                                "replaced by another file")
    return fd


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_libc: list[object] = []


def _renameat2() -> object | None:
    if not _libc:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name, use_errno=True) if name else None
        _libc.append(getattr(libc, "renameat2", None))
    return _libc[0]


def _renameat2_errno(src: str | os.PathLike, dst: str | os.PathLike, flags: int) -> int | None:
    """``renameat2(src, dst, flags)``: 0 done, else its errno; ``None`` where the C library has
    no ``renameat2`` or the file system does not take ``flags`` (the caller falls back)."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return None
    if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:  # type: ignore[operator]
        return 0
    err = ctypes.get_errno()
    return None if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) else err


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` onto ``dst`` only where ``dst`` does not exist, atomically:
    :class:`FileExistsError` otherwise (``dst`` untouched).

    Examples
    --------
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "a").write_text("new"), (d / "b").write_text("old")
    >>> rename_noreplace(d / "a", d / "b")
    Traceback (most recent call last):
    ...
    FileExistsError: [Errno 17] ... exists; not replaced
    >>> rename_noreplace(d / "a", d / "c"); (d / "c").read_text()
    'new'
    """
    err = _renameat2_errno(src, dst, _RENAME_NOREPLACE)
    if err == 0:
        return
    if err == errno.EEXIST:
        raise FileExistsError(err, f"{os.fspath(dst)} exists; not replaced")
    if err is not None:
        raise OSError(err, os.strerror(err), os.fspath(src))
    # No renameat2 for this file system: a hard link fails where dst exists, atomically too.
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, f"{os.fspath(dst)} exists; not replaced") from None
    os.unlink(src)


_RENAME_EXCHANGE = 2


def rename_own(tmp: str | os.PathLike, target: str | os.PathLike) -> None:
    """:func:`rename_noreplace` of a job's temporary ``tmp`` onto ``target``:
    :class:`FileReplacedError` where ``tmp`` was moved away meanwhile (a neighbour's rename
    caught before they put anything in its place), not a bare ``FileNotFoundError``.

    Examples
    --------
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> rename_own(d / ".out.partial", d / "out")
    Traceback (most recent call last):
    ...
    dask_gpuchunk.io.files.FileReplacedError: [Errno 116] ... moved away as it was published; ...
    """
    try:
        rename_noreplace(tmp, target)
    except FileNotFoundError:
        if os.path.lexists(tmp):
            raise  # target's directory is gone: an error of its own
        raise FileReplacedError(errno.ESTALE, f"the job's temporary {os.fspath(tmp)} was moved "
                                "away as it was published; nothing was published") from None


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Swap the names ``a`` and ``b`` (both must exist) in one step where the file system has
    ``renameat2(RENAME_EXCHANGE)``; elsewhere in three renames through a third name beside
    ``a`` (a moment when ``b`` does not exist).

    Examples
    --------
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "a").write_text("A"), (d / "b").write_text("B")
    >>> exchange(d / "a", d / "b"); (d / "a").read_text(), (d / "b").read_text()
    ('B', 'A')
    """
    err = _renameat2_errno(a, b, _RENAME_EXCHANGE)
    if err == 0:
        return
    if err is not None:
        raise OSError(err, os.strerror(err), os.fspath(a))
    middle = os.fspath(a) + ".exchange"
    os.rename(b, middle)
    os.rename(a, b)
    os.rename(middle, a)


def publish(tmp: str | os.PathLike, target: str | os.PathLike, key: tuple[int, int, int],
            overwrite: bool) -> None:
    """Rename the finished ``tmp`` (still the file ``key`` names, :func:`file_key`) onto
    ``target``.

    Without ``overwrite``, never replaces anything (:class:`FileExistsError` where ``target``
    appeared meanwhile). With it, replaces only a regular file, whose permission bits the new
    file takes; a directory, device node, FIFO or symlink at ``target`` is refused.
    """
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:  # moved away, nothing (yet) in its place
        st = None
    if st is None or file_key(st) != tuple(key) or not stat.S_ISREG(st.st_mode):
        raise FileReplacedError(errno.ESTALE, f"the job's temporary file {os.fspath(tmp)} was "
                                "removed or replaced; nothing was published")
    try:
        old = os.lstat(target) if overwrite else None
    except FileNotFoundError:
        old = None
    if old is None:
        rename_own(tmp, target)  # appeared meanwhile: still only a regular file replaced
    else:
        refuse_unless_regular(target, old)
        os.chmod(tmp, stat.S_IMODE(old.st_mode), follow_symlinks=False)
        os.replace(tmp, target)
    check_published(tmp, target, key)


def check_published(tmp: str | os.PathLike, target: str | os.PathLike,
                    key: tuple[int, int, int]) -> None:
    """After a rename of ``tmp`` onto ``target``: where ``target`` is not the file ``key``
    names (swapped at ``tmp`` between the check and the rename, in a directory others may
    write in), move it aside to ``<tmp>.replaced`` and raise :class:`FileReplacedError`."""
    try:
        if file_key(os.lstat(target)) == tuple(key):
            return
        rename_noreplace(target, os.fspath(tmp) + ".replaced")
    except OSError:
        pass  # gone or moved again: nothing of the job's is at target either way
    raise FileReplacedError(errno.ESTALE, f"the job's temporary file {os.fspath(tmp)} was "
                            "replaced as it was published; what was put there is moved to "
                            f"{os.fspath(tmp)}.replaced, nothing of the job's was published")


def refuse_unless_regular(target: str | os.PathLike, st: os.stat_result | None = None) -> None:
    """:class:`FileExistsError` where ``target`` exists and is not a regular file (``st``: its
    ``lstat``, taken here where not given): ``--overwrite`` replaces files, nothing else."""
    if st is None:
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            return
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else
                "a symlink" if stat.S_ISLNK(st.st_mode) else
                "a FIFO" if stat.S_ISFIFO(st.st_mode) else
                "a device node" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                "not a regular file")
        raise FileExistsError(errno.EEXIST, f"{os.fspath(target)} is {kind}; only a regular "
                              "file is replaced")
