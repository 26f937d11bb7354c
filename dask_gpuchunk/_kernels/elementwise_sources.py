"""The source of an elementwise function's kernels, generated per plan: the CPU twin's and
the CUDA kernel's passes (with reductions' partial rows), their signatures and namespaces."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..ufunc.numpy_rules import weak_type
from .elementwise_rules import ElementwisePlan, is_python_number, is_scalar
from .source_cache import load_kernel

__all__ = ["reduction_start"]

def _args(scalars: Sequence[bool], idx: str) -> tuple[str, str]:
    """Parameter list and call arguments: arrays are indexed, scalars passed as they are."""
    params = ", ".join(f"a{k}" for k in range(len(scalars)))
    call = ", ".join(f"a{k}" if scalar else f"a{k}[{idx}]" for k, scalar in enumerate(scalars))
    return params, call


class _Pass(NamedTuple):
    """What a generated kernel's signature and body depend on beyond its inputs: the number of
    outputs, whether ``f`` returns a tuple, each reduction as ``(output, op, partial dtype)``
    (``op``: sum, min or max; a mean is a sum) and, for CUDA, the dtype each reduction's total
    is written in (the pass's last block combines the blocks' partials into it)."""

    nout: int = 1
    tupled: bool = False
    reductions: tuple[tuple[int, str, np.dtype], ...] = ()
    totals: tuple[np.dtype, ...] = ()

    def params(self) -> str:
        outs = [f"o{k}" for k in range(self.nout)]
        partials = [f"p{r}" for r in range(len(self.reductions))]
        totals = [f"t{r}" for r in range(len(self.totals))] + (["cnt"] if self.totals else [])
        return ", ".join([*outs, *partials, *totals])

    def element(self, call: str, idx: str) -> list[str]:
        """One element: ``f`` called, each output stored, each reduction accumulated."""
        if not self.tupled:
            if not self.reductions:
                return [f"o0[{idx}] = f({call})"]
            lines = [f"r0 = f({call})", f"o0[{idx}] = r0"]
            values = ["r0"]
        else:
            lines = [f"r = f({call})"]
            lines += [f"o{k}[{idx}] = r[{k}]" for k in range(self.nout)]
            values = [f"r[{k}]" for k in range(self.nout)]
        for r, (k, op, dtype) in enumerate(self.reductions):
            value = values[k] if op != "sum" else f"np.{dtype.name}({values[k]})"
            lines.append(f"acc{r} = {_combine(op, f'acc{r}', value, dtype)}")
        return lines

    def start(self) -> list[str]:
        return [f"acc{r} = {_identity_name(op, dtype)}"
                for r, (_, op, dtype) in enumerate(self.reductions)]


def _identity_name(op: str, dtype: np.dtype) -> str:
    return f"_identity_{op}_{dtype.str[1:]}"


def reduction_start(op: str, dtype: np.dtype) -> Any:
    """What a reduction of no elements is, as a value of its partial dtype: 0 for a sum (or
    mean); for a min / max, the value every element replaces (NaN-propagating float ones start
    from infinities, integer ones from the dtype's bounds).

    Examples
    --------
    >>> reduction_start("min", np.dtype("int8")), reduction_start("max", np.dtype("f4"))
    (np.int8(127), np.float32(-inf))
    """
    if op in ("sum", "mean"):
        return dtype.type(0)
    if dtype.kind == "b":
        return np.bool_(op == "min")
    if dtype.kind == "f":
        return dtype.type(np.inf if op == "min" else -np.inf)
    info = np.iinfo(dtype)
    return dtype.type(info.max if op == "min" else info.min)


def _identities(reductions: Sequence[tuple[int, str, np.dtype]]) -> dict[str, Any]:
    """The start value of each reduction (:func:`reduction_start`), by :func:`_identity_name`."""
    return {_identity_name(op, dtype): reduction_start(op, dtype) for _, op, dtype in reductions}


def _combine(op: str, acc: str, value: str, dtype: np.dtype) -> str:
    """``acc`` combined with ``value``: a sum, or a min / max that propagates NaN as NumPy's."""
    if op == "sum":
        return f"{acc} + {value}"
    cmp = "<" if op == "min" else ">"
    if dtype.kind == "f":
        return f"({value} if ({value} {cmp} {acc} or {value} != {value}) else {acc})"
    return f"({value} if {value} {cmp} {acc} else {acc})"


def _cpu_source(scalars: Sequence[bool], ndim: int, spec: _Pass = _Pass()) -> str:
    outs = spec.params()
    if ndim == 1 and not spec.reductions:
        params, call = _args(scalars, "i")
        return "\n".join([
            f"def kernel({outs}, {params}):",
            "    for i in prange(o0.shape[0]):",
            *("        " + line for line in spec.element(call, "i")),
        ]) + "\n"
    # Blocks of the flat range, one per parallel iteration; each block unravels its start once,
    # then walks runs along the last axis (no division per element) and carries into the outer
    # axes at the end of each run. Reductions: one partial per block (their arrays' length).
    last = ndim - 1
    idx = ", ".join([f"i{d}" for d in range(last)] + ["j"])
    params, call = _args(scalars, idx)
    blocks = "p0.shape[0]" if spec.reductions else "min(n, 1024)"
    lines = [
        f"def kernel({outs}, {params}):",
        "    n = o0.size",
        f"    nblocks = {blocks}",
        "    for b in prange(nblocks):",
        "        start = b * n // nblocks",
        "        stop = (b + 1) * n // nblocks",
        *("        " + line for line in spec.start()),
        "        r = start",
    ]
    for d in range(last, 0, -1):
        lines.append(f"        i{d} = r % o0.shape[{d}]")
        lines.append(f"        r = r // o0.shape[{d}]")
    lines += [
        "        i0 = r",
        "        pos = start",
        "        while pos < stop:",
        f"            run = min(stop - pos, o0.shape[{last}] - i{last})",
        f"            for j in range(i{last}, i{last} + run):",
        *("                " + line for line in spec.element(call, idx)),
        "            pos += run",
        f"            i{last} += run",
    ]
    indent = "            "
    for d in range(last, 0, -1):
        lines.append(f"{indent}if i{d} == o0.shape[{d}]:")
        lines.append(f"{indent}    i{d} = 0")
        lines.append(f"{indent}    i{d - 1} += 1")
        indent += "    "
    lines += [f"        p{r}[b] = acc{r}" for r in range(len(spec.reductions))]
    return "\n".join(lines) + "\n"


def _block_combine(spec: _Pass, threads: int) -> list[str]:
    """Each thread's ``acc{r}`` combined over the block in shared memory (a tree), the block's
    value left in ``s{r}[0]``: at the kernel's indentation, every thread of the block taking
    part."""
    lines = []
    for r, (_, _, dtype) in enumerate(spec.reductions):
        lines.append(f"s{r}[t] = acc{r}")
    lines += ["cuda.syncthreads()", f"w = {threads // 2}", "while w > 0:", "    if t < w:"]
    for r, (_, op, dtype) in enumerate(spec.reductions):
        lines.append(f"        s{r}[t] = {_combine(op, f's{r}[t]', f's{r}[t + w]', dtype)}")
    lines += ["    cuda.syncthreads()", "    w //= 2"]
    return lines


def _cuda_source(scalars: Sequence[bool], ndim: int, spec: _Pass = _Pass(),
                 threads: int = 128) -> str:
    """One element per thread (:func:`_launch_config` covers the outputs with the grid), then a
    grid-stride loop for what a smaller grid leaves (numba's simulator runs tiny grids).

    Measured on an H200 (4 GB float64 product, the perf notes (git show 85dc246:docs/perf-notes.md)): one element per thread in
    blocks of 128 ran in 2.73 ms, as CuPy's own multiply (2.75) and the same kernel in CUDA C
    (2.71); every grid-stride launch shape took 2.86-3.06 ms in numba, 2.79-2.98 in CUDA C.

    Reductions (:func:`_grid`: a few times as many blocks as the GPU holds at once, each
    thread looping over its share): each thread accumulates its elements, each block combines its
    ``threads`` values in shared memory and writes one partial per reduction
    (``p[blockIdx.x]``); the last block to finish (a ticket from ``cnt[0]``, taken after a
    memory fence) combines the partials into ``t[0]`` in the total's dtype and sets ``cnt[0]``
    back to 0 for the next launch on the stream. Measured on an H200 (perf note 23): one
    element per thread with one partial per 128 elements, summed by CuPy after the kernel,
    made seed 002's pass 1.5 x slower than without its sum.
    """
    idx = ", ".join(f"i{d}" for d in range(ndim)) if ndim > 1 else "i"
    params, call = _args(scalars, idx)
    unravel = []
    if ndim > 1:
        unravel.append("r = i")
        for d in range(ndim - 1, 0, -1):
            unravel.append(f"q = r // o0.shape[{d}]")
            unravel.append(f"i{d} = r - q * o0.shape[{d}]")
            unravel.append("r = q")
        unravel.append("i0 = r")
    body = [*unravel, *spec.element(call, idx)]
    lines = [
        f"def kernel({spec.params()}, {params}):",
        "    n = o0.size",
        *("    " + line for line in spec.start()),
        "    i = int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x",
        "    step = int64(cuda.gridDim.x) * cuda.blockDim.x",
    ]
    if not spec.reductions:
        lines += [
            "    if i < n:",
            *("        " + line for line in body),
            "    i += step",
        ]
    lines += [
        "    while i < n:",
        *("        " + line for line in body),
        "        i += step",
    ]
    if not spec.reductions:
        return "\n".join(lines) + "\n"
    lines.append("    t = cuda.threadIdx.x")
    for r, (_, _, dtype) in enumerate(spec.reductions):
        lines.append(f"    s{r} = cuda.shared.array({threads}, _numba_{dtype.str[1:]})")
    lines.append("    last = cuda.shared.array(1, int32)")
    lines += ["    " + line for line in _block_combine(spec, threads)]
    lines.append("    if t == 0:")
    lines += [f"        p{r}[cuda.blockIdx.x] = s{r}[0]" for r in range(len(spec.reductions))]
    lines += [
        "        cuda.threadfence()",  # the partials are seen before the ticket is
        "        last[0] = cuda.atomic.add(cnt, 0, 1) == cuda.gridDim.x - 1",
        "    cuda.syncthreads()",
        "    if last[0]:",  # one value for the whole block: syncthreads inside is safe
        *("        " + line for line in spec.start()),
        "        j = t",
        "        while j < cuda.gridDim.x:",
    ]
    for r, (_, op, dtype) in enumerate(spec.reductions):
        lines.append(f"            acc{r} = {_combine(op, f'acc{r}', f'p{r}[j]', dtype)}")
    lines.append("            j += cuda.blockDim.x")
    lines += ["        " + line for line in _block_combine(spec, threads)]
    lines.append("        if t == 0:")
    lines += [f"            t{r}[0] = np.{dt.name}(s{r}[0])" for r, dt in enumerate(spec.totals)]
    lines.append("            cnt[0] = 0")
    return "\n".join(lines) + "\n"


def _generate(source: str, namespace: dict[str, Any], file_key: str | None = None) -> Callable:
    """The function ``kernel`` defined by ``source``, with ``namespace`` as its globals.

    With ``file_key``, the source lives in a file of the kernel cache
    (:func:`dask_gpuchunk._kernels.source_cache.load_kernel`), where numba can keep what it
    compiles from it; where that directory cannot be written, as without.
    """
    kernel = load_kernel(source, namespace, file_key) if file_key is not None else None
    if kernel is None:
        code = compile(source, "<dask_gpuchunk elementwise kernel>", "exec")
        exec(code, namespace)  # noqa: S102 - source generated above from integers only
        kernel = namespace["kernel"]
    return kernel


def _in_a_file(kernel: Callable) -> bool:
    """Whether a generated kernel came from a file of the kernel cache (:func:`_generate` with
    a ``file_key`` and a writable cache), where numba can cache what it compiles."""
    return os.path.isfile(kernel.__code__.co_filename)


def _signature_key(outs: Sequence[Any], inputs: Sequence[Any],
                   plan: ElementwisePlan | None = None, totals: Sequence[Any] = ()) -> tuple:
    """(ndim, layout, ((dtype, is_scalar, is_python_number), ...), out dtypes, the pass's
    :class:`_Pass`): one compiled kernel per key. A Python number's dtype is the one holding it
    (float64 for a float). ``totals``: the arrays a CUDA pass writes each reduction's total
    into (their dtypes are part of the key)."""
    arrays = [*outs, *(a for a in inputs if not is_scalar(a))]
    contiguous = all(a.flags["C_CONTIGUOUS"] for a in arrays)
    args = tuple((weak_type(a).dtype, True, True) if is_python_number(a)
                 else (np.dtype(a.dtype), is_scalar(a), False) for a in inputs)
    out_dtypes = tuple(np.dtype(o.dtype) for o in outs)
    if plan is None:
        spec = _Pass()
    else:
        spec = _Pass(len(outs), plan.tupled,
                     tuple((k, "sum" if op == "mean" else op, dt)
                           for (k, op), dt in zip(plan.reductions, plan.partial_dtypes())),
                     tuple(np.dtype(t.dtype) for t in totals))
    return (outs[0].ndim, "C" if contiguous else "A", args, out_dtypes, spec)


def _numba_signature(key: tuple, readonly_inputs: bool) -> Any:
    import numba
    from numba import types

    ndim, layout, args, out_dtypes, spec = key
    params = [types.Array(numba.from_dtype(dt), ndim, layout) for dt in out_dtypes]
    params += [types.Array(numba.from_dtype(dt), 1, "C") for _, _, dt in spec.reductions]
    params += [types.Array(numba.from_dtype(dt), 1, "C") for dt in spec.totals]
    if spec.totals:
        params.append(types.Array(types.uint32, 1, "C"))  # the blocks' ticket counter
    for dtype, scalar, _ in args:
        if scalar:
            params.append(numba.from_dtype(dtype))
        else:
            params.append(types.Array(numba.from_dtype(dtype), ndim, layout, readonly=readonly_inputs))
    return types.void(*params)


def _pass_namespace(spec: _Pass) -> dict[str, Any]:
    """What a kernel of this pass needs beside ``f``: NumPy (sums convert with ``np.int64(x)``
    ...), its reductions' start values and the numba types of their shared arrays."""
    import numba

    found: dict[str, Any] = {"np": np, "int32": numba.int32, **_identities(spec.reductions)}
    for _, _, dtype in spec.reductions:
        found[f"_numba_{dtype.str[1:]}"] = numba.from_dtype(dtype)
    return found
