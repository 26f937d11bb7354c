"""The declared dependencies are the tested ones: CI's oldest-dependencies job installs exactly
the lower bounds of ``pyproject.toml``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lower_bounds() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index("dependencies = ["):]
    block = block[:block.index("\n]")]
    bounds = {}
    for name, version in re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9.]+)"', block):
        bounds[name.lower()] = version
    return bounds


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def _release(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_ci_installs_every_lower_bound_exactly():
    bounds, pins = _lower_bounds(), _pins()
    assert set(bounds) == {"dask", "distributed", "numba", "numba-cuda", "numpy", "click",
                           "cryptography"}
    assert set(pins) == set(bounds)
    for name, bound in bounds.items():
        assert _release(pins[name]) == _release(bound), (name, bound, pins[name])


def test_ci_runs_every_job_with_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "install newest" in ci and "install oldest .ci/oldest.txt" in ci
    readme = (ROOT / "README.md").read_text()
    command = "python -m pytest -n auto --dist worksteal"
    assert command in readme
    assert ci.count("python -m pytest -q -n auto --dist worksteal") == 2
    assert "DASK_ARRAY__QUERY_PLANNING=True python -m pytest -q -n auto --dist worksteal" in ci
