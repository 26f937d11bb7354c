"""A newcomer's script: ``@dg.elementwise`` functions defined in ``__main__`` (at module level
with a helper and a global, nested with a closure over numbers, returning two values), run on a
multi-process cluster and checked against NumPy. Run by tests/elementwise_ops/test_operations.py
as ``python main_functions.py CLUSTER [--gpu]``; prints ``exact`` once all agree.
"""

import math
import sys

import dask.array as da
import numpy as np

import dask_gpuchunk as dg

RATE = 0.25


def decay(t):
    return math.exp(-RATE * t)


@dg.elementwise
def damped(x, t):
    return x * decay(t) + 1


def make_clipped(low, high):
    @dg.elementwise
    def clipped(x):
        y = x * 3 - 1
        if y < low:
            return low, False
        return min(y, high), True

    return clipped


def check(client_factory, gpu):
    rng = np.random.default_rng(7)
    x_np = rng.standard_normal((1003, 7)).astype(np.float32)
    t_np = rng.random((1003, 7))
    x = da.from_array(x_np, chunks=(250, 4))
    t = da.from_array(t_np, chunks=(300, 7))
    if gpu:
        import cupy

        x, t = x.map_blocks(cupy.asarray), t.map_blocks(cupy.asarray)
    clipped = make_clipped(-0.5, 1.5)
    with client_factory() as client:
        assert len(client.scheduler_info()["workers"]) >= 1
        got = damped(x, t).compute()
        values, inside = da.compute(*clipped(x))
    if gpu:  # computed on the workers' GPUs: CuPy results
        assert all(type(a).__module__.startswith("cupy") for a in (got, values, inside))
        got, values, inside = (a.get() for a in (got, values, inside))
    # NumPy's rules: the plain function called on NumPy scalars, element by element
    want = np.array([[damped.__wrapped__(a, b) for a, b in zip(row_x, row_t)]
                     for row_x, row_t in zip(x_np, t_np)])
    assert got.dtype == want.dtype == np.float32, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want)
    pairs = [clipped.__wrapped__(a) for a in x_np.ravel()]
    want_values = np.array([p[0] for p in pairs]).reshape(x_np.shape)
    np.testing.assert_array_equal(values, want_values.astype(values.dtype))
    np.testing.assert_array_equal(inside, np.array([p[1] for p in pairs]).reshape(x_np.shape))
    assert inside.any() and not inside.all()


def main(argv):
    from distributed import Client, LocalCluster

    kind, gpu = argv[0], "--gpu" in argv
    if kind == "dg":
        factory = dg.local_cluster
    else:
        def factory():
            return Client(LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None))
    check(factory, gpu)
    print("exact")


if __name__ == "__main__":
    main(sys.argv[1:])
