"""The walk of a scalar function's statements, typed by NumPy's rules: assignments, ``if``,
loops (``for`` over ``range``, ``while``, ``break``, ``continue``) and returns, each name a new
variable at each assignment, types joined where paths meet (see
:mod:`dask_gpuchunk.ufunc.translate`). No dask here.
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .numpy_rules import UNKNOWN, Emitter, RuleError, Value, VType, int_bounds
from .source_capture import Sources
from .translate_expressions import BINOPS, Expressions, assigned_names

__all__ = ["Helpers", "Walker"]


class Helpers:
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



class Walker(Expressions):
    """Types and translates one function (the user's, or a helper it calls) for one signature."""

    def __init__(self, func: Callable, node: ast.FunctionDef | ast.Lambda, filename: str,
                 name: str, emitter: Emitter, helpers: Helpers,
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
            op = BINOPS.get(type(stmt.op))
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
        assigned = assigned_names(stmt.body) | ({target} if target else set())
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
