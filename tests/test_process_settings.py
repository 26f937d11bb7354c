"""Nothing of the package changes the environment or a process-wide dask setting behind the
user's back: settings are set in ``with dask.config.set(...)`` blocks (scoped to what the
package runs), and only the command line, whose options a user gives, writes the environment
of the processes it starts."""

from __future__ import annotations

import ast
from pathlib import Path

import dask

import dask_gpuchunk as dg

PACKAGE = Path(dg.__file__).parent
#: The command's own process: --device-budget sets CUPY_GPU_MEMORY_LIMIT for its workers.
ENTRY_POINTS = {"cli"}  # the command line, a process of its own (a package)


def _unscoped_changes(tree: ast.AST) -> list[int]:
    """Lines that write ``os.environ`` or call ``dask.config.set`` / ``update`` outside a
    ``with`` statement's items."""
    scoped = {id(item.context_expr) for node in ast.walk(tree)
              if isinstance(node, (ast.With, ast.AsyncWith)) for item in node.items}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            if any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ"
                   for t in targets):
                found.append(node.lineno)
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("os.putenv", "os.unsetenv") or (
                    name.startswith("os.environ.") and name.split(".")[-1] in
                    ("update", "setdefault", "pop", "clear", "popitem")):
                found.append(node.lineno)
            if name in ("dask.config.set", "dask.config.update", "config.set") and \
                    id(node) not in scoped:
                found.append(node.lineno)
    return found


def test_no_module_changes_the_environment_or_dask_settings_for_good():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] in ENTRY_POINTS:
            continue
        lines = _unscoped_changes(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(PACKAGE))] = lines
    assert not found, found


def test_the_check_sees_each_kind_of_change():
    source = """
import os, dask
os.environ["A"] = "1"
os.environ.setdefault("B", "2")
del os.environ["C"]
dask.config.set(array_optimize=None)
with dask.config.set({"x": 1}):
    pass
"""
    assert sorted(_unscoped_changes(ast.parse(source))) == [3, 4, 5, 6]


def test_joining_a_cluster_leaves_dask_settings_as_they_were():
    from distributed import LocalCluster

    before = dask.config.get("array_optimize", None)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster:
        client = dg.connect(address=cluster.scheduler_address, timeout=10)
        try:
            assert dask.config.get("array_optimize", None) is before
            with dg.resolving_aliases():
                assert dask.config.get("array_optimize", None) is not before
        finally:
            client.close()
    assert dask.config.get("array_optimize", None) is before
