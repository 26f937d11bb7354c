"""Temporary output files that record their writer; those whose writer is gone are removed by
the next job to the same target and by ``dask-gpuchunk clean``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask.array as da
import numpy as np
import pytest
from click.testing import CliRunner

import dask_gpuchunk as dg
from dask_gpuchunk.cli import main
from dask_gpuchunk.io.partials import (
    Writer,
    _host_tag,
    _start_time,
    partials_in,
    remove_partials,
    remove_stale,
    temporary_name,
)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _partial(directory: Path, target: str, writer: Writer) -> Path:
    """A partial file of ``target`` in our naming, written by ``writer``."""
    path = directory / (f".{target}.dgc-{writer.host}-{writer.pid:08x}-{writer.start:012x}-"
                        f"abcdef.partial")
    path.write_bytes(b"x" * 10)
    return path


def test_a_temporary_name_records_this_process(tmp_path):
    tmp = temporary_name(tmp_path / "c.npy")
    tmp.write_bytes(b"")
    (found,) = partials_in(tmp_path)
    assert found.path == tmp and found.writer == Writer.this_process()
    assert found.state() == "running" and "this host, still running" in found.describe()
    if Path("/proc/self/stat").exists():
        assert found.writer.start == _start_time(os.getpid()) > 0


def test_each_writer_state(tmp_path):
    me = Writer.this_process()
    running = _partial(tmp_path, "c.npy", me)
    gone = _partial(tmp_path, "c.npy", Writer(me.host, _dead_pid(), 12345))
    reused = _partial(tmp_path, "c.npy", me._replace(start=me.start + 1))  # another process
    elsewhere = _partial(tmp_path, "c.npy", Writer("0" * 8 if me.host != "0" * 8 else "1" * 8,
                                                   os.getpid(), me.start))
    older = tmp_path / ".c.npy.0123456789ab.partial"
    older.write_bytes(b"")
    other_target = _partial(tmp_path, "d.npy", Writer(me.host, _dead_pid(), 1))
    (tmp_path / ".e.npy.0123456789ab.partial").mkdir()  # not a file: never listed
    states = {p.path: p.state() for p in partials_in(tmp_path, tmp_path / "c.npy")}
    expected_reused = "gone" if me.start else "running"  # no /proc: the pid alone is checked
    assert states == {running: "running", gone: "gone", reused: expected_reused,
                      elsewhere: "unknown", older: "unknown"}
    said: list[str] = []
    removed = remove_stale(tmp_path / "c.npy", log=said.append)
    assert {p.path for p in removed} == {gone} | ({reused} if me.start else set())
    assert not gone.exists() and running.exists() and elsewhere.exists() and older.exists()
    assert other_target.exists()  # another target's: not this job's to remove
    assert any("gone" in s and str(gone) in s for s in said)


def test_a_long_target_name_is_cut_the_same_way_by_writer_and_finder(tmp_path):
    target = tmp_path / ("x" * 250 + ".npy")
    tmp = temporary_name(target)
    assert len(tmp.name.encode()) <= 255
    tmp.write_bytes(b"")
    assert [p.path for p in partials_in(tmp_path, target)] == [tmp]
    assert partials_in(tmp_path, tmp_path / ("x" * 249 + ".npy")) == []


WRITER = """
import sys, time
import dask.array as da
import numpy as np
import dask_gpuchunk as dg

def slow(block):
    time.sleep(60)
    return block

x = da.ones((4, 3), chunks=(2, 3)).map_blocks(slow, dtype=float, meta=np.empty((0, 0)))
dg.to_npy(x, sys.argv[1])
"""


def test_a_job_killed_mid_write_leaves_a_partial_the_next_job_removes(tmp_path, caplog):
    target = tmp_path / "c.npy"
    killed = subprocess.Popen([sys.executable, "-c", WRITER, str(target)])
    deadline = time.monotonic() + 60
    while not partials_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait()
    (left,) = partials_in(tmp_path)
    assert left.writer.pid == killed.pid and left.state() == "gone"
    with caplog.at_level(logging.WARNING, logger="dask_gpuchunk"):
        dg.to_npy(da.arange(6, chunks=4), target)
    assert os.listdir(tmp_path) == ["c.npy"]
    np.testing.assert_array_equal(np.load(target), np.arange(6))
    assert f"pid {killed.pid} on this host, gone" in caplog.text


def test_clean_lists_and_removes_on_demand(tmp_path):
    me = Writer.this_process()
    gone = _partial(tmp_path, "g.npy", Writer(me.host, _dead_pid(), 7))
    running = _partial(tmp_path, "g.npy", me)
    elsewhere = _partial(tmp_path, "h.npy", Writer("f" * 8 if me.host != "f" * 8 else "e" * 8,
                                                   1, 1))
    (tmp_path / "g.npy").write_bytes(b"")  # a finished output is never touched

    result = CliRunner().invoke(main, ["clean", str(tmp_path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"would remove: {gone.name}" in result.stdout and gone.exists()
    assert f"kept: {elsewhere.name}" in result.stdout and "--force removes it" in result.stdout

    result = CliRunner().invoke(main, ["clean", str(tmp_path)])
    assert result.exit_code == 0 and f"removed: {gone.name}" in result.stdout
    assert gone.name not in (result.stderr or "")  # each removal said once
    assert not gone.exists() and running.exists() and elsewhere.exists()

    result = CliRunner().invoke(main, ["clean", str(tmp_path), "--force"])
    assert result.exit_code == 0 and f"removed: {elsewhere.name}" in result.stdout
    assert sorted(os.listdir(tmp_path)) == sorted([running.name, "g.npy"])
    running.unlink()
    result = CliRunner().invoke(main, ["clean", str(tmp_path)])
    assert result.stdout.strip() == f"no partial files in {tmp_path}"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="no /proc on this system")
def test_host_tag_and_start_time_are_stable():
    assert _host_tag() == _host_tag() and len(_host_tag()) == 8
    assert _start_time(os.getpid()) == _start_time(os.getpid())
    assert _start_time(_dead_pid()) is None


def test_clean_lists_look_alikes_and_never_removes_them(tmp_path):
    # Names like ours but without the dgc writer tag: another program's, or a user's own.
    file = tmp_path / ".thesis.tex.0123456789ab.partial"
    file.write_text("my thesis")
    store = tmp_path / ".backup.zarr.deadbeefcafe.partial"
    (store / "sub").mkdir(parents=True)
    (store / "sub" / "data.bin").write_bytes(b"keep")
    for args in (["--force"], []):
        result = CliRunner().invoke(main, ["clean", str(tmp_path), *args])
        assert result.exit_code == 0, result.output
        assert f"kept: {file.name}" in result.stdout and f"kept: {store.name}" in result.stdout
        assert "never removed" in result.stdout and "--force removes it" not in result.stdout
    assert file.read_text() == "my thesis" and (store / "sub" / "data.bin").exists()
    assert not remove_partials(partials_in(tmp_path), unknown=True)
