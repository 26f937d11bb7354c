"""Your own numba code over Dask arrays: a ``@cuda.jit`` product kernel with a thread per row,
a row-sliced bit-packed Gram kernel taking a ``row_offset``, and a ``@vectorize`` RK4 half-step
calling ``@cuda.jit(device=True)`` helpers, each checked against NumPy.

The kernels are written as those users wrote theirs: ``dg.map_kernel`` runs the first two block
by block (NumPy blocks staged through pinned memory to the GPU, within the device budget), and
``dg.elementwise`` takes the ufunc as it is. Where no GPU is visible, the kernels' CPU twins
(``cpu=``) and the ufunc's CPU target run instead.

    python examples/own_numba_kernels.py --rows 20000 --bit-rows 500 --bit-cols 4000 --n 100000
    python examples/own_numba_kernels.py --rows 2000000 --cols 500 --bit-rows 30000   # on a GPU

The first runs in seconds on a CPU. The Gram part's CPU twin counts bit by bit, as the kernel
does: at the default 200,000 bits a row it takes minutes there (``--only product rk4`` skips
it).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import time

import dask
import dask.array as da
import numba
import numpy as np
from numba import cuda, int32, uint8

import dask_gpuchunk as dg

ON_GPU = dg.gpu_available()

# ---- the product: a thread per row, a loop over the columns ---------------------------------


@cuda.jit
def adding_numbers(big_array, big_array2, save_array):
    i = cuda.grid(1)
    if i < big_array.shape[0]:
        for j in range(big_array.shape[1]):
            save_array[i, j] = big_array[i, j] * big_array2[i, j]


@numba.njit(parallel=True)
def adding_numbers_on_cpu(big_array, big_array2, save_array):
    for i in numba.prange(big_array.shape[0]):
        for j in range(big_array.shape[1]):
            save_array[i, j] = big_array[i, j] * big_array2[i, j]


# ---- the Gram: C[row_offset + y, x] = popcount(A[row_offset + y] & A[x]), 8 bits a byte -----

TPB = 32
TPB1 = 33  # a padded row: shared_b's columns fall in different banks


@cuda.jit
def bit_slice_a_at(a, c, row_offset):
    shared_a = cuda.shared.array((TPB, TPB), dtype=uint8)
    shared_b = cuda.shared.array((TPB, TPB1), dtype=uint8)
    x, y = cuda.grid(2)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    bx = cuda.blockIdx.x
    count = int32(0)
    for i in range((a.shape[1] + TPB - 1) // TPB):
        col = i * TPB + tx
        if y + row_offset < a.shape[0] and y < c.shape[0] and col < a.shape[1]:
            shared_a[ty, tx] = a[y + row_offset, col]
        else:
            shared_a[ty, tx] = 0
        if TPB * bx + ty < a.shape[0] and col < a.shape[1]:
            shared_b[ty, tx] = a[TPB * bx + ty, col]
        else:
            shared_b[ty, tx] = 0
        cuda.syncthreads()
        for j in range(TPB):
            both = shared_a[ty, j] & shared_b[tx, j]
            bit = uint8(1)
            for _ in range(8):
                if both & bit:
                    count += 1
                bit <<= 1
        cuda.syncthreads()
    if y < c.shape[0] and x < c.shape[1]:
        c[y, x] = count


@numba.njit(parallel=True)
def bit_slice_a_at_on_cpu(a, c, row_offset):
    for y in numba.prange(c.shape[0]):
        for x in range(c.shape[1]):
            count = 0
            for k in range(a.shape[1]):
                both = a[y + row_offset, k] & a[x, k]
                while both:
                    count += both & 1
                    both >>= 1
            c[y, x] = count


def bit_launch(shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The Gram kernel's grid: x over the columns of C, y over the slab's rows, 32 × 32
    threads."""
    return (math.ceil(shape[1] / TPB), math.ceil(shape[0] / TPB)), (TPB, TPB)


# ---- the RK4 step: a @vectorize ufunc calling device functions ------------------------------

helper = cuda.jit(device=True) if ON_GPU else numba.njit


@helper
def dF_dt(f, g, delta):
    return -2j * f - 1j * delta * (2 * g - 1)


@helper
def dG_dt(f, delta):
    return -1j * (delta.conjugate() * f - delta * f.conjugate())


@numba.vectorize(["complex64(complex64, complex64, complex64, float32)"],
                 target="cuda" if ON_GPU else "cpu")
def rk4_step_f(g, f, delta, dt):
    f1, g1 = dF_dt(f, g, delta), dG_dt(f, delta)
    f2 = dF_dt(f + dt / 2 * f1, g + dt / 2 * g1, delta)
    g2 = dG_dt(f + dt / 2 * f1, delta)
    f3 = dF_dt(f + dt / 2 * f2, g + dt / 2 * g2, delta)
    g3 = dG_dt(f + dt / 2 * f2, delta)
    f4 = dF_dt(f + dt * f3, g + dt * g3, delta)
    return f + (dt / 6) * (f1 + 2 * f2 + 2 * f3 + f4)


def rk4_reference(g, f, delta, dt):
    """The same step in NumPy, complex128."""
    def d_f(f, g):
        return -2j * f - 1j * delta * (2 * g - 1)

    def d_g(f):
        return -1j * (np.conj(delta) * f - delta * np.conj(f))

    f1, g1 = d_f(f, g), d_g(f)
    f2, g2 = d_f(f + dt / 2 * f1, g + dt / 2 * g1), d_g(f + dt / 2 * f1)
    f3, g3 = d_f(f + dt / 2 * f2, g + dt / 2 * g2), d_g(f + dt / 2 * f2)
    f4 = d_f(f + dt * f3, g + dt * g3)
    return f + dt / 6 * (f1 + 2 * f2 + 2 * f3 + f4)


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000,
                   help="rows of the product's arrays (default %(default)s)")
    p.add_argument("--cols", type=int, default=500,
                   help="columns of the product's arrays (default %(default)s)")
    p.add_argument("--chunk-rows", type=int, default=50_000,
                   help="rows per chunk of the product (default %(default)s)")
    p.add_argument("--bit-rows", type=int, default=3000,
                   help="rows of the Gram's 0/1 matrix (default %(default)s)")
    p.add_argument("--bit-cols", type=int, default=200_000,
                   help="bits per row of the Gram's matrix (default %(default)s)")
    p.add_argument("--slab", type=int, default=1024,
                   help="rows of C per launch of the Gram kernel (default %(default)s)")
    p.add_argument("--n", type=int, default=1_000_000, help="values of the RK4 step")
    p.add_argument("--gram-rows", default=":", metavar="START:STOP",
                   help="the rows of C the Gram part computes (all by default)")
    p.add_argument("--compare-gram", action=argparse.BooleanOptionalAction, default=True,
                   help="compare every row of the kernel's C with dg.gram's (timed too)")
    p.add_argument("--only", nargs="+", choices=("product", "gram", "rk4"),
                   default=("product", "gram", "rk4"), help="the parts to run")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    result: dict[str, float] = {}
    for part, run in (("product", product), ("gram", row_sliced_gram), ("rk4", rk4)):
        if part in args.only:
            t0 = time.perf_counter()
            result.update(run(args, rng))
            print(f"{part}: done in {time.perf_counter() - t0:.2f} s, checked", flush=True)
    print(", ".join(f"{k} {v:.3g}" for k, v in result.items()))
    return result


def product(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, float]:
    """The product: arrays larger than the GPU in row blocks, the kernel on each."""
    result: dict[str, float] = {}
    a = dg.asarray(rng.random((args.rows, args.cols)), chunks=(args.chunk_rows, -1))
    b = dg.asarray(rng.random((args.rows, args.cols)), chunks=(args.chunk_rows, -1))
    product = dg.map_kernel(adding_numbers, a, b, dtype=np.float64, launch=1,
                            cpu=adding_numbers_on_cpu)
    t0 = time.perf_counter()
    total = float(product.sum().compute())
    result["product_seconds"] = time.perf_counter() - t0
    # One graph for each comparison: the random inputs are the same blocks on both sides.
    total, expected, rows, expected_rows = dask.compute(product.sum(), (a * b).sum(),
                                                        product[:5], a[:5] * b[:5])
    result["product_error"] = abs(float(total) - float(expected)) / abs(float(expected))
    np.testing.assert_array_equal(rows, expected_rows)
    return result


def row_digests(block: np.ndarray) -> np.ndarray:
    """An 8-byte digest of each row: equal digests, equal rows (C is never gathered whole)."""
    digests = [hashlib.blake2b(row.tobytes(), digest_size=8).digest() for row in block]
    return np.frombuffer(b"".join(digests), dtype=np.uint64)


def row_sliced_gram(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, float]:
    """The Gram: the packed bits whole, C in row slabs, each slab one launch with its offset.

    C's rows ``--gram-rows START:STOP`` are computed by the user's kernel and by ``dg.gram``
    (``--no-compare-gram``: the kernel's only), and compared row by row through digests;
    sampled rows are compared with NumPy.
    """
    result: dict[str, float] = {}
    n = args.bit_rows
    words = rng.integers(0, 256, (n, math.ceil(args.bit_cols / 8)), dtype=np.uint8)
    words[:, -1] &= np.uint8(0xFF << (-args.bit_cols % 8) & 0xFF)  # no bits past the last
    packed = da.from_array(words, chunks=-1)
    slabs = tuple(min(args.slab, n - r) for r in range(0, n, args.slab))
    c = dg.map_kernel(bit_slice_a_at, packed, dtype=np.int32, chunks=(slabs, (n,)),
                      launch=bit_launch, offsets=[0], cpu=bit_slice_a_at_on_cpu)
    start, stop = (int(x) if x else None for x in args.gram_rows.split(":"))
    rows = range(n)[start:stop]
    sample = np.sort(rng.choice(rows, size=min(8, len(rows)), replace=False))
    c = c[rows.start:rows.stop]
    t0 = time.perf_counter()
    # One graph: the sampled rows come from the slabs the digests read, never computed twice
    # (each row by its own index: a list of rows is a shuffle under dask's query planning).
    digests, *sampled = dask.compute(
        c.map_blocks(row_digests, dtype=np.uint64, drop_axis=1, meta=np.empty(0, np.uint64)),
        *(c[int(row) - rows.start] for row in sample))
    result["gram_seconds"] = time.perf_counter() - t0
    for row, got in zip(sample, sampled):
        expected_row = np.bitwise_count(words & words[row]).sum(axis=1, dtype=np.int64)
        np.testing.assert_array_equal(got, expected_row)
    print(f"the kernel's rows {rows.start}:{rows.stop} of C: {result['gram_seconds']:.3g} s")
    result["gram_rows_checked"] = len(rows)
    if not args.compare_gram:
        return result
    # dg.gram takes the words in row chunks (its blocks must fit the device budget).
    by_gram = dg.gram(packed.rechunk((args.slab, -1)), packed=True)
    by_gram = by_gram[rows.start:rows.stop].rechunk({1: -1})
    t0 = time.perf_counter()
    gram_digests = by_gram.map_blocks(row_digests, dtype=np.uint64, drop_axis=1,
                                      meta=np.empty(0, np.uint64)).compute()
    result["dg_gram_seconds"] = time.perf_counter() - t0
    np.testing.assert_array_equal(digests, gram_digests)
    return result


def rk4(args: argparse.Namespace, rng: np.random.Generator) -> dict[str, float]:
    """The RK4 step: the ufunc itself, through dg.elementwise, on chunks of the arrays."""
    shape = (args.n,)
    g = (rng.random(shape) + 1j * rng.random(shape)).astype(np.complex64)
    f = (rng.random(shape) + 1j * rng.random(shape)).astype(np.complex64)
    delta = np.complex64(1 + 0.5j)
    step = dg.elementwise(rk4_step_f)
    new_f = step(da.from_array(g, chunks=max(1, args.n // 4)), f, delta, 1e-3).compute()
    ref = rk4_reference(g.astype(np.complex128), f.astype(np.complex128), complex(delta), 1e-3)
    error = float(np.abs(new_f - ref).max() / np.abs(ref).max())
    assert error < 1e-5, error
    return {"rk4_error": error}


if __name__ == "__main__":
    main()
