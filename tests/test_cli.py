"""The dask-gpuchunk command line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from click.testing import CliRunner

from dask_gpuchunk.cli import main


def test_info_text_and_json():
    runner = CliRunner()
    result = runner.invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert "execution paths:" in result.output and "cpu" in result.output
    assert "versions: dask_gpuchunk " in result.output and " numpy " in result.output
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
    assert all(e["extra"]["vs_floor"] > 0 for e in ran)  # the "x floor" column, also with no GPU
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


def test_the_progress_bar_gives_rate_and_time_left(capsys, monkeypatch):
    from dask_gpuchunk import cli

    clock = iter([0.0, 2.0, 2.05, 4.0, 10.0, 11.0])  # a draw within 0.1 s of the last is skipped
    monkeypatch.setattr(cli.running.time, "perf_counter", lambda: next(clock))
    draw = cli.running._progress(True)
    draw(0, 40, "blocks")
    draw(10, 40, "blocks")
    draw(11, 40, "blocks")
    draw(20, 40, "blocks")
    draw(40, 40, "blocks")
    draw(40, 40, "blocks")  # the end is drawn once
    lines = [line.replace("\033[K", "") for line in capsys.readouterr().err.split("\r") if line]
    assert lines[1].endswith("10/40 blocks, 5 blocks/s, 6 s left")
    assert lines[2].endswith("20/40 blocks, 5 blocks/s, 4 s left")
    assert lines[3] == "[" + "#" * 30 + "] 40/40 blocks, 4 blocks/s in 10 s\n"
    assert len(lines) == 4


def test_similarity_weights_belong_to_tversky(tmp_path):
    np.save(tmp_path / "fps.npy", np.eye(8, dtype=np.uint8))
    args = ["similarity", str(tmp_path / "fps.npy"), "--top-k", "2", "-o",
            str(tmp_path / "nn.npz")]
    result = CliRunner().invoke(main, [*args, "--alpha", "0.5"])
    assert result.exit_code == 2 and "--metric tversky only" in result.output
    result = CliRunner().invoke(main, [*args, "--metric", "tversky", "--alpha", "-1"])
    assert result.exit_code == 2 and "--alpha" in result.output
    assert not (tmp_path / "nn.npz").exists()
