"""The targets over their slots, found across several blocks by one scan and redone in the
right state, side and row order: the bookkeeping checked on the CPU, with NumPy standing in
for CuPy and the redo itself recorded (its exactness is tests/_kernels/test_bmma_select.py's,
on a GPU)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from dask_gpuchunk._kernels import top_k_overflow
from dask_gpuchunk._kernels.top_k_overflow import Overflow, redo_overflows


@pytest.fixture
def numpy_as_cupy(monkeypatch):
    fake = types.ModuleType("cupy")
    fake.flatnonzero, fake.concatenate = np.flatnonzero, np.concatenate
    fake.asnumpy = fake.asarray = np.asarray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    redone = []
    monkeypatch.setattr(top_k_overflow, "_redone",
                        lambda which, targets, others, *rest: redone.append(
                            (targets.tag, others.tag, rest[-3].tag, list(which))))
    return redone


class Tagged(np.ndarray):
    """An array that says which block and side it stands for."""


def tagged(shape, tag):
    a = np.zeros(shape).view(Tagged)
    a.tag = tag
    return a


def block(name, counts, orders, slots=4):
    sides, states = [], []
    for side, count in enumerate(counts):
        targets, others = tagged((len(count), 2), f"{name}{side}"), tagged((3, 2), "o")
        sides.append((targets, others, None, None, 0, 0, None, np.asarray(count)))
        states.append(tagged((len(count), 1), f"{name}{side} state"))
    return Overflow(sides, states, orders, "tanimoto", False, slots)


def test_each_overflowing_target_is_redone_in_its_own_blocks_state_and_order(numpy_as_cupy):
    before = top_k_overflow.redone["targets"]
    blocks = [
        # both sides; the rows in popcount order: target 1 of the order is the caller's row 2
        block("a", [[0, 5, 4, 9], [7, 0, 0]], [np.array([3, 2, 1, 0]), np.array([2, 0, 1])]),
        block("b", [[1, 1], [5, 5, 5]], [None, None]),  # the caller's order
        block("c", [[4, 4, 4]], [None]),  # at the slots, not over them
    ]
    redo_overflows(blocks)
    assert numpy_as_cupy == [("a0", "o", "a0 state", [2, 0]), ("a1", "o", "a1 state", [2]),
                             ("b1", "o", "b1 state", [0, 1, 2])]
    assert top_k_overflow.redone["targets"] - before == 6


def test_no_overflow_and_no_blocks_redo_nothing(numpy_as_cupy):
    redo_overflows([])
    redo_overflows([block("a", [[0, 4], [1]], [None, None])])
    assert numpy_as_cupy == []
