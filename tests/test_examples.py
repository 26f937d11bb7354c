"""Each example runs, at a small size, and checks its own result: as a script with the first
command its docstring gives (what a newcomer runs first), and through its ``main``."""

from __future__ import annotations

import ast
import importlib.util
import shlex
import subprocess
import sys
import time
from pathlib import Path

import dask.array as da
import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
QUERY_PLANNING = type(da.ones(1)).__module__.startswith("dask.array._array_expr")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_command(path: Path) -> list[str]:
    """The arguments of the first ``python examples/...`` line of the example's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    for line in doc.splitlines():
        line = line.strip()
        if line.startswith(f"python examples/{path.name}"):
            return shlex.split(line.split("#")[0])[2:]
    raise AssertionError(f"{path.name}'s docstring gives no command")


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.stem)
def test_the_first_command_of_each_example_runs_in_seconds_on_a_cpu(path, capsys):
    if path.stem == "fingerprint_neighbours" and QUERY_PLANNING:
        pytest.skip("threshold= needs dask's classic arrays")
    args = first_command(path)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(path), *args], cwd=EXAMPLES.parent,
                          capture_output=True, text=True, timeout=300, check=False)
    seconds = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the example printed nothing"
    # Seconds on a user's machine; CI's two cores run other tests beside it.
    assert seconds < 120, seconds
    # Its --help in this process (a process of its own took 1-2 s of CI's cores to import).
    with pytest.raises(SystemExit) as done_help:
        load(path.stem).main(["--help"])
    assert done_help.value.code == 0
    help_text = capsys.readouterr().out
    assert "usage:" in help_text and "seed" not in help_text.lower()


def test_every_option_of_every_example_says_what_it_is():
    for path in EXAMPLES.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "add_argument"):
                assert any(k.arg == "help" for k in node.keywords), (
                    f"{path.name}, line {node.lineno}: an option without help=")


@pytest.mark.parametrize("fma", [[], ["--fma"]])
def test_rk4_loop_agrees_eager_and_on_dask(fma):
    result = load("rk4_loop").main(["--n", "1001", "--steps", "6", "--chunks", "3", *fma])
    assert result["delta_error"] < 1e-5 and result["f_error"] < 1e-5


@pytest.mark.gpu
def test_product_pinned_on_gpu():
    assert load("product_larger_than_gpu").main(["--rows", "5000", "--cols", "64", "--chunk-mb", "0.5",
                                         "--pinned", "--device", "gpu"]) > 0


def test_gram_of_bits_streams_exact_rows(tmp_path):
    out = tmp_path / "c.npy"
    result = load("gram_of_bits").main(["--rows", "700", "--cols", "1043", "--chunk-rows", "256",
                                         "--out", str(out), "--samples", "700"])
    assert result["gram_seconds"] > 0
    c = np.load(out)
    assert c.shape == (700, 700) and c.dtype == np.int32
    np.testing.assert_array_equal(c, c.T)


@pytest.mark.gpu
def test_gram_of_bits_on_gpu(tmp_path):
    result = load("gram_of_bits").main(["--rows", "5000", "--cols", "20000", "--chunk-rows",
                                         "2048", "--out", str(tmp_path / "c.npy")])
    assert result["bit_macs_per_s"] > 0


def test_own_numba_kernels_agree_with_numpy():
    result = load("own_numba_kernels").main(["--rows", "3000", "--cols", "50", "--chunk-rows",
                                              "700", "--bit-rows", "300", "--bit-cols", "1000",
                                              "--slab", "128", "--n", "1001"])
    assert result["product_error"] < 1e-12 and result["rk4_error"] < 1e-5


@pytest.mark.gpu
def test_own_numba_kernels_on_gpu():
    result = load("own_numba_kernels").main(["--rows", "400000", "--cols", "100",
                                              "--bit-rows", "3000", "--bit-cols", "20000"])
    assert result["product_error"] < 1e-12 and result["rk4_error"] < 1e-5


@pytest.mark.skipif(type(da.ones(1)).__module__.startswith("dask.array._array_expr"),
                    reason="threshold= needs dask's classic arrays")
def test_fingerprint_neighbours_checks_its_rows():
    result = load("fingerprint_neighbours").main(["--rows", "1500", "--chunk-rows", "400",
                                                  "--samples", "4"])
    assert result["pairs_found"] >= 2 * (1500 // 100) - 2  # the planted near-duplicates
