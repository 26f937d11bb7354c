"""An RK4 loop whose arrays stay on the GPU, with a reduction on the device each step.

A loop that copies both N x N complex64 arrays to the host after every step, only to sum one of
them, spends its time in the copies. Here ``F`` and ``G`` are persisted CuPy-chunked Dask
arrays: each step runs two elementwise RK4 kernels chunk by chunk on the device, and the
coupling ``delta = mean(F)`` is a Dask reduction over CuPy chunks, so it never leaves the device
either. The history of ``delta`` is brought to the host once, at the end. Where no GPU is
visible the same code runs on NumPy chunks and the CPU.

The system, per element, with a global coupling through ``delta``::

    dF/dt = i G - c delta F
    dG/dt = i F

    python examples/rk4_loop_on_device.py --n 4096 --steps 100
"""

from __future__ import annotations

import argparse
import time

import dask
import dask.array as da
import numpy as np

import dask_gpuchunk as dg


def _derivatives(f, g, delta, c):
    return 1j * g - c * delta * f, 1j * f


def _rk4(f, g, delta, dt, c):
    kf1, kg1 = _derivatives(f, g, delta, c)
    kf2, kg2 = _derivatives(f + 0.5 * dt * kf1, g + 0.5 * dt * kg1, delta, c)
    kf3, kg3 = _derivatives(f + 0.5 * dt * kf2, g + 0.5 * dt * kg2, delta, c)
    kf4, kg4 = _derivatives(f + dt * kf3, g + dt * kg3, delta, c)
    return (f + dt / 6 * (kf1 + 2 * kf2 + 2 * kf3 + kf4),
            g + dt / 6 * (kg1 + 2 * kg2 + 2 * kg3 + kg4))


# One elementwise operation per output: `which` (0 for F, 1 for G) picks the component; each
# call recomputes the other's stages, which is cheap next to moving the arrays.
@dg.elementwise(dtype="complex64")
def rk4_component(f, g, delta, dt, c, which):
    kf1 = 1j * g - c * delta * f
    kg1 = 1j * f
    kf2 = 1j * (g + 0.5 * dt * kg1) - c * delta * (f + 0.5 * dt * kf1)
    kg2 = 1j * (f + 0.5 * dt * kf1)
    kf3 = 1j * (g + 0.5 * dt * kg2) - c * delta * (f + 0.5 * dt * kf2)
    kg3 = 1j * (f + 0.5 * dt * kf2)
    if which == 0:
        kf4 = 1j * (g + dt * kg3) - c * delta * (f + dt * kf3)
        return f + dt / 6 * (kf1 + 2 * kf2 + 2 * kf3 + kf4)
    kg4 = 1j * (f + dt * kf3)
    return g + dt / 6 * (kg1 + 2 * kg2 + 2 * kg3 + kg4)


def run(f0: np.ndarray, g0: np.ndarray, steps: int, dt: float, c: float, chunk: int,
        device: str) -> tuple[np.ndarray, np.ndarray]:
    """The loop on Dask arrays: device-resident where a GPU is visible. Returns (delta, F)."""
    if device == "gpu":
        import cupy

        f0, g0 = cupy.asarray(f0), cupy.asarray(g0)
    f = dg.asarray(f0, chunks=chunk).persist()
    g = dg.asarray(g0, chunks=chunk).persist()
    deltas = []
    dt32, c32 = np.float32(dt), np.float32(c)
    for _ in range(steps):
        delta = f.mean().persist()                      # a 0-d chunk, on the device
        deltas.append(delta)
        f, g = (rk4_component(f, g, delta, dt32, c32, np.int8(0), device=device),
                rk4_component(f, g, delta, dt32, c32, np.int8(1), device=device))
        f, g = dask.persist(f, g)
    history, final = dask.compute(da.stack(deltas), f)  # one transfer each, at the end
    if device == "gpu":
        history, final = history.get(), final.get()
    return history, final


def reference(f: np.ndarray, g: np.ndarray, steps: int, dt: float, c: float) -> tuple[np.ndarray, np.ndarray]:
    """The same loop in plain NumPy (complex128)."""
    f, g = f.astype(np.complex128), g.astype(np.complex128)
    history = []
    for _ in range(steps):
        delta = f.mean()
        history.append(delta)
        f, g = _rk4(f, g, delta, dt, c)
    return np.array(history), f


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048, help="F and G are n x n complex64")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dt", type=float, default=1e-3)
    parser.add_argument("--coupling", type=float, default=0.5)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--check", action="store_true", help="compare with a NumPy loop")
    args = parser.parse_args(argv)

    device = "gpu" if dg.gpu_available() else "cpu"
    rng = np.random.default_rng(0)
    shape = (args.n, args.n)
    f0 = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)
    g0 = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)

    run(f0, g0, 1, args.dt, args.coupling, args.chunk, device)  # compile the kernels
    t0 = time.perf_counter()
    history, final = run(f0, g0, args.steps, args.dt, args.coupling, args.chunk, device)
    seconds = time.perf_counter() - t0
    print(f"{args.steps} RK4 steps of two {args.n} x {args.n} complex64 arrays on the {device}: "
          f"{seconds:.3f} s ({seconds / args.steps * 1e3:.2f} ms per step); "
          f"delta[-1] = {history[-1]:.6f}")
    result = {"seconds": seconds}
    if args.check:
        ref_history, ref_final = reference(f0, g0, args.steps, args.dt, args.coupling)
        err = float(np.max(np.abs(final - ref_final)) / np.max(np.abs(ref_final)))
        derr = float(np.max(np.abs(history - ref_history)) / np.max(np.abs(ref_history)))
        print(f"against NumPy (complex128): max relative error F {err:.2e}, delta {derr:.2e}")
        assert err < 1e-4 and derr < 1e-4, "RK4 loop disagrees with NumPy"
        result.update(error=err, delta_error=derr)
    return result


if __name__ == "__main__":
    main()
