"""Joining a running cluster (batch jobs) without handing it this process.

Whoever controls the scheduler a client joins runs code in the client: Dask's messages carry
pickles. So a scheduler file is read only where its owner could have written no other address
than the one meant: a regular file of at most :data:`SCHEDULER_FILE_MAX_BYTES`, owned by this
user (or root) and writable by no one else (:func:`read_scheduler_file`). An address that talks
plain TCP or UCX, which carry no credentials, draws one warning: anyone who reaches it can run
code as this user (:func:`warn_if_plain`). A peer that does not answer as a Dask scheduler in
time is an ``OSError`` (:func:`client_within`): distributed's own client waits on such a peer
forever, or reads garbage lengths and tries to allocate exabytes. :func:`write_credentials`
makes the TLS files a batch job's scheduler, workers and jobs share.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _compat

__all__ = ["SCHEDULER_FILE_MAX_BYTES", "PlainTransportWarning", "client_within",
           "read_scheduler_file", "shown", "warn_if_plain", "write_credentials"]

#: The largest scheduler file read (``dask scheduler`` writes well under a kilobyte).
SCHEDULER_FILE_MAX_BYTES = 64 * 1024


class PlainTransportWarning(UserWarning):
    """A cluster joined over a transport without credentials."""


def shown(text: str, limit: int = 120) -> str:
    """``text`` for an error message: cut to ``limit`` characters.

    Examples
    --------
    >>> shown("tcp://" + "9" * 500)[-12:]
    '… (506 long)'
    """
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} long)"


def read_scheduler_file(path: str | os.PathLike) -> str:
    """The scheduler address in ``path`` (what ``dask scheduler --scheduler-file`` writes),
    read only where the file could hold no one else's address: ``ValueError`` for anything
    but a regular file (a FIFO is not waited on, a device not read), one larger than
    :data:`SCHEDULER_FILE_MAX_BYTES`, one owned by another user than this one or root, or one
    that its group or others may write; ``FileNotFoundError`` where there is none."""
    path = os.fspath(path)
    if not path:
        raise ValueError("the scheduler file name is empty")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(f"scheduler file {path} does not exist (is the scheduler "
                                "started with --scheduler-file?)") from None
    except OSError as exc:
        raise ValueError(f"cannot read scheduler file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"scheduler file {path} is not a regular file")
        if hasattr(os, "geteuid") and st.st_uid not in (os.geteuid(), 0):
            raise ValueError(f"scheduler file {path} is owned by another user (uid "
                             f"{st.st_uid}): its address would run this job's code wherever "
                             "they point it")
        if st.st_mode & 0o022:
            raise ValueError(f"scheduler file {path} can be written by its group or others "
                             f"(mode {stat.S_IMODE(st.st_mode):o}): chmod go-w it")
        if st.st_size > SCHEDULER_FILE_MAX_BYTES:
            raise ValueError(f"scheduler file {path} is {st.st_size:,} bytes; a scheduler "
                             "file is a small JSON document")
        raw = os.read(fd, SCHEDULER_FILE_MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise ValueError(f"scheduler file {path} is not text") from None
    if not text.strip():
        raise ValueError(f"scheduler file {path} is empty (has the scheduler finished starting?)")
    try:
        info = json.loads(text)
    except ValueError:
        raise ValueError(f"scheduler file {path} is not JSON; give the file that dask scheduler "
                         "--scheduler-file writes") from None
    address = info.get("address") if isinstance(info, dict) else None
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"scheduler file {path} names no scheduler address")
    return address


def warn_if_plain(address: str, where: str = "the scheduler") -> None:
    """One :class:`PlainTransportWarning` where ``address`` talks a transport without
    credentials (``tcp://``, ``ucx://``, or no scheme, which Dask takes for TCP)."""
    scheme = address.split("://", 1)[0] if "://" in address else "tcp"
    if scheme in ("tls", "inproc"):
        return
    warnings.warn(f"{where} at {shown(address)} talks plain {scheme.upper()}: anyone who can "
                  "reach it can run code as you; start the cluster with TLS (see the README, "
                  "batch jobs)", PlainTransportWarning, stacklevel=3)


_UNSET = object()


def _scheduler_setting() -> Any:
    """dask's ``scheduler`` setting now (:data:`_UNSET` where there is none)."""
    import dask

    return dask.config.config.get("scheduler", _UNSET)


def _restore_scheduler_setting(value: Any) -> None:
    """dask's ``scheduler`` setting back to ``value`` (:func:`_scheduler_setting`'s)."""
    import dask

    if value is _UNSET:
        dask.config.config.pop("scheduler", None)
    else:
        dask.config.config["scheduler"] = value


def client_within(make: Callable[[], Any], address: str, seconds: float) -> Any:
    """``make()`` (a ``distributed.Client``), given up after ``seconds`` with ``OSError``; a
    peer that fails the client in any other way than a refused or timed-out connection is an
    ``OSError`` too: it does not answer as a Dask scheduler."""
    made: dict[str, Any] = {}
    before = _scheduler_setting(), _compat.default_clients()

    def run() -> None:
        try:
            made["client"] = make()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            # distributed's Client sets dask's scheduler= and makes itself the default before
            # it connects, and leaves both when it fails: every later compute of this process
            # then wanted a client ("no Client active"), or waited on the dead one.
            _restore_scheduler_setting(before[0])
            _compat.forget_default_clients(before[1])
            made["error"] = exc

    thread = threading.Thread(target=run, name="dask-gpuchunk-join", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise OSError(f"{shown(address)} did not answer as a Dask scheduler within "
                      f"{seconds:g} s")
    error = made.get("error")
    if error is None:
        return made["client"]
    if isinstance(error, (OSError, TimeoutError)):
        raise error
    raise OSError(f"{shown(address)} does not answer as a Dask scheduler "
                  f"({type(error).__name__})") from None


def write_credentials(directory: str | os.PathLike) -> dict[str, Path]:
    """Write TLS credentials for a batch cluster into ``directory`` (made, mode 0700): one
    self-signed certificate and its key, which the scheduler, the workers and the jobs all
    present and all trust as their certificate authority (``cert.pem``, ``key.pem``, and the
    same certificate as ``ca.pem``; mode 0600), as ``distributed.Security.temporary()`` makes
    them for a local cluster. Only holders of the key can then talk to the cluster. Returns
    their paths.

    Examples
    --------
    >>> import tempfile
    >>> paths = write_credentials(Path(tempfile.mkdtemp()) / "tls")
    >>> sorted(paths), oct(paths["key"].stat().st_mode & 0o777)
    (['ca', 'cert', 'key'], '0o600')
    """
    from distributed import Security

    made = Security.temporary()
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if directory.stat().st_mode & 0o077:
        raise ValueError(f"{directory} can be read by others; give a new directory")
    paths = {"ca": directory / "ca.pem", "cert": directory / "cert.pem",
             "key": directory / "key.pem"}
    for name, text in (("ca", made.tls_ca_file), ("cert", made.tls_client_cert),
                       ("key", made.tls_client_key)):
        fd = os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return paths
