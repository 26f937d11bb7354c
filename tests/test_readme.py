"""README.md's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102


def test_readme_names_the_test_command_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest" in README.read_text() and "python -m pytest" in ci
