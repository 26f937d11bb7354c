"""The elementwise bench's report: ratios of the device-resident rows to CuPy's own rows."""

from __future__ import annotations

import sys

from click.testing import CliRunner

from dask_gpuchunk.bench import limits
from dask_gpuchunk.bench.elementwise import (
    CUPY_LOOP_ROW,
    CUPY_ROW,
    _report,
    host_memory_needed,
    rows_that_fit,
)
from dask_gpuchunk.bench.report import format_table, save
from dask_gpuchunk.bench.timing import Entry
from dask_gpuchunk.cli import main


def _entry(name: str, seconds: float | None) -> Entry:
    kind = "ours" if name.startswith("ours") else "peer"
    e = Entry("product", name, kind, seconds=seconds, runs=[] if seconds is None else [seconds])
    e.extra["workload_bytes"] = {"in": 8e9, "out": 4e9}
    return e


def test_device_rows_are_held_against_cupys_own_rows():
    entries = [
        _entry("ours gpu (pinned host arrays)", 0.163),
        _entry("ours device-resident, one chunk per array", 0.00382),
        _entry("ours device-resident, 10-step loop (per step)", 0.00287),
        _entry("peer dask.array a*b (CuPy chunks)", None),  # skipped rows get no ratio
        _entry(CUPY_ROW, 0.00282),
        _entry(CUPY_LOOP_ROW, 0.00275),
    ]
    limits = {"host_copy_traffic": 9e10, "pcie_h2d": 5.5e10, "pcie_d2h": 5.5e10,
              "pcie_bidirectional": 1e11, "hbm_copy_traffic": 4.27e12}
    report = _report(entries, limits, rows=10, cols=10)
    by_name = {e["name"]: e["extra"] for e in report["entries"]}
    one = by_name["ours device-resident, one chunk per array"]
    assert one["vs_cupy_row"] == CUPY_ROW and abs(one["vs_cupy"] - 0.00382 / 0.00282) < 1e-12
    loop = by_name["ours device-resident, 10-step loop (per step)"]
    assert loop["vs_cupy_row"] == CUPY_LOOP_ROW and abs(loop["vs_cupy"] - 0.00287 / 0.00275) < 1e-12
    for name in ("ours gpu (pinned host arrays)", "peer dask.array a*b (CuPy chunks)", CUPY_ROW):
        assert "vs_cupy" not in by_name[name]
    report["machine"] = {"cpus": 2, "numpy": "-", "numba": "-", "dask": "-"}
    assert "3.82 ms = 1.35 x peer cupy a*b (device arrays)" in format_table(report)


def test_bench_refuses_a_size_that_does_not_fit_and_says_what_fits(monkeypatch):
    monkeypatch.setattr(limits, "available_host_memory", lambda: 8 * 10**9)
    result = CliRunner().invoke(main, ["bench", "elementwise"])
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert "needs about" in message and "8 GB are available" in message, message
    rows = int(message.split("--rows ")[1].split()[0])
    assert 0 < rows < 1_000_000
    assert host_memory_needed(rows, 500, 0, gpu=False) <= 0.8 * 8 * 10**9
    assert "Traceback" not in result.output


def test_rows_that_fit_fit():
    for gpu in (False, True):
        rows, rk4 = rows_that_fit(10**10, 500, gpu)
        assert host_memory_needed(rows, 500, rk4, gpu) <= 10**10
        assert host_memory_needed(rows + 1, 500, rk4, gpu) > 10**10


def test_save_says_when_it_cannot_draw_the_png(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    said = []
    written = save({"entries": [], "floors": {}}, tmp_path, "bench-x", log=said.append)
    assert [p.name for p in written] == ["bench-x.json"]
    assert said and "matplotlib is not installed" in said[0] and "[bench]" in said[0]

