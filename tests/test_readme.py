"""README.md's and the docs pages' examples run as written: each Python block as a script of
its own, in a fresh process (as a user pastes it into a file), and the batch recipe's commands
take the options they give them. The README stays short and links every page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dask_gpuchunk.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"
#: The pages a user reads (the README links each).
PAGES = [README, *(README.parent / "docs" / f"{name}.md" for name in
                   ("usage", "cli", "clusters", "gpu-memory", "performance", "development"))]
TEXT = "\n".join(page.read_text() for page in PAGES)
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)
BASH_BLOCKS = re.findall(r"```bash\n(.*?)```", TEXT, flags=re.S)


def test_readme_has_python_examples():
    assert len(re.findall(r"```python\n", README.read_text())) >= 3


def test_readme_is_short_and_links_every_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, page.name


@pytest.mark.slow  # a process each, as the examples' scripts: CI's first job runs them
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs_as_a_script(index, tmp_path):
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(PYTHON_BLOCKS[index])
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


def _commands(prefix: str) -> list[str]:
    """The README's shell commands that start with ``prefix`` (continuation lines joined)."""
    found = []
    for block in BASH_BLOCKS:
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split("#")[0].strip().rstrip("&").strip()
            for part in re.split(r"\s*(?:&&|;)\s*", line):
                part = re.sub(r"^srun\s+", "", part)
                if part.startswith(prefix):
                    found.append(part)
    return found


def _options(command: str) -> set[str]:
    return set(re.findall(r"(?<!\S)(--[a-z][a-z-]*)", command))


def test_batch_recipe_dask_worker_takes_the_options_it_is_given():
    commands = _commands("dask worker ")
    assert commands, "README has no 'dask worker' command for machines without GPUs"
    help_text = subprocess.run([sys.executable, "-m", "distributed.cli.dask_worker", "--help"],
                               capture_output=True, text=True, timeout=120, check=True).stdout
    for command in commands:
        for option in _options(command):
            assert option in help_text, f"dask worker has no {option} ({command})"


def test_batch_recipe_jobs_take_the_options_they_are_given():
    commands = _commands("dask-gpuchunk ")
    assert commands
    for command in commands:
        subcommand = command.split()[1]
        help_text = CliRunner().invoke(main, [subcommand, "--help"]).output
        for option in _options(command):
            assert option in help_text, f"dask-gpuchunk {subcommand} has no {option}"
    assert all("--workers" in c for c in commands if "--scheduler-file" in c), (
        "jobs joining a batch cluster wait for its workers")


def test_readme_names_the_test_command_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest" in README.read_text() and "python -m pytest" in ci


def test_readme_speaks_to_users_not_to_the_project_history():
    text = README.read_text()
    for label in ("seed 00", "Seed 00", "session", "seed's"):
        assert label not in text, label
