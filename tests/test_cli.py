"""The dask-gpuchunk command line."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from dask_gpuchunk.cli import main


def test_info_text_and_json():
    runner = CliRunner()
    result = runner.invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert "execution paths:" in result.output and "cpu" in result.output
    result = runner.invoke(main, ["info", "--json"])
    assert result.exit_code == 0
    env = json.loads(result.output)
    assert set(env["paths"]) == {"cpu", "gpu-host", "gpu-device", "auto", "gram"}
    assert env["versions"]["dask_gpuchunk"]


def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "dask_gpuchunk", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "bench" in done.stdout and "info" in done.stdout


def test_bench_elementwise_small_writes_json_and_png(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "elementwise", "--rows", "3000", "--cols", "100",
                                  "--rk4-rows", "2000", "--chunk-mb", "0.5", "--repeat", "1",
                                  "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "bench-elementwise.json").read_text())
    names = {(e["table"], e["name"]) for e in report["entries"]}
    for table in ("product", "rk4"):
        for name in ("ours cpu", "ours auto (pageable host arrays)", "peer numba parallel (CPU)",
                     "peer numpy (1 thread)", "ours gpu (pageable host arrays)"):
            assert (table, name) in names
    ran = [e for e in report["entries"] if e["seconds"] is not None]
    assert all(e["seconds"] > 0 for e in ran)
    assert report["limits"]["host_copy_traffic"] > 0
    assert "[product]" in result.output and "x best" in result.output
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "bench-elementwise.png").stat().st_size > 1000


def test_bench_rejects_bad_sizes(tmp_path):
    result = CliRunner().invoke(main, ["bench", "elementwise", "--rows", "0",
                                       "--out-dir", str(tmp_path)])
    assert result.exit_code != 0 and "positive" in result.output


def test_bench_gram_small_on_cpu(tmp_path):
    result = CliRunner().invoke(main, ["bench", "gram", "--n", "300", "--k", "1000", "--cpu-rows",
                                       "100", "--repeat", "1", "--out-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "ours popcount cpu" in result.output and "bit-MAC/s" in result.output
    report = json.loads((tmp_path / "bench-gram.json").read_text())
    assert report["workload"]["n"] == 300
    rates = [e["extra"]["bit_macs_per_s"] for e in report["entries"] if e["seconds"]]
    assert rates and all(r > 0 for r in rates)


def test_bench_gram_rejects_bad_tile():
    result = CliRunner().invoke(main, ["bench", "gram", "--n", "10", "--tile", "1,2,3"])
    assert result.exit_code != 0 and "five positive integers" in result.output
