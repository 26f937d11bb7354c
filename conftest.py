"""Test session setup: a real GPU where one is visible, numba's CUDA simulator otherwise.

The simulator must be switched on before numba is imported: this file sits at the repository
root so that pytest loads it before any test module or doctest imports the package. Tests marked
``gpu`` need a real GPU with CuPy and are skipped where none is visible; CUDA kernel tests run
everywhere (on the simulator at small sizes where there is no GPU).
"""

from __future__ import annotations

import os
import sys


def _real_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


REAL_GPU = _real_gpu()
# Kernels cached on disk (dg.multiply's, those of cache=True functions) go to a directory of
# this session, not the user's ~/.cache: every run of the suite compiles once and is checked.
_SESSION_CACHE = None
if "DASK_GPUCHUNK__CACHE_DIR" not in os.environ:
    import tempfile

    _SESSION_CACHE = os.environ["DASK_GPUCHUNK__CACHE_DIR"] = tempfile.mkdtemp(
        prefix="dask-gpuchunk-test-cache-")
    if "dask.config" in sys.modules:  # imported early (by a plugin): read the env again
        sys.modules["dask.config"].refresh()
if not REAL_GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    if "numba.core.config" in sys.modules:  # imported early (by a plugin): read the env again
        sys.modules["numba.core.config"].reload_config()
    assert "numba.cuda" not in sys.modules, "numba.cuda was imported before the simulator was set"

import numpy as np  # noqa: E402
import pytest  # noqa: E402


#: Doctests whose examples make arrays of lengths known only once computed, which dask's array
#: query planning refuses (``similarity(threshold=)``): skipped where it is on.
CLASSIC_ARRAYS_ONLY = {"dask_gpuchunk.bits.similarity.similarity"}


def _query_planning() -> bool:
    import dask.array as da

    return type(da.ones(1)).__module__.startswith("dask.array._array_expr")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _query_planning():
        classic = pytest.mark.skip(reason="needs dask's classic arrays (array query planning "
                                          "is on)")
        for item in items:
            if item.name in CLASSIC_ARRAYS_ONLY:
                item.add_marker(classic)
    if REAL_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    """A fresh random generator per test (seeded, so a failure reproduces)."""
    return np.random.default_rng(20261122)


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request: pytest.FixtureRequest):
    """The array module a test's chunks live in: NumPy everywhere, CuPy where a GPU is (one
    test for both instead of twins)."""
    if request.param == "numpy":
        return np
    import cupy

    return cupy


@pytest.fixture
def device_cap(monkeypatch: pytest.MonkeyPatch):
    """``device_cap(nbytes)``: run the rest of the test as on a GPU of ``nbytes``: CuPy's pool
    in this process capped (restored after), ``CUPY_GPU_MEMORY_LIMIT`` set for the processes
    it starts (cluster workers, CLI runs). GPU tests only."""
    import cupy

    pool = cupy.get_default_memory_pool()
    before = pool.get_limit()

    def cap(nbytes: int) -> None:
        pool.free_all_blocks()
        monkeypatch.setenv("CUPY_GPU_MEMORY_LIMIT", str(int(nbytes)))
        pool.set_limit(size=int(nbytes))

    yield cap
    pool.free_all_blocks()
    pool.set_limit(size=before)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _SESSION_CACHE is not None:
        import shutil

        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """With ``DGC_TRACE_POOL=FILE``: after each test, CuPy's pool in use in this process,
    appended to FILE (a test that leaves device arrays alive shows as a step up)."""
    trace = os.environ.get("DGC_TRACE_POOL")
    if not trace or "cupy" not in sys.modules:
        return
    import gc

    gc.collect()
    pool = sys.modules["cupy"].get_default_memory_pool()
    with open(trace, "a") as f:
        f.write(f"{pool.used_bytes()} {pool.total_bytes()} {item.nodeid}\n")
