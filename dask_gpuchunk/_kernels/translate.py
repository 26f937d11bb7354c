"""Translate a scalar Python function into source that computes by NumPy's rules.

``translate(func, argtypes)`` reads ``func``'s source, walks it once per dtype signature with
the types of :mod:`~dask_gpuchunk._kernels.numpy_rules`, and writes a new function ``f`` in
which every operation's types are explicit. numba (CPU or CUDA) compiles ``f`` and computes, for
every value, what NumPy computes when ``func`` is called on NumPy scalars of those dtypes.

Each assignment makes a new variable (``v3_x``), so a name may change type as the function
runs, as in Python. Where paths meet (after an ``if``, at a loop's head) a name must have one
type (:meth:`~dask_gpuchunk._kernels.numpy_rules.Emitter.join`).

The subset translated: assignments (also ``+=`` and tuples), ``if``/``elif``/``else``,
``for`` over ``range``, ``while``, ``break``, ``continue``, ``return``; arithmetic, comparisons,
``and``/``or``/``not``, conditional expressions; numbers, the arguments, globals and closure
variables holding numbers; ``math``, ``cmath``, NumPy ufuncs and scalar types (``np.float32(x)``),
``abs``, ``min``, ``max``, ``float``, ``int``, ``complex``, ``bool``, ``pow``; ``.real``,
``.imag``, ``.conjugate()``; and other plain Python functions of the same subset, translated
for the types they are called with. Anything else is refused with the line it is on.
No dask here.
"""

from __future__ import annotations

import ast
import builtins
import cmath
import hashlib
import inspect
import math
import os
import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .numpy_rules import UNKNOWN, Emitter, RuleError, Value, VType, int_bounds
from .user_functions import is_numba_function

__all__ = ["Sources", "Translation", "capture_sources", "check_call", "code_key", "translate"]


@dataclass(frozen=True)
class Translation:
    """What :func:`translate` gives for one dtype signature.

    ``source`` defines the functions named in ``functions`` (the translated helpers first,
    ``f`` last), all to be compiled for the target with the globals of
    :func:`dask_gpuchunk._kernels.numpy_ops.namespace`. ``result_dtype`` is NumPy's dtype for
    the function's result; ``f`` returns values of ``out_dtype`` (the result dtype unless
    another was asked for). A function that returns a tuple of numbers (NumPy's ``nout``
    convention) has one dtype per value in ``result_dtypes`` and ``out_dtypes``, and ``nout``. ``call_checks`` is what the call must check of values computed from
    the Python numbers given as arguments, as NumPy would raise
    (:class:`~dask_gpuchunk._kernels.numpy_rules.Emitter`; :func:`check_call` checks them).
    """

    source: str
    functions: tuple[str, ...]
    result_dtypes: tuple[np.dtype, ...]
    out_dtypes: tuple[np.dtype, ...]
    call_checks: tuple[tuple[str, Any, Any, type, str], ...] = ()
    #: ``None`` where ``f`` returns one number; else the length of the tuple it returns.
    nout: int | None = None

    @property
    def result_dtype(self) -> np.dtype:
        """NumPy's dtype of the result (the first, where ``f`` returns a tuple)."""
        return self.result_dtypes[0]

    @property
    def out_dtype(self) -> np.dtype:
        """What ``f`` returns (the first value's dtype, where it returns a tuple)."""
        return self.out_dtypes[0]


def check_call(translation: Translation, args: Sequence[Any]) -> None:
    """Raise what NumPy raises for these arguments where the translation's ``call_checks`` fail
    (a Python integer out of bounds for the dtype it meets, a negative integer power).

    Examples
    --------
    >>> from dask_gpuchunk._kernels.numpy_rules import weak_type
    >>> t = translate(lambda a, k: a * (k + 1), [VType(np.dtype("int8")), weak_type(0, 1)])
    >>> check_call(t, [None, 126])
    >>> check_call(t, [None, 127])
    Traceback (most recent call last):
    ...
    OverflowError: Python integer 128 out of bounds for int8
    """
    scope = {"args": list(args), "math": math, "cmath": cmath,
             "__builtins__": {"abs": abs, "int": int, "float": float, "complex": complex,
                              "bool": bool}}
    for expr, low, high, exc_type, message in translation.call_checks:
        value = eval(expr, scope)  # noqa: S307 - written by the translator from the user's code
        if not low <= value <= high:
            raise exc_type(message.format(value=value))


def translate(func: Callable, argtypes: Sequence[VType],
              out_dtype: np.dtype | Sequence[np.dtype] | None = None,
              sources: Sources | None = None) -> Translation:
    """Translate ``func`` for arguments of these types (see the module's docstring).

    Parameters
    ----------
    func
        A plain Python function (or lambda) of ``len(argtypes)`` positional arguments, defined
        where its source can be read (a file, a notebook cell, a doctest).
    argtypes
        Each argument's type: ``VType(dtype)`` for a NumPy array or scalar,
        :func:`~dask_gpuchunk._kernels.numpy_rules.weak_type` for a Python number.
    out_dtype
        What ``f`` returns (each result converted as ``astype`` converts); default NumPy's
        result dtype. A sequence of dtypes for a function that returns a tuple.
    sources
        The source of the function and its helpers as :func:`capture_sources` took it where
        they were defined; a function found there is never read again (a worker process
        cannot read a function defined in the client's ``__main__`` script or notebook).

    Raises
    ------
    TypeError
        Where the function uses something outside the translated subset, or something whose
        NumPy result cannot be computed by a compiled kernel; ``OverflowError``,
        ``ValueError``, ``ZeroDivisionError`` where NumPy itself raises them for these types or
        constants. The message names the function and the line.

    Examples
    --------
    >>> from dask_gpuchunk._kernels.numpy_rules import weak_type
    >>> t = translate(lambda x: x * 0.1 + 0.7, [VType(np.dtype("float32"))])
    >>> t.result_dtype
    dtype('float32')
    >>> print(t.source.strip())
    def f(a0):
        return (_nr_multiply_f4(a0, _nr_f4(0.10000000149011612)) + _nr_f4(0.699999988079071))
    """
    argtypes = tuple(argtypes)
    sources = sources or {}
    node, filename = _function_node(func, sources)
    name = getattr(func, "__name__", "function")
    emitter = Emitter()
    for attempt in range(2):
        helpers = _Helpers(sources)
        walker = _Walker(func, node, filename, name, emitter, helpers, out_dtype)
        try:
            walker.translate_function(argtypes, "f")
        except RuleError as exc:
            where = os.path.basename(filename)
            if exc.exc_type is TypeError:
                raise TypeError(f"dg.elementwise cannot compile {name!r} by NumPy's rules: "
                                f"{where}, {exc}") from None
            raise exc.exc_type(f"{name!r} ({where}), {exc} (as NumPy raises)") from None
        nout = walker.nout
        if nout is None:
            result: tuple[np.dtype, ...] = (np.result_type(*(vt.dtype for vt in walker.returns)),)
        else:
            result = tuple(np.result_type(*(r[k].dtype for r in walker.returns))
                           for k in range(nout))
        if out_dtype is not None:
            break
        out_dtype = result[0] if nout is None else result  # a second walk converts to them
        emitter = Emitter()
    outs = (out_dtype,) if nout is None else tuple(out_dtype)
    if len(outs) != len(result):
        raise TypeError(f"dg.elementwise: {name!r} returns {len(result)} values, dtype= gives "
                        f"{len(outs)}")
    source = "\n".join([*helpers.sources, walker.source]) + "\n"
    return Translation(source, (*helpers.names, "f"), tuple(np.dtype(d) for d in result),
                       tuple(np.dtype(d) for d in outs),
                       tuple(dict.fromkeys(emitter.call_checks)), nout)


# ---- the function's source -----------------------------------------------------------------

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


def _function_node(func: Callable,
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
    """As :func:`_function_node`, holding ``_ast_lock``; ``carried`` is the file's name and
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


# ---- the walk ----------------------------------------------------------------------------

class _Object:
    """A Python object named in the function that is not a number (a module, a function)."""

    def __init__(self, obj: Any, path: str) -> None:
        self.obj = obj
        self.path = path


class _Helpers:
    """The user's helper functions translated so far, for one translation."""

    def __init__(self, texts: Sources) -> None:
        #: The carried source files (:func:`capture_sources`), for the helpers' sources too.
        self.texts = texts
        self.sources: list[str] = []
        self.names: list[str] = []
        self.results: dict[tuple, tuple[str, VType]] = {}
        self.active: set[Any] = set()


@dataclass
class _Loop:
    """A loop being walked: its carried names, their head variables and types, and the
    environments seen at its ``break`` and ``continue`` statements."""

    heads: dict[str, Value]
    exits: list[dict[str, Value]] = field(default_factory=list)


_BUILTIN_NUMBERS = {"float", "int", "complex", "bool"}
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
           ast.Mod: "%", ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
           ast.LShift: "<<", ast.RShift: ">>"}
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_UNARYOPS = {ast.USub: "-", ast.UAdd: "+", ast.Invert: "~"}


class _Walker:
    """Types and translates one function (the user's, or a helper it calls) for one signature."""

    def __init__(self, func: Callable, node: ast.FunctionDef | ast.Lambda, filename: str,
                 name: str, emitter: Emitter, helpers: _Helpers,
                 out_dtype: np.dtype | None) -> None:
        self.func = func
        self.node = node
        self.filename = filename
        self.name = name
        self.emitter = emitter
        self.helpers = helpers
        self.out_dtype = out_dtype
        #: Each return's type (a tuple of them where the function returns a tuple).
        self.returns: list[Any] = []
        #: ``None`` while every return gives one number; the tuple's length where they give
        #: tuples (the function's own returns only: a helper returns one number).
        self.nout: int | None = None
        self.return_kind: str | None = None
        self.return_values: list[tuple[list[str], int, Value]] = []
        self.count = 0
        self.loops: list[_Loop] = []
        self.line = getattr(node, "lineno", 0)
        self.undefined: dict[str, str] = {}
        self.source = ""
        #: A helper's result type, once known (its returns are converted to it).
        self.return_type: VType | None = None
        #: The bounds of the index of the ``for`` loop whose header was just read.
        self.range_bounds: tuple[int, int] | None = None

    # ---- errors and names --------------------------------------------------------------
    def fail(self, message: str, exc_type: type[Exception] = TypeError) -> RuleError:
        return RuleError(f"line {self.line}: {message}", exc_type)

    def fresh(self, name: str) -> str:
        self.count += 1
        return f"v{self.count}_{name}"

    def resolve_global(self, name: str) -> Any:
        code = self.func.__code__
        if name in code.co_freevars and self.func.__closure__:
            cell = self.func.__closure__[code.co_freevars.index(name)]
            try:
                return cell.cell_contents
            except ValueError:
                raise self.fail(f"{name!r} is not yet defined where the function was made") from None
        if name in self.func.__globals__:
            return self.func.__globals__[name]
        if hasattr(builtins, name):
            return getattr(builtins, name)
        raise self.fail(f"name {name!r} is not defined")

    # ---- the function --------------------------------------------------------------------
    def translate_function(self, argtypes: Sequence[VType], fname: str) -> None:
        node = self.node
        args = node.args
        if args.vararg or args.kwarg:
            raise self.fail("*args and **kwargs are not supported")
        positional = [*args.posonlyargs, *args.args]
        if len(argtypes) > len(positional):
            raise self.fail(f"takes {len(positional)} positional arguments, got {len(argtypes)}")
        env: dict[str, Value] = {}
        params = []
        for i, (a, vt) in enumerate(zip(positional, argtypes)):
            params.append(f"a{i}")
            env[a.arg] = Value(f"a{i}", vt)
        # Positional parameters not passed, and keyword-only ones: their defaults.
        defaults = list(self.func.__defaults__ or ())
        missing = positional[len(argtypes):]
        if missing:
            if len(missing) > len(defaults):
                raise self.fail(f"takes {len(positional)} arguments, got {len(argtypes)}")
            for a, value in zip(missing, defaults[len(defaults) - len(missing):]):
                env[a.arg] = self.number(value, f"the default of {a.arg!r}")
        kwdefaults = self.func.__kwdefaults__ or {}
        for a in args.kwonlyargs:
            if a.arg not in kwdefaults:
                raise self.fail(f"keyword-only argument {a.arg!r} has no default")
            env[a.arg] = self.number(kwdefaults[a.arg], f"the default of {a.arg!r}")
        body = [ast.Return(node.body, lineno=node.lineno, col_offset=0)] if isinstance(
            node, ast.Lambda) else node.body
        lines, _, terminated = self.block(body, env, 1)
        if not terminated:
            raise self.fail("the function can end without returning a value (every path must "
                            "return a number)")
        if not self.returns:
            raise self.fail("the function returns no value")
        self.source = "\n".join([f"def {fname}({', '.join(params)}):", *lines])

    def number(self, value: Any, what: str) -> Value:
        if isinstance(value, (bool, int, float, complex)):
            try:
                return self.emitter.constant(value)
            except RuleError as exc:
                raise self.fail(f"{what}: {exc}", exc.exc_type) from None
        if isinstance(value, np.generic):
            try:
                return self.emitter.numpy_constant(value)
            except RuleError as exc:
                raise self.fail(f"{what}: {exc}") from None
        raise self.fail(f"{what} is {type(value).__name__}, not a number")

    # ---- statements ----------------------------------------------------------------------
    def block(self, stmts: list[ast.stmt], env: dict[str, Value],
              depth: int) -> tuple[list[str], dict[str, Value], bool]:
        """Translate ``stmts``: their lines (indented ``depth`` levels), the environment after
        them, and whether every path through them ended (return, break, continue)."""
        out: list[str] = []
        env = dict(env)
        for stmt in stmts:
            self.line = getattr(stmt, "lineno", self.line)
            terminated = self.statement(stmt, env, out, depth)
            if terminated:
                return out, env, True
        return out, env, False

    def statement(self, stmt: ast.stmt, env: dict[str, Value], out: list[str],
                  depth: int) -> bool:
        pad = "    " * depth
        if isinstance(stmt, ast.Expr):
            if isinstance(stmt.value, ast.Constant):  # a docstring
                return False
            raise self.fail("an expression whose value is not used (elementwise functions "
                            "have no side effects)")
        if isinstance(stmt, ast.Pass):
            return False
        if isinstance(stmt, ast.Return):
            if stmt.value is None:
                raise self.fail("'return' without a value")
            if isinstance(stmt.value, ast.Tuple):
                return self.tuple_return(stmt.value, env, out, pad)
            self.check_return_kind("a number")
            value = self.expr(stmt.value, env)
            self.returns.append(value.vt)
            out.append(f"{pad}return {self.result(value)}")
            return True
        if isinstance(stmt, ast.Assign):
            self.assign(stmt.targets, stmt.value, env, out, pad)
            return False
        if isinstance(stmt, ast.AnnAssign):
            if stmt.value is None:
                return False
            self.assign([stmt.target], stmt.value, env, out, pad)
            return False
        if isinstance(stmt, ast.AugAssign):
            if not isinstance(stmt.target, ast.Name):
                raise self.fail("augmented assignment to something other than a name")
            op = _BINOPS.get(type(stmt.op))
            current = self.load(stmt.target.id, env)
            value = self.rule(lambda: self.emitter.binary(op, current, self.expr(stmt.value, env)))
            self.bind(stmt.target.id, value, env, out, pad)
            return False
        if isinstance(stmt, ast.If):
            return self.if_statement(stmt, env, out, depth)
        if isinstance(stmt, (ast.For, ast.While)):
            return self.loop(stmt, env, out, depth)
        if isinstance(stmt, (ast.Break, ast.Continue)):
            if not self.loops:
                raise self.fail(f"'{type(stmt).__name__.lower()}' outside a loop")
            loop = self.loops[-1]
            loop.exits.append(dict(env))
            out.extend(self.head_assignments(loop, env, pad))
            out.append(f"{pad}{type(stmt).__name__.lower()}")
            return True
        raise self.fail(f"'{type(stmt).__name__}' statements are not supported in elementwise "
                        "functions")

    def check_return_kind(self, kind: str) -> None:
        """Every return of one function gives the same kind of result."""
        if self.return_kind is None:
            self.return_kind = kind
        elif self.return_kind != kind:
            raise self.fail(f"this return gives {kind}, an earlier one {self.return_kind} (every "
                            "return must give as many values)")

    def tuple_return(self, node: ast.Tuple, env: dict[str, Value], out: list[str],
                     pad: str) -> bool:
        """``return a, b, ...``: one output per value (NumPy's ``nout``)."""
        if self.return_type is not None or self.helpers.active:
            raise self.fail("a helper function returns one number, not a tuple (only the "
                            "elementwise function itself returns several values)")
        if not node.elts or any(isinstance(e, ast.Starred) for e in node.elts):
            raise self.fail("return a tuple of one or more plain values")
        self.check_return_kind(f"a tuple of {len(node.elts)} values")
        self.nout = len(node.elts)
        values = [self.expr(e, env) for e in node.elts]
        self.returns.append(tuple(v.vt for v in values))
        parts = [self.result(v, k) for k, v in enumerate(values)]
        out.append(f"{pad}return ({', '.join(parts)},)")
        return True

    def result(self, value: Value, position: int | None = None) -> str:
        """What a ``return`` returns: the helper's one type, or the output's dtype (as
        ``astype`` converts; the ``position``-th output's for a tuple); a placeholder while
        neither is known."""
        if self.return_type is not None:
            return self.rule(lambda: self.convert_joined(value, self.return_type))
        if self.out_dtype is None:
            return "0"
        several = isinstance(self.out_dtype, tuple)
        if several != (position is not None):
            raise self.fail(f"the function returns {'several values' if position is not None else 'one value'}"
                            f", dtype= gives {len(self.out_dtype) if several else 'one'}")
        if several and self.nout != len(self.out_dtype):
            raise self.fail(f"the function returns {self.nout} values, dtype= gives "
                            f"{len(self.out_dtype)}")
        dtype = self.out_dtype if position is None else self.out_dtype[position]
        return self.rule(lambda: self.emitter.convert(value, dtype, astype=True))

    def assign(self, targets: list[ast.expr], value_node: ast.expr, env: dict[str, Value],
               out: list[str], pad: str) -> None:
        for target in targets:
            if isinstance(target, (ast.Tuple, ast.List)):
                if not isinstance(value_node, (ast.Tuple, ast.List)) or len(
                        value_node.elts) != len(target.elts):
                    raise self.fail("tuple assignment needs a tuple of as many values")
                values = [self.expr(v, env) for v in value_node.elts]  # all before any binding
                for t, v in zip(target.elts, values):
                    if not isinstance(t, ast.Name):
                        raise self.fail("assignment to something other than a name")
                    self.bind(t.id, v, env, out, pad)
                return
        value = self.expr(value_node, env)
        for target in targets:
            if not isinstance(target, ast.Name):
                raise self.fail("assignment to something other than a name (subscripts and "
                                "attributes are not supported)")
            self.bind(target.id, value, env, out, pad)

    def bind(self, name: str, value: Value, env: dict[str, Value], out: list[str],
             pad: str) -> None:
        var = self.fresh(name)
        out.append(f"{pad}{var} = {value.expr}")
        env[name] = Value(var, value.vt)
        self.undefined.pop(name, None)

    def if_statement(self, stmt: ast.If, env: dict[str, Value], out: list[str],
                     depth: int) -> bool:
        pad = "    " * depth
        test = self.condition(stmt.test, env)
        line = self.line
        body, env_body, end_body = self.block(stmt.body, env, depth + 1)
        self.line = line
        other, env_other, end_other = self.block(stmt.orelse, env, depth + 1)
        self.line = line
        if end_body and end_other:
            merged, ended = {}, True
        elif end_body:
            merged, ended = env_other, False
        elif end_other:
            merged, ended = env_body, False
        else:
            merged, ended = self.merge([(env_body, body), (env_other, other)], depth + 1,
                                       f"after the if at line {line}"), False
        out.append(f"{pad}if {test}:")
        out.extend(body or [f"{pad}    pass"])
        if other:
            out.append(f"{pad}else:")
            out.extend(other)
        for name in set(env) | set(merged):
            if name not in merged:
                self.undefined[name] = f"it is set only on some paths before line {self.line}"
        env.clear()
        env.update(merged)
        return ended

    def merge(self, branches: list[tuple[dict[str, Value], list[str]]], depth: int,
              where: str) -> dict[str, Value]:
        """One environment from branches that all go on: a new variable, of the joined type,
        assigned at the end of each branch, for every name whose value differs."""
        pad = "    " * depth
        names = set.intersection(*(set(e) for e, _ in branches))
        merged: dict[str, Value] = {}
        for name in sorted(names):
            values = [e[name] for e, _ in branches]
            if all(v.expr == values[0].expr for v in values):
                merged[name] = values[0]
                continue
            vt = values[0].vt
            for v in values[1:]:
                vt = self.rule(lambda v=v, vt=vt: self.emitter.join(vt, v.vt, f"{name!r} {where}"))
            var = self.fresh(name)
            for (_, lines), v in zip(branches, values):
                lines.append(f"{pad}{var} = {self.rule(lambda v=v: self.convert_joined(v, vt))}")
            merged[name] = Value(var, replace(vt, const=vt.const, call=None))
        for e, _ in branches:
            for name in set(e) - names:
                self.undefined[name] = f"it is set only on some paths ({where})"
        return merged

    def convert_joined(self, value: Value, vt: VType) -> str:
        if value.vt == vt and not vt.weak:
            return value.expr
        if vt.weak:
            return value.expr if value.vt.dtype == vt.dtype else self.emitter.convert(
                value, vt.dtype)
        return self.emitter.convert(value, vt.dtype)

    def loop(self, stmt: ast.For | ast.While, env: dict[str, Value], out: list[str],
             depth: int) -> bool:
        pad = "    " * depth
        line = self.line
        if stmt.orelse:
            raise self.fail("'else' after a loop is not supported")
        header = ""
        target = None
        if isinstance(stmt, ast.For):
            header, target = self.range_header(stmt, env)
        assigned = _assigned_names(stmt.body) | ({target} if target else set())
        carried = sorted(n for n in assigned if n in env and n != target)
        if target in env:
            raise self.fail(f"the loop variable {target!r} is also set before the loop; use "
                            "another name")
        heads = {n: Value(self.fresh(n), env[n].vt) for n in carried}
        index = VType(np.dtype(np.int64), weak=True, bounds=self.range_bounds) if target else None
        for _ in range(12):
            body_env = {**env, **heads}
            if target:
                body_env[target] = Value(self.fresh(target), index)
            if not isinstance(stmt, ast.For):
                self.condition(stmt.test, body_env)
            loop = _Loop(heads)
            self.loops.append(loop)
            returns = len(self.returns)
            try:
                _, end_env, ended = self.block(stmt.body, body_env, depth + 1)
            finally:
                self.loops.pop()
                del self.returns[returns:]  # a trial walk: its types are not settled yet
            self.line = line
            seen = loop.exits + ([end_env] if not ended else [])
            new_heads = {}
            for n, head in heads.items():
                vt = head.vt
                for e in seen:
                    if n not in e:
                        raise self.fail(f"{n!r} is not set on every path through the loop")
                    vt = self.rule(lambda e=e, vt=vt: self.emitter.join(
                        vt, e[n].vt, f"{n!r} (carried by the loop at line {line})"))
                new_heads[n] = Value(head.expr, vt)
            if all(_same(new_heads[n].vt, heads[n].vt) for n in heads):
                break
            heads = new_heads
        else:
            raise self.fail("the types of the loop's variables do not settle")
        # The real walk, with the settled head types.
        for n in carried:
            out.append(f"{pad}{heads[n].expr} = "
                       f"{self.rule(lambda n=n: self.convert_joined(env[n], heads[n].vt))}")
        body_env = {**env, **heads}
        if target:
            var = self.fresh(target)
            body_env[target] = Value(var, index)
            out.append(f"{pad}for {var} in {header}:")
        else:
            out.append(f"{pad}while {self.condition(stmt.test, body_env)}:")
        loop = _Loop(heads)
        self.loops.append(loop)
        try:
            body, end_env, ended = self.block(stmt.body, body_env, depth + 1)
        finally:
            self.loops.pop()
        self.line = line
        if not ended:
            body.extend(self.head_assignments(loop, end_env, pad + "    "))
        out.extend(body or [f"{pad}    pass"])
        for n in assigned - set(carried):
            self.undefined[n] = f"it is set only inside the loop at line {line}"
            env.pop(n, None)
        env.update(heads)
        return False

    def head_assignments(self, loop: _Loop, env: dict[str, Value], pad: str) -> list[str]:
        lines = []
        for n, head in loop.heads.items():
            value = env[n]
            if value.expr != head.expr:
                lines.append(f"{pad}{head.expr} = "
                             f"{self.rule(lambda: self.convert_joined(value, head.vt))}")
        return lines

    def range_header(self, stmt: ast.For, env: dict[str, Value]) -> tuple[str, str]:
        if not isinstance(stmt.target, ast.Name):
            raise self.fail("the loop variable must be a name")
        it = stmt.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
                and it.func.id == "range" and self.resolve_global("range") is range
                and "range" not in env and 1 <= len(it.args) <= 3 and not it.keywords):
            raise self.fail("'for' loops must run over range(...)")
        args = []
        values = []
        for a in it.args:
            v = self.expr(a, env)
            if v.vt.kind not in "iub":
                raise self.fail(f"range() of {v.vt.describe()} (Python raises TypeError)")
            args.append(f"_nr_i8({v.expr})")
            values.append(int_bounds(v.vt) if v.vt.weak or v.vt.kind == "b" else (
                (int(np.iinfo(v.vt.dtype).min), int(np.iinfo(v.vt.dtype).max))))
        self.range_bounds = _range_bounds(values)
        return f"range({', '.join(args)})", stmt.target.id

    # ---- expressions -----------------------------------------------------------------------
    def rule(self, make: Callable[[], Any]) -> Any:
        """Call ``make`` (an emitter call), adding this line to a :class:`RuleError`."""
        try:
            return make()
        except RuleError as exc:
            if str(exc).startswith("line "):
                raise
            raise self.fail(str(exc), exc.exc_type) from None

    def load(self, name: str, env: dict[str, Value]) -> Value:
        if name in env:
            return env[name]
        if name in self.undefined:
            raise self.fail(f"{name!r} may be undefined here: {self.undefined[name]}")
        if name in _local_names(self.node):
            raise self.fail(f"{name!r} is used before it is set")
        obj = self.resolve_global(name)
        if isinstance(obj, (bool, int, float, complex, np.generic)):
            return self.number(obj, f"the global {name!r}")
        raise self.fail(f"{name!r} is {_describe(obj)}, not a number")

    def expr(self, node: ast.expr, env: dict[str, Value]) -> Value:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (bool, int, float, complex)):
                return self.rule(lambda: self.emitter.constant(node.value))
            raise self.fail(f"the constant {node.value!r} is not a number")
        if isinstance(node, ast.Name):
            return self.load(node.id, env)
        if isinstance(node, ast.BinOp):
            op = _BINOPS[type(node.op)] if type(node.op) in _BINOPS else None
            if op is None:
                raise self.fail(f"the operator {type(node.op).__name__} is not supported")
            left, right = self.expr(node.left, env), self.expr(node.right, env)
            return self.rule(lambda: self.emitter.binary(op, left, right))
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.Not):
                return self.rule(lambda: self.emitter.logical_not(self.expr(node.operand, env)))
            operand = self.expr(node.operand, env)
            return self.rule(lambda: self.emitter.unary(_UNARYOPS[type(node.op)], operand))
        if isinstance(node, ast.Compare):
            return self.compare(node, env)
        if isinstance(node, ast.BoolOp):
            return self.bool_op(node, env)
        if isinstance(node, ast.IfExp):
            test = self.condition(node.test, env)
            body, other = self.expr(node.body, env), self.expr(node.orelse, env)
            return self.choose(test, body, other, "the conditional expression")
        if isinstance(node, ast.Call):
            return self.call(node, env)
        if isinstance(node, ast.Attribute):
            base = self.operand_or_object(node.value, env)
            if isinstance(base, _Object):
                return self.object_attribute(base, node.attr)
            return self.rule(lambda: self.emitter.attribute(base, node.attr))
        raise self.fail(f"{type(node).__name__} expressions are not supported in elementwise "
                        "functions")

    def choose(self, test: str, body: Value, other: Value, what: str) -> Value:
        vt = self.rule(lambda: self.emitter.join(body.vt, other.vt, what))
        b = self.rule(lambda: self.convert_joined(body, vt))
        o = self.rule(lambda: self.convert_joined(other, vt))
        return Value(f"({b} if {test} else {o})", replace(vt, const=UNKNOWN, call=None))

    def condition(self, node: ast.expr, env: dict[str, Value]) -> str:
        """A bool expression for a test (if, while, a conditional expression)."""
        if isinstance(node, ast.BoolOp):
            word = " and " if isinstance(node.op, ast.And) else " or "
            return "(" + word.join(self.condition(v, env) for v in node.values) + ")"
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return f"(not {self.condition(node.operand, env)})"
        value = self.expr(node, env)
        return self.rule(lambda: self.emitter.truth(value))

    def compare(self, node: ast.Compare, env: dict[str, Value]) -> Value:
        operands = [self.expr(node.left, env), *(self.expr(c, env) for c in node.comparators)]
        results = []
        for op, left, right in zip(node.ops, operands, operands[1:]):
            if type(op) not in _CMPOPS:
                raise self.fail(f"the comparison {type(op).__name__} is not supported")
            results.append(self.rule(lambda op=op, left=left, right=right: self.emitter.compare(
                _CMPOPS[type(op)], left, right)))
        value = results[0]
        for nxt in results[1:]:
            vt = self.rule(lambda nxt=nxt, value=value: self.emitter.join(
                value.vt, nxt.vt, "a chained comparison"))
            value = Value(f"({value.expr} and {nxt.expr})", replace(vt, const=UNKNOWN))
        return value

    def bool_op(self, node: ast.BoolOp, env: dict[str, Value]) -> Value:
        # Python's value: 'a and b' is b where a is true, else a ('or' the other way round).
        values = [self.expr(v, env) for v in node.values]
        result = values[0]
        for v in values[1:]:
            test = self.rule(lambda result=result: self.emitter.truth(result))
            if isinstance(node.op, ast.And):
                result = self.choose(test, v, result, "the value of 'and'")
            else:
                result = self.choose(test, result, v, "the value of 'or'")
        return result

    def operand_or_object(self, node: ast.expr, env: dict[str, Value]) -> Value | _Object:
        """What a name or attribute chain stands for: a value, or a Python object (a module,
        a function, a type)."""
        if isinstance(node, ast.Name):
            if node.id in env or node.id in self.undefined:
                return self.load(node.id, env)
            obj = self.resolve_global(node.id)
            if isinstance(obj, (bool, int, float, complex, np.generic)):
                return self.number(obj, f"the global {node.id!r}")
            return _Object(obj, node.id)
        if isinstance(node, ast.Attribute):
            base = self.operand_or_object(node.value, env)
            if isinstance(base, _Object):
                try:
                    obj = getattr(base.obj, node.attr)
                except AttributeError:
                    raise self.fail(f"{base.path} has no attribute {node.attr!r}") from None
                if isinstance(obj, (bool, int, float, complex, np.generic)):
                    return self.number(obj, f"{base.path}.{node.attr}")
                return _Object(obj, f"{base.path}.{node.attr}")
            return self.rule(lambda: self.emitter.attribute(base, node.attr))
        return self.expr(node, env)

    def object_attribute(self, base: _Object, attr: str) -> Value:
        try:
            obj = getattr(base.obj, attr)
        except AttributeError:
            raise self.fail(f"{base.path} has no attribute {attr!r}") from None
        return self.number(obj, f"{base.path}.{attr}")

    def call(self, node: ast.Call, env: dict[str, Value]) -> Value:
        if node.keywords:
            raise self.fail("keyword arguments in calls are not supported")
        if any(isinstance(a, ast.Starred) for a in node.args):
            raise self.fail("*args in calls are not supported")
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("conjugate", "conj"):
            base = self.operand_or_object(node.func.value, env)
            if not isinstance(base, _Object):
                if node.args:
                    raise self.fail(f".{node.func.attr}() takes no arguments")
                return self.emitter.conjugate(base)
        callee = self.operand_or_object(node.func, env)
        if not isinstance(callee, _Object):
            raise self.fail("calling a number")
        obj, path = callee.obj, callee.path
        args = [self.expr(a, env) for a in node.args]
        return self.rule(lambda: self.call_object(obj, path, args))

    def call_object(self, obj: Any, path: str, args: list[Value]) -> Value:
        em = self.emitter
        if obj is abs:
            self.arity(path, args, 1)
            return em.absolute(args[0])
        if obj in (min, max):
            if len(args) < 2:
                raise RuleError(f"{path}() needs two or more numbers here")
            op = ">" if obj is max else "<"
            result = args[0]
            for v in args[1:]:
                # Python's min/max: the first of the smallest/largest (nan is never chosen
                # over a number it follows).
                test = em.truth(em.compare(op, v, result))
                result = self.choose(test, v, result, f"the value of {path}()")
            return result
        if obj is pow:
            self.arity(path, args, 2)
            return em.binary("**", args[0], args[1])
        if obj in (float, int, complex, bool):
            if not 1 <= len(args) <= (2 if obj is complex else 1):
                raise RuleError(f"{path}() with {len(args)} arguments is not supported")
            return em.python_number(obj.__name__, args)
        if isinstance(obj, (types.BuiltinFunctionType, types.FunctionType)) and getattr(
                obj, "__self__", None) is math or getattr(obj, "__module__", None) == "math":
            return em.math_call(obj.__name__, args)
        if getattr(obj, "__self__", None) is cmath or getattr(obj, "__module__", None) == "cmath":
            return em.cmath_call(obj.__name__, args)
        if isinstance(obj, np.ufunc):
            return em.ufunc_call(obj, args)
        dtype = _scalar_type(obj)
        if dtype is not None:
            self.arity(path, args, 1)
            return em.numpy_cast(dtype, args[0])
        if is_numba_function(obj) and isinstance(obj.py_func, types.FunctionType):
            # An @njit or CUDA device function: its Python function, translated as any helper.
            return self.call_helper(obj.py_func, path, args)
        if hasattr(obj, "py_func") or type(obj).__module__.startswith("numba"):
            raise RuleError(f"{path} is {_describe(obj)}, which elementwise functions cannot "
                            "call; call a plain Python, @njit or @cuda.jit(device=True) "
                            "function, or pass rules='numba' to compile the whole function as "
                            "numba types it")
        if isinstance(obj, types.FunctionType):
            return self.call_helper(obj, path, args)
        raise RuleError(f"{path} is {_describe(obj)}, which elementwise functions cannot call")

    @staticmethod
    def arity(path: str, args: list[Value], n: int) -> None:
        if len(args) != n:
            raise RuleError(f"{path}() takes {n} argument(s) here, got {len(args)}")

    def call_helper(self, func: types.FunctionType, path: str, args: list[Value]) -> Value:
        """A call of another plain Python function: translated for these argument types as a
        function of its own (once per types)."""
        helpers = self.helpers
        argtypes = tuple(replace(v.vt, call=None, alt=None) for v in args)
        key = (func, tuple((vt.dtype, vt.weak, vt.const if vt.weak else None,
                            type(vt.const)) for vt in argtypes))
        found = helpers.results.get(key)
        if found is None:
            if func in helpers.active:
                raise RuleError(f"{path} calls itself: recursion is not supported")
            node, filename = _function_node(func, helpers.texts)
            fname = f"h{len(helpers.names) + 1}_{func.__name__}"
            walker = _Walker(func, node, filename, func.__qualname__, self.emitter, helpers, None)
            helpers.active.add(func)
            try:
                walker.translate_helper(argtypes, fname)
            except RuleError as exc:
                raise RuleError(f"in {func.__qualname__} ({filename}): {exc}", exc.exc_type) from None
            finally:
                helpers.active.discard(func)
            helpers.sources.append(walker.source)
            helpers.names.append(fname)
            found = helpers.results[key] = (fname, walker.return_type)
        fname, vt = found
        return Value(f"{fname}({', '.join(v.expr for v in args)})", vt)

    def translate_helper(self, argtypes: tuple[VType, ...], fname: str) -> None:
        """Translate a helper: its returns all converted to the join of their types."""
        # A first walk finds the return types; the second writes them converted to one type.
        self.translate_function(argtypes, fname)
        joined = self.returns[0]
        for vt in self.returns[1:]:
            joined = self.rule(lambda joined=joined, vt=vt: self.emitter.join(
                joined, vt, f"the result of {self.name}"))
        self.return_type = replace(joined, call=None)
        self.returns = []
        self.count = 0
        self.undefined = {}
        self.translate_function(argtypes, fname)


def _range_bounds(args: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    """The least and greatest index of ``range(*args)`` given each argument's bounds."""
    if any(a is None for a in args):
        return None
    if len(args) == 1:
        start, stop, step = (0, 0), args[0], (1, 1)
    else:
        start, stop = args[0], args[1]
        step = args[2] if len(args) == 3 else (1, 1)
    if step[0] > 0:
        return (start[0], max(start[0], stop[1] - 1))
    if step[1] < 0:
        return (min(start[1], stop[0] + 1), start[1])
    return None


def _same(a: VType, b: VType) -> bool:
    return a == b and (a.alt is None) == (b.alt is None) and (
        a.const is b.const or (a.const is not UNKNOWN and b.const is not UNKNOWN
                               and a.const == b.const and type(a.const) is type(b.const)))


def _assigned_names(stmts: list[ast.stmt]) -> set[str]:
    names = set()
    for stmt in stmts:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def _local_names(node: ast.AST) -> set[str]:
    body = node.body if isinstance(node.body, list) else []
    return _assigned_names(body)


def _scalar_type(obj: Any) -> np.dtype | None:
    """The dtype of a NumPy scalar type (``np.float32``) or a numba number type."""
    if isinstance(obj, type) and issubclass(obj, np.generic):
        return np.dtype(obj)
    if type(obj).__module__.startswith("numba.core.types"):
        try:
            return np.dtype(str(obj) if str(obj) != "bool" else "bool")
        except TypeError:
            return None
    return None


def _describe(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return f"the module {obj.__name__}"
    return f"a {type(obj).__name__}"

