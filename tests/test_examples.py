"""Each example runs, at a small size, and checks its own result."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_seed000_product():
    seconds = load("seed000_product").main(["--rows", "3000", "--cols", "50", "--chunk-mb", "0.3"])
    assert seconds > 0


def test_seed004_broadcast():
    times = load("seed004_broadcast").main(["--dates", "8", "--ids", "300", "--repeat", "1"])
    assert {"cpu", "auto"} <= set(times)


def test_seed002_rk4_loop_matches_numpy():
    result = load("seed002_rk4_loop").main(["--n", "64", "--steps", "5", "--chunk", "24",
                                             "--check"])
    assert result["error"] < 1e-4 and result["delta_error"] < 1e-4


@pytest.mark.gpu
def test_seed000_product_pinned_on_gpu():
    assert load("seed000_product").main(["--rows", "5000", "--cols", "64", "--chunk-mb", "0.5",
                                         "--pinned", "--device", "gpu"]) > 0
