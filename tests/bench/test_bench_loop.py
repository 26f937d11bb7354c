"""Seed 002's loop benchmark: its step against a plain Python reference, every form on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from dask_gpuchunk.bench.loop import LOOP_TABLE, _rk4, initial_values, rk4_step, run_loop
from dask_gpuchunk.cli import main


def test_the_step_gives_both_arrays_and_the_sum_of_f_in_one_call():
    f, g = initial_values(301)
    delta, dt = np.complex64(f.sum()), np.float32(1e-3)
    f1, g1, total = rk4_step(f, g, delta, dt, reduce=("sum", None))
    expected = [_rk4(a, b, delta, dt) for a, b in zip(f, g)]  # NumPy scalars: complex64
    np.testing.assert_allclose(f1, [e[0] for e in expected], rtol=1e-6)
    np.testing.assert_allclose(g1, [e[1] for e in expected], rtol=1e-6)
    assert total.dtype == np.complex64
    np.testing.assert_allclose(total, f1.astype(np.complex128).sum(), rtol=1e-6)


def test_loop_sizes_are_checked():
    result = CliRunner().invoke(main, ["bench", "elementwise", "--loop-sizes", "12,x"])
    assert result.exit_code == 2 and "--loop-sizes takes positive integers" in result.output


@pytest.mark.gpu
def test_every_form_of_the_loop_runs_and_agrees_with_cupys():
    entries = run_loop([4096, 5000], steps=5, repeat=1, log=lambda s: None)
    assert {e.table for e in entries} == {LOOP_TABLE}
    assert all(e.seconds for e in entries), [e.skipped for e in entries]
    for e in entries:
        if "delta_rel_error" in e.extra:
            assert e.extra["delta_rel_error"] < 1e-5 and e.extra["f_max_rel_error"] < 1e-5, e
