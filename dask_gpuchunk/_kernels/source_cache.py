"""Generated kernel sources kept in files, so that numba can cache what it compiles from them.

numba's ``cache=True`` keeps compiled code beside the source file of the function it compiled,
keyed on that file's size and modification time. Kernels generated as text have no file; this
writes each one once into :func:`cache_dir`, under a name that hashes its text and what it
calls, and imports it from there. A later process (each worker of each job) then loads the
compiled code instead of compiling it again: 1.4 s for a product's CPU kernel and 0.3-0.7 s for
its CUDA kernel on the H200 machine. numba's compiled code for every function compiled with
``cache=True`` here (:func:`numba_cache_here`) is kept under the same directory, not beside
the function's source (an installed package's ``__pycache__``). No dask here: the package's
settings tell this module where the directory is (:func:`set_cache_root`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["cache_dir", "cached_njit", "function_stamp", "load_kernel", "numba_cache_here",
           "package_version", "set_cache_root"]


def package_version() -> str:
    """The installed distribution's version; ``"unknown"`` for a source tree never installed."""
    try:
        return importlib.metadata.version("dask-gpuchunk")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


#: Part of every file's key (the generated sources may change between versions).
_PACKAGE_VERSION = package_version()
_lock = threading.Lock()
#: Held while numba's ``CACHE_DIR`` is changed (:func:`numba_cache_here`), compilations included.
_numba_config_lock = threading.RLock()


def _default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dask_gpuchunk"


_root: list[Callable[[], Path]] = [_default_root]


def set_cache_root(root: Callable[[], Path]) -> None:
    """Where the cache is, asked each time it is used: ``root()`` names the package's cache
    directory (:func:`dask_gpuchunk.config.cache_root`, which reads ``gpuchunk.cache-dir``)."""
    _root[0] = root


def load_kernel(source: str, namespace: dict[str, Any], file_key: str) -> Callable | None:
    """The function ``kernel`` of ``source`` defined in a file of :func:`cache_dir`, with
    ``namespace`` as its globals; ``None`` where that directory cannot be written.

    The file is named after a hash of ``source``, ``file_key`` (what identifies the code the
    kernel calls: :func:`function_stamp` of the user's function) and the numba and package
    versions, written once, and imported as a module of its own, so that numba's
    ``cache=True`` (which needs a function defined in a file, and keys its cache on that file)
    keeps what it compiles from it.
    """
    path = _kernel_file(source, file_key)
    if path is None:
        return None
    why = _not_private(path)
    if why is not None:  # a file another user could have changed: never imported
        _warn_once(f"dask_gpuchunk does not load the cached kernel {path.name}: {why}; it is "
                   "compiled in memory")
        return None
    # One module per file and process (the file names the function and the source, so
    # another load would have the same globals); numba's cached code refers to it by name.
    name = f"dask_gpuchunk_kernel_{path.stem}"
    with _lock:
        if name in _kernel_modules:
            return _kernel_modules[name].kernel
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    module.__dict__.update(namespace)
    spec.loader.exec_module(module)
    with _lock:
        module = _kernel_modules.setdefault(name, module)
        sys.modules[name] = module  # where numba's cached code finds its globals again
    return module.kernel


_kernel_modules: dict[str, Any] = {}


def cache_dir() -> Path | None:
    """Where generated kernel sources are kept (``kernels`` in the package's cache directory,
    :func:`set_cache_root`); ``None`` where it cannot be written, or where anyone but this
    user could change what is loaded from it (:func:`_not_private`: one warning, and kernels
    are then compiled in memory).

    The cache holds Python source that is imported and numba's pickled code: whoever can write
    there runs code in every process that loads from it. The package's directories are made
    readable by their owner only (mode 0700).
    """
    root = _root[0]()
    path = root / "kernels"
    numba_dir = root / "numba"  # numba's compiled code (numba_cache_here)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        for d in (root, path, numba_dir):
            d.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return None
    why = _not_private(root) or _not_private(path) or _not_private(numba_dir)
    if why is not None:
        _warn_once(f"dask_gpuchunk does not load kernels from its cache: {why}; they are "
                   "compiled in memory (make the directory yours and not writable by others, "
                   "or set gpuchunk.cache-dir / DASK_GPUCHUNK__CACHE_DIR elsewhere)")
        return None
    return path if os.access(path, os.W_OK) else None


def _not_private(path: Path) -> str | None:
    """Why ``path`` (a directory or file of the cache) could be changed by someone else: owned
    by another user, or writable by its group or others. ``None`` where it could not (and on
    systems without POSIX owners)."""
    if not hasattr(os, "geteuid"):
        return None
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror})"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"{path} can be written by its group or others (mode {st.st_mode & 0o777:o})"
    return None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    import warnings

    with _lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, stacklevel=4)


def _kernel_file(source: str, file_key: str) -> Path | None:
    """The cache file holding ``source`` for ``file_key``, written once (atomically)."""
    import numba

    root = cache_dir()
    if root is None:
        return None
    key = f"{source}\n{file_key}\n{numba.__version__}\n{_PACKAGE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    path = root / f"k{digest}.py"
    if not path.exists():
        # Never rewritten once there: numba keys its cache on the file's size and mtime.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            # Readable and writable by this user only, whatever the umask.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"# generated by dask_gpuchunk for {file_key}\n{source}")
            os.replace(tmp, path)
        except OSError:
            return None
    return path


def _code_bytes(code: types.CodeType) -> bytes:
    """What a function's code does, as bytes that are the same in every process: its bytecode,
    names and constants (nested code the same way). ``marshal.dumps`` is not: its bytes depend
    on objects' reference counts, and code compiled from the source marshals otherwise than the
    same code read back from its ``.pyc``, so the first process after a file's edit and the
    next ones named the same function differently (a second compile where bytecode is written,
    as by default)."""
    parts = [code.co_code, repr((code.co_names, code.co_varnames, code.co_freevars,
                                 code.co_cellvars, code.co_argcount, code.co_flags)).encode()]
    for const in code.co_consts:
        parts.append(_code_bytes(const) if isinstance(const, types.CodeType)
                     else _stable_repr(const).encode())
    return b"\0".join(parts)


def _stable_repr(value: Any) -> str:
    """``repr`` of a constant, sets in sorted order (their order follows string hashing, which
    differs between processes)."""
    if isinstance(value, frozenset):
        return "frozenset(" + repr(sorted(_stable_repr(v) for v in value)) + ")"
    if isinstance(value, tuple):
        return "(" + ",".join(_stable_repr(v) for v in value) + ",)"
    return repr(value)


def function_stamp(func: Callable) -> str | None:
    """What identifies ``func``'s code for a cache on disk, as numba's ``cache=True`` does:
    its source file (path, size, modification time), qualified name, first line and a hash of
    its compiled code. ``None`` for a function defined outside a file (a REPL, ``exec``),
    which is then never cached.

    As with numba's cache, changes to other functions ``func`` calls from other files are not
    seen: clear :func:`cache_dir` after editing those.

    Examples
    --------
    >>> f":cache_dir:{cache_dir.__code__.co_firstlineno}:" in function_stamp(cache_dir)
    True
    >>> function_stamp(eval("lambda x: x")) is None
    True
    """
    code = getattr(func, "__code__", None)
    if code is None or not os.path.isfile(code.co_filename):
        return None
    st = os.stat(code.co_filename)
    # The code itself too: a process may still run the function as it was before its file
    # was edited (and the file's stamp would then name the old code).
    digest = hashlib.sha256(_code_bytes(code)).hexdigest()[:16]
    return (f"{os.path.abspath(code.co_filename)}:{st.st_size}:{st.st_mtime_ns}:"
            f"{getattr(func, '__qualname__', '')}:{code.co_firstlineno}:{digest}")


def _numba_configs() -> list[Any]:
    """numba's configuration modules whose ``CACHE_DIR`` its caches read (numba's own, and
    numba-cuda's where it has one)."""
    from numba.core import config

    found = [config]
    with contextlib.suppress(ImportError):
        from numba.cuda.core import config as cuda_config

        if cuda_config is not config and hasattr(cuda_config, "CACHE_DIR"):
            found.append(cuda_config)
    return found


@contextlib.contextmanager
def numba_cache_here() -> Iterator[None]:
    """Functions given ``cache=True`` inside this block keep numba's compiled code under
    ``numba`` in the package's cache directory (numba picks the place when the dispatcher is
    made, from ``NUMBA_CACHE_DIR``'s setting, set here for the block and put back after);
    where that directory cannot be written, or the user set ``NUMBA_CACHE_DIR``, numba's own
    choice stands."""
    configs = _numba_configs()
    here = cache_dir()
    if here is None or configs[0].CACHE_DIR:
        yield
        return
    with _numba_config_lock:
        before = [c.CACHE_DIR for c in configs]
        for c in configs:
            c.CACHE_DIR = str(here.parent / "numba")
        try:
            yield
        finally:
            for c, value in zip(configs, before):
                c.CACHE_DIR = value


def cached_njit(func: Callable, **options: Any) -> Any:
    """``numba.njit(func, cache=True, **options)``, its compiled code kept where
    :func:`numba_cache_here` says; where numba finds nowhere to keep it ("cannot cache
    function"), it keeps it in a temporary directory for this process instead, with one
    warning, rather than failing."""
    import numba

    try:
        with numba_cache_here():
            return numba.njit(func, cache=True, **options)
    except RuntimeError as exc:
        if "cannot cache" not in str(exc):
            raise
        _temporary_numba_cache(str(exc).splitlines()[0])
    return numba.njit(func, cache=True, **options)


def _temporary_numba_cache(why: str) -> None:
    import tempfile
    import warnings

    from numba.core import config

    with _numba_config_lock:
        if _temporary_cache:
            return
        _temporary_cache.append(tempfile.mkdtemp(prefix="dask-gpuchunk-numba-"))
        config.CACHE_DIR = _temporary_cache[0]
    warnings.warn(f"{why}; compiled kernels are kept in {config.CACHE_DIR} for this process "
                  "(set NUMBA_CACHE_DIR to a writable directory to keep them)", stacklevel=3)


_temporary_cache: list[str] = []
