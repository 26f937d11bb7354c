"""The expressions of a scalar function, typed and written by NumPy's rules: a part of
:class:`dask_gpuchunk.ufunc.translate_walk.Walker` (see :mod:`dask_gpuchunk.ufunc.translate`).

Names, numbers, arithmetic, comparisons, ``and`` / ``or``, conditional expressions, attributes
(``.real``, ``.imag``) and calls (``math``, ``cmath``, NumPy ufuncs and scalar types, builtins,
and the user's other plain Python functions, each translated for the types it is called with).
No dask here.
"""

from __future__ import annotations

import ast
import cmath
import math
import types
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from .numpy_rules import UNKNOWN, RuleError, Value, VType
from .source_capture import function_node
from .user_functions import is_numba_function

__all__ = ["BINOPS", "Expressions", "assigned_names"]

#: Python's binary operators, by their syntax node.
BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//",
           ast.Mod: "%", ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^",
           ast.LShift: "<<", ast.RShift: ">>"}
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_UNARYOPS = {ast.USub: "-", ast.UAdd: "+", ast.Invert: "~"}


class _Object:
    """A Python object named in the function that is not a number (a module, a function)."""

    def __init__(self, obj: Any, path: str) -> None:
        self.obj = obj
        self.path = path



class Expressions:
    """The walker's expressions (its methods need its state:
    :class:`~dask_gpuchunk.ufunc.translate_walk.Walker` takes this class as its base)."""

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
            op = BINOPS[type(node.op)] if type(node.op) in BINOPS else None
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
            node, filename = function_node(func, helpers.texts)
            fname = f"h{len(helpers.names) + 1}_{func.__name__}"
            walker = type(self)(func, node, filename, func.__qualname__, self.emitter, helpers, None)
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



def assigned_names(stmts: list[ast.stmt]) -> set[str]:
    names = set()
    for stmt in stmts:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def _local_names(node: ast.AST) -> set[str]:
    body = node.body if isinstance(node.body, list) else []
    return assigned_names(body)



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

