"""A scalar function's source, found and carried: what :mod:`dask_gpuchunk.ufunc.translate`
reads to translate it, on whichever process it runs.

:func:`capture_sources` takes the text of a function's file (and of every plain Python function
it calls, followed through its globals) where the function was defined, so that a worker without
that file (a ``__main__`` script, a notebook cell) reads the same source; :func:`function_node`
finds a function's ``def`` or ``lambda`` in that text once per code object. No dask here.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

__all__ = ["CAPTURED_FILE_MAX_BYTES", "CAPTURED_FUNCTIONS_MAX", "Sources", "capture_sources",
           "code_key", "function_node"]


# Each file's tree by its text, and each function's node and file by its code (and the source
# carried for it): parsed and found once a process.
_parsed: dict[str, ast.Module] = {}
_nodes: dict[tuple[types.CodeType, tuple[str, str] | None],
             tuple[ast.FunctionDef | ast.Lambda, str]] = {}


#: Held while parsing: CPython 3.11's ast module is not safe to use from several threads at
#: once ("AST constructor recursion depth mismatch", gh-106905), and Dask's threads translate
#: functions concurrently.
_ast_lock = threading.Lock()


#: A source file larger than this is not carried with a function (:func:`capture_sources`):
#: a worker reads it from its own disk, as an installed module's.
CAPTURED_FILE_MAX_BYTES = 4 * 2**20


#: The most functions :func:`capture_sources` follows from one function.
CAPTURED_FUNCTIONS_MAX = 256


#: What :func:`capture_sources` gives: for each function's code (:func:`code_key`), the name
#: of its source file and that file's text.
Sources = dict[tuple[str, int, bytes], tuple[str, str]]


def code_key(code: types.CodeType) -> tuple[str, int, bytes]:
    """What identifies a function's code in every process it is unpickled in: its name, first
    line and bytecode (cloudpickle rebuilds a ``__main__`` function's code with the file name
    ``<dynamic-code>``, so the name of its file is not kept)."""
    return code.co_name, code.co_firstlineno, code.co_code


def capture_sources(func: Callable) -> Sources:
    """The source files of ``func`` and of the plain Python functions it names (through its
    globals and closure variables, and theirs), read now, for those that cloudpickle sends by
    value (:func:`_pickled_by_value`): for each one's :func:`code_key`, its file's name and
    text.

    Given to :func:`translate` in another process (a Dask worker), they stand for those files:
    a function defined in a ``__main__`` script, a notebook cell or a doctest travels to the
    worker by value, but its source does not (the worker's ``__main__`` is not the script; a
    notebook's cells live in the client's memory; another host has no such file). Functions
    whose source cannot be read here are left out (:func:`translate` then says why).

    Examples
    --------
    >>> def twice(x):
    ...     return 2 * x
    >>> def f(x):
    ...     return twice(x) + 1
    >>> found = capture_sources(f)
    >>> filename, text = found[code_key(f.__code__)]
    >>> "return twice(x) + 1" in text and code_key(twice.__code__) in found
    True
    >>> capture_sources(eval("lambda x: x"))
    {}
    """
    found: Sources = {}
    texts: dict[str, str | None] = {}  # one read and one string per file
    seen: set[types.CodeType] = set()
    todo = [func]
    while todo and len(seen) < CAPTURED_FUNCTIONS_MAX:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if not isinstance(f, types.FunctionType) or code is None or code in seen:
            continue
        seen.add(code)
        if not _pickled_by_value(f):
            continue  # the other process imports it (and what it calls), and reads its file
        if code.co_filename not in texts:
            try:
                lines, _ = inspect.findsource(code)
            except (OSError, TypeError):
                lines = []
            text = "".join(lines)
            texts[code.co_filename] = text if 0 < len(text) <= CAPTURED_FILE_MAX_BYTES else None
        text = texts[code.co_filename]
        if text is not None:
            found[code_key(code)] = (code.co_filename, text)
        cells = dict(zip(code.co_freevars, f.__closure__ or ()))
        for name in _names_in(code):
            if name in cells:
                try:
                    todo.append(cells[name].cell_contents)
                except ValueError:  # a cell not yet filled
                    pass
            elif name in f.__globals__:
                todo.append(f.__globals__[name])
    return found


def _pickled_by_value(func: types.FunctionType) -> bool:
    """Whether cloudpickle sends ``func`` by value (its code, without its file): a function of
    ``__main__``, or one its module does not hold under its qualified name (nested, a lambda,
    one defined in a notebook cell or a doctest); else by reference, and the other process
    imports it."""
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return True
    found: Any = module
    for part in getattr(func, "__qualname__", "").split("."):
        found = getattr(found, part, None)
    return found is not func


def _names_in(code: types.CodeType) -> set[str]:
    """The global and free names ``code`` and the code nested in it (comprehensions,
    lambdas) refer to."""
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_in(const)
    return names


def function_node(func: Callable,
                   sources: Sources) -> tuple[ast.FunctionDef | ast.Lambda, str]:
    """The syntax tree of ``func`` (its ``def`` or ``lambda``) and its file's name, found in
    its source file (``sources``' text for it where given, else the file ``inspect`` reads)
    once per code object (``inspect.findsource`` takes milliseconds)."""
    code = getattr(func, "__code__", None)
    if not isinstance(func, types.FunctionType) or code is None:
        raise TypeError(f"dg.elementwise needs a plain Python function, got {func!r}")
    key = (code, sources.get(code_key(code)))
    found = _nodes.get(key)
    if found is None:
        with _ast_lock:
            found = _nodes.get(key)
            if found is None:
                found = _nodes[key] = _find_node(func, code, key[1])
    return found


def _find_node(func: types.FunctionType, code: types.CodeType,
               carried: tuple[str, str] | None) -> tuple[ast.FunctionDef | ast.Lambda, str]:
    """As :func:`function_node`, holding ``_ast_lock``; ``carried`` is the file's name and
    text where they were taken elsewhere (``None``: read them here)."""
    if carried is None:
        try:
            lines, _ = inspect.findsource(code)
        except (OSError, TypeError):
            raise TypeError(
                f"dg.elementwise cannot read the source of {func.__qualname__!r} (defined by "
                "exec or in an interactive prompt?), which it translates to follow NumPy's "
                "rules; define it in a file, a notebook cell or a doctest, or pass "
                "rules='numba' to compile it as numba types it") from None
        carried = code.co_filename, "".join(lines)
    filename, text = carried
    key = hashlib.sha256(f"{filename}\n{text}".encode()).hexdigest()
    tree = _parsed.get(key)
    if tree is None:
        tree = _parsed[key] = ast.parse(text)
    params = list(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
    candidates: list[ast.FunctionDef | ast.Lambda] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == code.co_name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        elif isinstance(node, ast.Lambda) and code.co_name == "<lambda>":
            first = node.lineno
        else:
            continue
        names = [a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]]
        if first == code.co_firstlineno and names == params:
            candidates.append(node)
    if len(candidates) > 1:
        # Several lambdas of the same arguments on one line: the one whose bytecode it is.
        same = [n for n in candidates if _compiles_to(n, code)]
        candidates = same or candidates[:1]
    if not candidates:
        raise TypeError(f"dg.elementwise cannot find the source of {func.__qualname__!r} in "
                        f"{filename} (was the file edited since it was imported?)")
    return candidates[0], filename


def _compiles_to(node: ast.FunctionDef | ast.Lambda, code: types.CodeType) -> bool:
    if not isinstance(node, ast.Lambda):
        return True
    try:
        compiled = compile(ast.Expression(node), code.co_filename, "eval")
    except SyntaxError:
        return False
    inner = [c for c in compiled.co_consts if isinstance(c, types.CodeType)]
    return bool(inner) and (inner[0].co_code, inner[0].co_consts) == (code.co_code,
                                                                       code.co_consts)
