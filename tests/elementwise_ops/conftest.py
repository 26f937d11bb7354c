"""Fixtures of the elementwise operations' tests: dask's threaded scheduler for each, and both
graph forms of a result."""

from __future__ import annotations

import importlib

import dask
import pytest

elementwise_module = importlib.import_module("dask_gpuchunk.elementwise_ops.operations")


@pytest.fixture(autouse=True)
def _threaded_scheduler():
    with dask.config.set(scheduler="threads"):
        yield


@pytest.fixture(params=["listed", "blockwise"])
def graph_form(request, monkeypatch):
    """Both graph forms of a result: tasks listed in a dict (small results) and a Blockwise
    layer (results of more than LISTED_GRAPH_MAX_BLOCKS blocks)."""
    if request.param == "blockwise":
        monkeypatch.setattr(elementwise_module, "LISTED_GRAPH_MAX_BLOCKS", 0)
    return request.param
