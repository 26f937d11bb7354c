"""Generated kernel sources kept in files: numba's on-disk cache across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import dask
import numpy as np
import pytest
from helpers import assert_same

from dask_gpuchunk._kernels.elementwise import ElementwiseKernels
from dask_gpuchunk._kernels import source_cache
from dask_gpuchunk._kernels.source_cache import cache_dir, function_stamp


def mul(a, b):
    return a * b


def test_cache_dir_is_the_setting_s_and_writable(tmp_path):
    with dask.config.set({"gpuchunk.cache-dir": str(tmp_path / "c")}):
        assert cache_dir() == tmp_path / "c" / "kernels" and cache_dir().is_dir()
    with dask.config.set({"gpuchunk.cache-dir": "/proc/no-such-place"}):
        assert cache_dir() is None  # kernels are then compiled, not cached


_CACHE_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {moddir!r})
import userfunc
import dask_gpuchunk as dg
from dask_gpuchunk.devices import gpu_available

op = dg.elementwise(userfunc.f, cache=True)
device = {device!r}
a = np.arange(12.0).reshape(3, 4)
r = op(a, a[0], device=device)
assert np.array_equal(r, userfunc.f(a, a[0])), r
table = op.kernels._cuda if device == "gpu" else op.kernels._cpu
hits = sum(sum(d.stats.cache_hits.values()) for d in table.values())
print("hits", hits)
"""


def _run_cached(tmp_path, device, body):
    moddir = tmp_path / "mod"
    moddir.mkdir(exist_ok=True)
    source = f"def f(a, b):\n    return {body}\n"
    if not (moddir / "userfunc.py").exists() or (moddir / "userfunc.py").read_text() != source:
        (moddir / "userfunc.py").write_text(source)
    env = {**os.environ, "DASK_GPUCHUNK__CACHE_DIR": str(tmp_path / "cache")}
    env.pop("NUMBA_CACHE_DIR", None)
    # Bytecode written, as by default: the second process reads the function from its .pyc
    # (a stamp from marshal.dumps then differed from the first's and nothing loaded).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT.format(moddir=str(moddir), device=device)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    # numba's compiled code is kept in the package's cache directory, none beside the source.
    assert not list(moddir.rglob("*.nbi")) and list((tmp_path / "cache").rglob("*.nbi"))
    return int(done.stdout.split("hits")[-1])


def _cache_round_trip(tmp_path, device):
    assert _run_cached(tmp_path, device, "a * b + 1") == 0  # compiled, and kept
    assert _run_cached(tmp_path, device, "a * b + 1") >= 1  # a later process loads it
    time.sleep(0.01)  # a new modification time for the edited file
    # The function's file changes: its kernels are compiled again, never the stale ones.
    assert _run_cached(tmp_path, device, "a * b + 2") == 0


def test_cache_loads_in_a_later_process_and_follows_the_source(tmp_path):
    _cache_round_trip(tmp_path, "cpu")


@pytest.mark.gpu
def test_cuda_cache_loads_in_a_later_process_and_follows_the_source(tmp_path):
    _cache_round_trip(tmp_path, "gpu")


def test_functions_without_a_file_are_not_cached(tmp_path):
    with dask.config.set({"gpuchunk.cache-dir": str(tmp_path)}):
        _functions_without_a_file_are_not_cached(tmp_path)


def _functions_without_a_file_are_not_cached(tmp_path):
    namespace: dict = {}
    exec("def g(a, b):\n    return a - b\n", namespace)  # noqa: S102 - a function with no file
    assert function_stamp(namespace["g"]) is None
    assert function_stamp(mul) is not None
    # With no source it cannot be translated by NumPy's rules; numba's rules compile it.
    k = ElementwiseKernels(namespace["g"], 2, cache=True, rules="numba")
    out = np.empty(3)
    k.cpu(out, np.arange(3.0), np.ones(3))
    assert_same(out, np.arange(3.0) - 1)
    assert not any(tmp_path.rglob("*.py"))  # nothing written for it


def _scaled(x):
    return 3 * x


def test_nowhere_to_cache_falls_back_to_a_temporary_directory_with_one_warning(monkeypatch):
    # What numba says where the function's directory is read-only and the home directory is
    # not writable (as root, every directory here is writable, so numba is made to say it).
    from numba.core import config
    from numba.core.dispatcher import Dispatcher

    real = Dispatcher.enable_caching

    def no_locator(self):
        if not config.CACHE_DIR:
            raise RuntimeError(f"cannot cache function {self.py_func.__name__!r}: no locator "
                               "available for file '/read-only/f.py'")
        real(self)

    monkeypatch.setattr(Dispatcher, "enable_caching", no_locator)
    monkeypatch.setattr(config, "CACHE_DIR", "")
    monkeypatch.setattr(source_cache, "_temporary_cache", [])
    # No writable cache directory of the package's either.
    monkeypatch.setitem(dask.config.config, "gpuchunk", {"cache-dir": "/proc/no-such-place"})
    with pytest.warns(UserWarning, match="cannot cache function.*NUMBA_CACHE_DIR"):
        first = source_cache.cached_njit(_scaled)
    assert first(7) == 21
    assert os.path.isdir(config.CACHE_DIR)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per process
        assert source_cache.cached_njit(_scaled)(2) == 6


# ---- who may write the cache ---------------------------------------------------------------


def test_the_cache_s_directories_are_made_private(tmp_path):
    with dask.config.set({"gpuchunk.cache-dir": str(tmp_path / "c")}):
        assert cache_dir() == tmp_path / "c" / "kernels"
    for d in ("c", "c/kernels", "c/numba"):
        assert (tmp_path / d).stat().st_mode & 0o777 == 0o700, d


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX owners and modes")
def test_a_cache_others_could_write_is_not_loaded_from(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o775)  # a group could plant code there
    source_cache._warned.clear()
    with dask.config.set({"gpuchunk.cache-dir": str(root)}):
        with pytest.warns(UserWarning, match="written by its group or others.*in memory"):
            assert cache_dir() is None
        k = ElementwiseKernels(mul, 2, cache=True)  # compiled in memory, still right
        out = np.empty(5)
        k.cpu(out, np.arange(5.0), np.full(5, 3.0))
        assert_same(out, np.arange(5.0) * 3.0)
        assert not list(root.glob("kernels/*.py"))
    root.chmod(0o700)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(root).st_uid + 1)
    with dask.config.set({"gpuchunk.cache-dir": str(root)}):
        with pytest.warns(UserWarning, match="owned by another user"):
            assert cache_dir() is None


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX owners and modes")
def test_kernel_files_are_written_private_and_one_others_could_change_is_refused(tmp_path):
    source_cache._warned.clear()
    source = "def kernel(x):\n    return x + 1\n"
    with dask.config.set({"gpuchunk.cache-dir": str(tmp_path / "c")}):
        assert source_cache.load_kernel(source, {}, "private-test")(1) == 2
        (path,) = (tmp_path / "c" / "kernels").glob("k*.py")
        assert path.stat().st_mode & 0o777 == 0o600
        path.chmod(0o666)
        source_cache._kernel_modules.clear()  # as a later process would find it
        with pytest.warns(UserWarning, match="does not load the cached kernel"):
            assert source_cache.load_kernel(source, {}, "private-test") is None


def test_a_functions_code_names_it_alike_compiled_or_read_from_its_pyc(tmp_path):
    # marshal.dumps of the code compiled from the source and of the same code read back from
    # its .pyc differ: the first process after an edit and the next ones had other stamps.
    import marshal
    import py_compile
    import types

    source = tmp_path / "stamped.py"
    source.write_text("def f(a, b):\n    return a * b + (1.5 if a in {'x', 'y', 'z'} else -2)\n")
    compiled = compile(source.read_text(), str(source), "exec", dont_inherit=True)
    pyc = py_compile.compile(str(source), cfile=str(tmp_path / "stamped.pyc"), doraise=True)
    with open(pyc, "rb") as f:
        f.seek(16)  # the header: magic, flags, the source's time and size
        loaded = marshal.load(f)

    def function_code(module_code):
        return next(c for c in module_code.co_consts if isinstance(c, types.CodeType))

    assert (source_cache._code_bytes(function_code(compiled))
            == source_cache._code_bytes(function_code(loaded)))
    edited = compile(source.read_text().replace("-2", "-3"), str(source), "exec",
                     dont_inherit=True)
    assert (source_cache._code_bytes(function_code(edited))
            != source_cache._code_bytes(function_code(compiled)))
