"""Temporary output files that say who writes them, and the removal of those left behind.

A job writes its output into ``.<name>.dgc-<host>-<pid>-<start>-<random>.partial`` beside the
target and renames it onto the target when complete. The name records the writer: the host (8
hex digits of a hash of its name), the process id and the process's start time (clock ticks
since boot, from Linux's ``/proc``; 0 where unknown), so a pid used again by another process is
not taken for the writer. A job killed with SIGKILL, or a machine that lost power, leaves that
file; the next job writing the same target removes it once its writer is gone
(:func:`remove_stale`), and ``dask-gpuchunk clean DIR`` does so on demand (:func:`partials_in`).
A file written on another host cannot be checked from here: it is kept unless asked.

Examples
--------
>>> import tempfile
>>> target = Path(tempfile.mkdtemp()) / "g.npy"
>>> tmp = temporary_name(target)
>>> _ = tmp.write_bytes(b"")
>>> [(p.path == tmp, p.state()) for p in partials_in(target.parent, target)]
[(True, 'running')]
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

__all__ = ["Partial", "Writer", "partials_in", "remove_partials", "remove_stale",
           "temporary_name"]

SUFFIX = ".partial"
# Fixed widths: the writer part's length never depends on the pid, so a long target name is
# cut to the same stem by the writer and by whoever looks for its partial files later.
_WRITER = r"dgc-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9a-f]{8})-(?P<start>[0-9a-f]{12})-[0-9a-f]{6}"
_OURS = re.compile(r"^\.(?P<stem>.+)\." + _WRITER + re.escape(SUFFIX) + "$")
# What versions before the writer record wrote: a random part only.
_OLDER = re.compile(r"^\.(?P<stem>.+)\.[0-9a-f]{12}" + re.escape(SUFFIX) + "$")
_WRITER_LENGTH = len("dgc-") + 8 + 1 + 8 + 1 + 12 + 1 + 6


def _host_tag() -> str:
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot; ``None`` where no such
    process runs; 0 where it runs but the time cannot be read (no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[19])  # the 22nd field; the split starts at the 3rd
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


class Writer(NamedTuple):
    """Who writes a partial file: host tag, process id and the process's start time."""

    host: str
    pid: int
    start: int

    @classmethod
    def this_process(cls) -> Writer:
        return cls(_host_tag(), os.getpid(), _start_time(os.getpid()) or 0)

    def state(self) -> str:
        """``"running"``, ``"gone"`` (no such process on this host, or a later one with its
        pid) or ``"unknown"`` (written on another host)."""
        if self.host != _host_tag():
            return "unknown"
        now = _start_time(self.pid)
        if now is None or (self.start and now and now != self.start):
            return "gone"
        return "running"

    def describe(self) -> str:
        if self.host != _host_tag():
            return f"written by pid {self.pid} on another host (tag {self.host})"
        return f"written by pid {self.pid} on this host"


class Partial(NamedTuple):
    """A temporary output file: its path, size, and writer (``None``: an older version's
    name, which records none)."""

    path: Path
    nbytes: int
    writer: Writer | None

    def state(self) -> str:
        return self.writer.state() if self.writer is not None else "unknown"

    def describe(self) -> str:
        state = self.state()
        if self.writer is None:
            return ("no dgc writer tag: a look-alike of another program's, or of a version "
                    "before the tag; never removed here")
        return self.writer.describe() + {"running": ", still running", "gone": ", gone",
                                         "unknown": ""}[state]


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _stem(name: str, directory: Path) -> str:
    """``name``, or where its temporary name would not fit the file system's name length, its
    start and a hash of the whole (two long names alike in their first bytes stay apart)."""
    room = _name_max(directory) - len(".") - len(".") - _WRITER_LENGTH - len(SUFFIX)
    raw = name.encode()
    if len(raw) <= room:
        return name
    digest = hashlib.blake2b(raw, digest_size=4).hexdigest()
    return raw[:room - 9].decode(errors="ignore") + "~" + digest  # never half a character


def temporary_name(target: Path) -> Path:
    """A new temporary name beside ``target`` recording this process as its writer."""
    w = Writer.this_process()
    writer = f"dgc-{w.host}-{w.pid:08x}-{w.start:012x}-{secrets.token_hex(3)}"
    return target.parent / f".{_stem(target.name, target.parent)}.{writer}{SUFFIX}"


def _tree_bytes(directory: str) -> int:
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def partials_in(directory: str | os.PathLike, target: str | os.PathLike | None = None
                ) -> list[Partial]:
    """The temporary output files in ``directory`` (regular files, and directories for Zarr
    stores), sorted by name; only those of ``target`` where given."""
    directory = Path(directory)
    stem = _stem(Path(target).name, directory) if target is not None else None
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not (entry.name.startswith(".") and entry.name.endswith(SUFFIX)):
                continue
            ours, older = _OURS.match(entry.name), _OLDER.match(entry.name)
            match = ours or older
            if match is None or (stem is not None and match["stem"] != stem):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            # A Zarr store's temporary is a directory; nothing else but regular files.
            store = stat.S_ISDIR(st.st_mode) and match["stem"].endswith(".zarr")
            if not (stat.S_ISREG(st.st_mode) or store):
                continue
            writer = (Writer(ours["host"], int(ours["pid"], 16), int(ours["start"], 16))
                      if ours else None)
            size = _tree_bytes(entry.path) if store else st.st_size
            found.append(Partial(Path(entry.path), size, writer))
    return sorted(found)


def remove_partials(partials: list[Partial], *, unknown: bool = False,
                    log: Callable[[str], None] | None = None,
                    log_removals: bool = True) -> list[Partial]:
    """Remove those of ``partials`` whose writer is gone (and, with ``unknown``, those whose
    writer cannot be checked from here); never one a running process on this host writes, nor
    one whose name has no ``dgc`` writer tag (a look-alike).
    ``log`` hears each file that could not be removed and, with ``log_removals``, each
    removal. Returns those removed."""
    removed = []
    for partial in partials:
        if partial.writer is None:  # only names this package makes, with its dgc tag
            continue
        state = partial.state()
        if not (state == "gone" or (unknown and state == "unknown")):
            continue
        try:
            if partial.path.is_dir() and not partial.path.is_symlink():
                shutil.rmtree(partial.path)  # a Zarr store's
            else:
                partial.path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:  # another user's, in a sticky directory: theirs to remove
            if log is not None:
                log(f"cannot remove {partial.path} ({exc.strerror}); {partial.describe()}")
            continue
        removed.append(partial)
        if log is not None and log_removals:
            log(f"removed {partial.path} ({partial.nbytes:,} bytes), a partial output "
                f"{partial.describe()}")
    return removed


def remove_stale(target: str | os.PathLike, log: Callable[[str], None] | None = None
                 ) -> list[Partial]:
    """Remove ``target``'s temporary files whose writer is gone (:func:`remove_partials`)."""
    return remove_partials(partials_in(Path(target).parent, target), log=log)
