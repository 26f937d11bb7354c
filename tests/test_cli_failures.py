"""What goes wrong in a job, and what the command does then: bad input (each a non-zero exit,
one line on stderr, nothing written), full disks, signals mid-write, GPU options without a GPU;
nothing lost (two jobs to one target, a target or an input changed during a job, symlinks,
FIFOs), workers and clusters lost mid-job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import dask
import numpy as np
import pytest
from click.testing import CliRunner
from cli_runs import PYTHON, leftovers, run_cli, setup_bad, write_inputs
from helpers import bit_products, random_bits

from dask_gpuchunk.cli import main


@pytest.fixture
def inputs(rng, tmp_path):
    return write_inputs(rng, tmp_path)


# ---- bad input: a non-zero exit, one line on stderr, nothing written -----------------------


BAD = [
    ("missing input", ["multiply", "nope.npy", "b.npy", "-o", "c.npy"], 3, "no such file"),
    ("input is a directory", ["multiply", "adir", "b.npy", "-o", "c.npy"], 3, "directory"),
    ("not a .npy", ["multiply", "text.npy", "b.npy", "-o", "c.npy"], 3, "not a .npy"),
    ("empty file", ["gram", "empty.npy", "-o", "c.npy"], 3, "not a .npy"),
    ("truncated", ["multiply", "trunc.npy", "trunc.npy", "-o", "c.npy"], 3, "truncated"),
    ("corrupt header", ["multiply", "corrupt.npy", "b.npy", "-o", "c.npy"], 3, "corrupt"),
    ("object dtype", ["multiply", "obj.npy", "b.npy", "-o", "c.npy"], 3, "Python objects"),
    ("header larger than its file", ["gram", "liar.npy", "-o", "c.npy"], 3, "truncated"),
    ("FIFO input", ["gram", "fifo.npy", "-o", "c.npy"], 3, "not a regular file"),
    ("shape mismatch", ["multiply", "a.npy", "mismatch.npy", "-o", "c.npy"], 3, "broadcast"),
    ("unsupported dtype", ["multiply", "half.npy", "b.npy", "-o", "c.npy"], 3, "float16"),
    ("string dtype", ["multiply", "strings.npy", "b.npy", "-o", "c.npy"], 3, "dtype"),
    ("gram of 1-D", ["gram", "vec.npy", "-o", "c.npy"], 3, "2-D"),
    ("gram of floats", ["gram", "floats.npy", "-o", "c.npy"], 3, "bool or integer"),
    ("packed signed words", ["gram", "signed.npy", "-o", "c.npy", "--packed"], 3, "unsigned"),
    ("non-0/1 bits", ["gram", "badbits.npy", "-o", "c.npy"], 3, "row 4, column 66"),
    ("output exists", ["multiply", "a.npy", "b.npy", "-o", "exists.npy"], 4, "--overwrite"),
    ("output dir missing", ["multiply", "a.npy", "b.npy", "-o", "no/dir/c.npy"], 4, "does not exist"),
    ("output is a directory", ["multiply", "a.npy", "b.npy", "-o", "adir"], 4, "directory"),
    ("output is an input", ["multiply", "a.npy", "b.npy", "-o", "a.npy", "--overwrite"], 4,
     "also an input"),
    ("output dir read-only", ["multiply", "a.npy", "b.npy", "-o", "readonly/c.npy"], 4,
     "not writable"),
    ("output dir not writable (even by root)", ["multiply", "a.npy", "b.npy", "-o",
                                                "/proc/dask-gpuchunk-c.npy"], 4, "not writable"),
    ("bad memory limit", ["multiply", "a.npy", "b.npy", "-o", "c.npy", "--memory-limit", "lots"],
     2, "memory size"),
    ("bad device memory limit", ["gram", "bits.npy", "-o", "c.npy", "--device-memory-limit",
                                 "-3GB"], 2, "negative"),
    ("infinite device memory limit", ["gram", "bits.npy", "-o", "c.npy",
                                      "--device-memory-limit", "inf"], 2, "not a size"),
    ("infinite memory limit", ["gram", "bits.npy", "-o", "c.npy", "--memory-limit", "inf"], 2,
     "not a size"),
    ("bad chunk size", ["multiply", "a.npy", "b.npy", "-o", "c.npy", "--chunk-size", "abc"], 2,
     "chunk-size"),
    ("tiny chunk size", ["multiply", "long.npy", "long.npy", "-o", "c.npy", "--chunk-size", "1"],
     2, "use at least 24 B"),
    ("empty chunk size", ["multiply", "a.npy", "b.npy", "-o", "c.npy", "--chunk-size", ""], 2,
     "--chunk-size is empty"),
    ("zero chunk rows", ["gram", "bits.npy", "-o", "c.npy", "--chunk-rows", "0"], 2, "chunk-rows"),
    ("bad method", ["gram", "bits.npy", "-o", "c.npy", "--method", "magic"], 2, "method"),
    ("bad layout", ["gram", "bits.npy", "-o", "c.npy", "--layout", "cols"], 2, "layout"),
    # In process: a worker's error reaching the command through a cluster is the case above.
    ("non-0/1 bits, row slabs", ["gram", "badbits.npy", "-o", "c.npy", "--layout", "rows",
                                 "--chunk-rows", "2", "--in-process"], 3, "row 4, column 66"),
    ("bad device", ["multiply", "a.npy", "b.npy", "-o", "c.npy", "--device", "tpu"], 2, "device"),
    ("both scheduler options", ["multiply", "a.npy", "b.npy", "-o", "c.npy", "--scheduler-file",
                                "s.json", "--scheduler-address", "tcp://127.0.0.1:1"], 2, "not both"),
    ("missing scheduler file", ["multiply", "a.npy", "b.npy", "-o", "c.npy", "--scheduler-file",
                                "s.json"], 5, "scheduler file"),
    ("empty scheduler file", ["gram", "bits.npy", "-o", "c.npy", "--scheduler-file",
                              "empty.json"], 5, "is empty"),
    ("scheduler file not JSON", ["gram", "bits.npy", "-o", "c.npy", "--scheduler-file",
                                 "garbage.json"], 5, "not JSON"),
    ("scheduler file without address", ["gram", "bits.npy", "-o", "c.npy", "--scheduler-file",
                                        "noaddr.json"], 5, "no scheduler address"),
    ("local option with a joined cluster", ["multiply", "a.npy", "b.npy", "-o", "c.npy",
                                            "--scheduler-file", "s.json", "--gpus", "1"], 2,
     "local cluster"),
    ("zero threads", ["multiply", "a.npy", "b.npy", "-o", "c.npy", "--threads-per-gpu", "0"], 2,
     "threads-per-gpu"),
    ("missing output option", ["multiply", "a.npy", "b.npy"], 2, "--output"),
    # The command line's words, not the API's (top_k, x and y, overwrite=True):
    ("top-k beyond the candidates", ["similarity", "bits.npy", "--top-k", "6", "-o", "t.npz"],
     2, "--top-k must be between 1 and 5 (the candidates of each row in bits.npy); got 6"),
    ("queries of other bits", ["similarity", "bits.npy", "--queries", "bits71.npy", "--top-k",
                               "2", "-o", "t.npz"], 3,
     "--queries bits71.npy has 71 bits of uint8 a row, FINGERPRINTS bits.npy 70"),
    ("threshold beyond the scores", ["similarity", "bits.npy", "--threshold", "1.5", "-o",
                                     "t.npz"], 2, "--threshold for --metric tanimoto"),
    ("output exists, CLI words", ["gram", "bits.npy", "-o", "exists.npy"], 4,
     "exists; pass --overwrite to replace it"),
    # Slips that ran with other meanings, or failed late, before: each refused at once.
    ("empty memory limit", ["gram", "bits.npy", "-o", "c.npy", "--memory-limit", ""], 2,
     "--memory-limit is empty"),
    ("memory limit 1.5", ["gram", "bits.npy", "-o", "c.npy", "--memory-limit", "1.5"], 2,
     "neither a fraction"),
    ("device memory limit 2 bytes", ["gram", "bits.npy", "-o", "c.npy",
                                     "--device-memory-limit", "2"], 2, "is 2 bytes"),
    ("output names a directory", ["multiply", "a.npy", "b.npy", "-o", "newdir/"], 4,
     "names a directory"),
    ("empty scheduler address", ["gram", "bits.npy", "-o", "c.npy", "--scheduler-address", ""],
     2, "--scheduler-address is empty"),
    ("empty scheduler file", ["gram", "bits.npy", "-o", "c.npy", "--scheduler-file", ""], 2,
     "--scheduler-file is empty"),
    ("compression level out of range", ["multiply", "a.npy", "b.npy", "-o", "c.zarr",
                                        "--compression", "zstd:99"], 2, "1 to 22"),
    ("chunks too small for their number", ["multiply", "long.npy", "long.npy", "-o", "c.npy",
                                           "--chunk-size", "1kB"], 2, "use at least 1.00 MiB"),
    ("zarr chunks of no size", ["multiply", "zerochunks.zarr", "b.npy", "-o", "c.npy"], 3,
     "every chunk size must be 1 or more"),
    ("top-k of no rows", ["similarity", "norows.npy", "--top-k", "3", "-o", "t.npz"], 3,
     "has 0 row(s): no candidates"),
    ("top-k of 10**18", ["similarity", "bits.npy", "--top-k", str(10**18), "-o", "t.npz"], 2,
     "--top-k must be between 1 and 5"),
]


@pytest.mark.parametrize("case, args, code, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_exits_with_one_line_and_writes_nothing(tmp_path, monkeypatch, case, args,
                                                          code, match):
    if case == "output dir read-only" and os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    setup_bad(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, (result.exit_code, result.output)
    message = result.stderr.strip() if result.stderr else result.output.strip()
    assert match in message, message
    if code != 2:  # click's usage errors add a usage line and a hint; ours are one line
        assert "\n" not in message and message.startswith("error:"), message
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    os.chmod(tmp_path / "readonly", 0o700)


def test_a_bad_setting_is_a_usage_error_naming_it(tmp_path, monkeypatch):
    setup_bad(tmp_path)
    monkeypatch.chdir(tmp_path)
    with dask.config.set({"gpuchunk.file-writes": "abc"}):
        result = CliRunner().invoke(main, ["gram", "bits.npy", "-o", "c.npy"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("error: setting gpuchunk.file-writes (environment: "
                                     "DASK_GPUCHUNK__FILE_WRITES) is 'abc'; it takes a whole "
                                     "number, 0 or more")
    assert not (tmp_path / "c.npy").exists()


def test_an_unknown_setting_is_a_usage_error_naming_the_closest(tmp_path, monkeypatch):
    setup_bad(tmp_path)
    monkeypatch.chdir(tmp_path)
    with dask.config.set({"gpuchunk.file_writs": 2}):  # DASK_GPUCHUNK__FILE_WRITS=2
        result = CliRunner().invoke(main, ["gram", "bits.npy", "-o", "c.npy"])
    assert result.exit_code == 2, result.output
    assert "did you mean gpuchunk.file-writes?" in result.stderr


def test_a_big_endian_zarr_input_is_read_as_a_big_endian_npy_is(rng, tmp_path, monkeypatch):
    zarr = pytest.importorskip("zarr")
    a = rng.standard_normal((30, 4))
    zarr.create_array(str(tmp_path / "be.zarr"), shape=a.shape, chunks=(8, 4), dtype=">f8",
                      zarr_format=2)[:] = a
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["multiply", "be.zarr", "be.zarr", "-o", "c.npy",
                                       "--in-process"])
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), a * a)


def test_a_compressed_store_on_a_full_disk_exits_4_and_leaves_nothing(rng, tmp_path,
                                                                      monkeypatch):
    pytest.importorskip("zarr")
    import errno

    from dask_gpuchunk.io import zarr_store

    real, calls = zarr_store._write_all, []

    def full(fd, pieces):  # the metadata fits; the disk is full by the first chunk
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, pieces)

    np.save(tmp_path / "a.npy", rng.standard_normal((40, 4)))
    monkeypatch.setattr(zarr_store, "_write_all", full)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "a.npy", "-o", "c.zarr",
                                       "--compression", "zstd", "--in-process"])
    assert result.exit_code == 4, result.output
    assert "no room left" in result.stderr and "\n" not in result.stderr.strip()
    assert sorted(os.listdir(tmp_path)) == ["a.npy"]


def test_a_tiny_output_fits_a_small_file_system(tmp_path, monkeypatch):
    # A 448-byte output on a 5 MiB file system: the 64 MiB margin refused it before.
    from dask_gpuchunk.io import npy_writing as io

    class Small:
        f_frsize, f_blocks, f_bavail = 4096, 5 * 256, 4 * 256

    monkeypatch.setattr(io.os, "statvfs", lambda path: Small())
    io.check_space(tmp_path, 448)
    with pytest.raises(io.NoSpaceError):
        io.check_space(tmp_path, 4 * 2**20)


def test_an_output_without_room_exits_4_before_any_work(tmp_path, monkeypatch):
    from dask_gpuchunk.io import npy_writing as io

    setup_bad(tmp_path)
    monkeypatch.chdir(tmp_path)

    class Full:  # 10 MB free: less than the 64 MiB margin alone
        f_bavail, f_frsize, f_blocks = 10_000, 1000, 10**9

    monkeypatch.setattr(io.os, "statvfs", lambda d: Full)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "b.npy", "-o", "c.npy"])
    assert result.exit_code == 4, result.output
    message = result.stderr.strip()
    assert "\n" not in message and message.startswith("error: output: "), message
    assert "has 9.54 MiB free (10,000,000 bytes); the output needs 448 bytes" in message
    assert not (tmp_path / "c.npy").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/proc/filesystems").exists() or
                    "tmpfs" not in Path("/proc/filesystems").read_text(),
                    reason="mounting a small tmpfs needs root")
def test_a_small_file_system_exits_4_with_nothing_written(rng, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                      capture_output=True, check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        np.save(tmp_path / "bits.npy", random_bits(rng, (2000, 64), 0.5))  # C: 16 MB
        result = CliRunner().invoke(main, ["gram", str(tmp_path / "bits.npy"), "-o",
                                           str(small / "g.npy")])
        assert result.exit_code == 4, result.output
        assert "needs 16,000,128 bytes" in result.stderr and os.listdir(small) == []
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.mark.parametrize("signum, code, said", [
    (signal.SIGTERM, 143, "error: terminated (SIGTERM); nothing was written"),
    (signal.SIGINT, 130, "error: interrupted; nothing was written"),
], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_mid_write_ends_the_job_in_one_line_with_nothing_left(rng, tmp_path, signum,
                                                                        code, said):
    # Ctrl-C in a terminal reaches the whole process group, workers included: sent so here.
    # The job starts with SIGINT's default action, as a terminal's foreground command does: a
    # test run started in the background by a shell ignores SIGINT, the job inherited that and
    # finished untouched (exit 0).
    np.save(tmp_path / "packed.npy", rng.integers(0, 256, (3000, 25000), dtype=np.uint8))
    job = subprocess.Popen([*PYTHON, "gram", str(tmp_path / "packed.npy"), "--packed", "-o",
                            str(tmp_path / "g.npy")], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not leftovers(tmp_path) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.poll() is None, job.communicate()  # still writing
    os.killpg(job.pid, signum)
    _, err = job.communicate(timeout=120)
    assert job.returncode == code and err.strip() == said, (job.returncode, err)
    assert sorted(os.listdir(tmp_path)) == ["packed.npy"]


@pytest.mark.parametrize("args", [
    ["multiply", "a.npy", "b.npy", "-o", "c.npy", "--gpus", "1"],
    ["multiply", "a.npy", "b.npy", "-o", "c.npy", "--device", "gpu"],
    ["gram", "bits.npy", "-o", "c.npy", "--method", "int8"],
    ["gram", "bits.npy", "-o", "c.npy", "--method", "bmma"],
    ["gram", "bits.npy", "-o", "c.npy", "--device", "gpu"],
], ids=["--gpus 1", "multiply --device gpu", "--method int8", "--method bmma",
        "gram --device gpu"])
def test_gpu_options_on_a_machine_without_gpu_exit_5(tmp_path, monkeypatch, args):
    from dask_gpuchunk import gpu_available

    if gpu_available():
        pytest.skip("a GPU is visible")
    setup_bad(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 5, (result.exit_code, result.output)
    message = result.stderr.strip()
    assert "GPU" in message and "\n" not in message and message.startswith("error:"), message
    assert not (tmp_path / "c.npy").exists()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["auto", "blocks", "rows", "upper"])
def test_gram_command_on_the_gpu(rng, tmp_path, layout):
    bits = random_bits(rng, (3000, 5000), 0.5)
    np.save(tmp_path / "bits.npy", np.packbits(bits, axis=1))
    r = run_cli("gram", str(tmp_path / "bits.npy"), "-o", str(tmp_path / "g.npy"), "--packed",
                "--chunk-rows", "1024", "--device", "gpu", "--layout", layout, "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["where"]["gpus"] >= 1
    assert summary["layout"] == ("rows" if layout == "auto" else layout)
    g = np.load(tmp_path / "g.npy")
    rows = rng.choice(3000, 10, replace=False)
    expected = bit_products(bits[rows], bits)
    np.testing.assert_array_equal(g[rows], expected)


# ---- nothing lost: no clobbering, pinned inputs, resolved paths --------------------------------


def test_two_jobs_to_one_target_one_wins_the_other_exits_4(inputs):
    d, a, b, _ = inputs
    target = str(d / "c.npy")
    args = [*PYTHON, "multiply", str(d / "a.npy"), str(d / "b.npy"), "-o", target,
            "--chunk-size", "40KB", "--in-process"]
    jobs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = [(p.wait(timeout=180), p.stderr.read()) for p in jobs]
    assert sorted(rc for rc, _ in results) == [0, 4], results
    loser = next(err for rc, err in results if rc == 4).strip()
    assert loser.startswith("error: output") and "\n" not in loser, loser
    np.testing.assert_array_equal(np.load(target), a * b)
    assert leftovers(d) == []


def test_a_target_that_appears_during_a_job_is_kept_exit_4(inputs, monkeypatch):
    from dask_gpuchunk.io import npy_writing as io

    d, *_ = inputs
    real = io.publish

    def another_job_first(tmp, target, key, overwrite):
        np.save(target, np.zeros(3))  # another job's result lands first
        real(tmp, target, key, overwrite)

    monkeypatch.setattr(io, "publish", another_job_first)
    monkeypatch.chdir(d)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "b.npy", "-o", "c.npy",
                                       "--in-process"])
    assert result.exit_code == 4, result.output
    assert "appeared during the job" in result.stderr and "\n" not in result.stderr.strip()
    np.testing.assert_array_equal(np.load(d / "c.npy"), np.zeros(3))
    assert leftovers(d) == []


def test_an_input_changed_during_a_job_exits_1_and_writes_nothing(inputs, monkeypatch):
    from dask_gpuchunk.io import npy_reading as io

    d, *_ = inputs
    real = io.check_unchanged

    def modified_meanwhile(path, pinned):
        if path.endswith("a.npy"):
            with open(path, "r+b") as f:  # in place, same size: a change only mtime shows
                f.seek(-8, os.SEEK_END)
                f.write(np.float64(7).tobytes())
            st = os.stat(path)
            os.utime(path, ns=(st.st_atime_ns, pinned.mtime_ns + 10**9))
        real(path, pinned)

    monkeypatch.setattr(io, "check_unchanged", modified_meanwhile)
    monkeypatch.chdir(d)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "b.npy", "-o", "c.npy",
                                       "--in-process"])
    assert result.exit_code == 1, result.output
    message = result.stderr.strip()
    assert "a.npy was modified during the job" in message and "\n" not in message, message
    assert not (d / "c.npy").exists() and leftovers(d) == []


def test_output_through_a_symlinked_directory_is_still_an_input(inputs, monkeypatch):
    d, a, *_ = inputs
    os.symlink(d, d / "dirlink")
    monkeypatch.chdir(d)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "b.npy", "-o", "dirlink/a.npy",
                                       "--overwrite"])
    assert result.exit_code == 4, result.output
    assert "is also an input" in result.stderr
    np.testing.assert_array_equal(np.load(d / "a.npy"), a)


def test_overwrite_refuses_a_fifo_and_keeps_a_files_mode(inputs, monkeypatch):
    d, a, b, _ = inputs
    os.mkfifo(d / "fifo.npy")
    monkeypatch.chdir(d)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "b.npy", "-o", "fifo.npy",
                                       "--overwrite"])
    assert result.exit_code == 4, result.output
    assert "a FIFO" in result.stderr
    np.save(d / "c.npy", np.zeros(2))
    os.chmod(d / "c.npy", 0o600)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "b.npy", "-o", "c.npy",
                                       "--overwrite", "--in-process"])
    assert result.exit_code == 0, result.output
    assert (os.stat(d / "c.npy").st_mode & 0o777) == 0o600
    np.testing.assert_array_equal(np.load(d / "c.npy"), a * b)


def test_workers_dying_under_a_chunk_is_one_line_naming_the_options(inputs, monkeypatch):
    from distributed.scheduler import KilledWorker

    from dask_gpuchunk import jobs

    d, *_ = inputs

    def killed(*args, **kwargs):
        raise KilledWorker("multiply-abc", "tcp://127.0.0.1:1", 3)

    monkeypatch.setattr(jobs.common, "to_npy", killed)
    monkeypatch.chdir(d)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "b.npy", "-o", "c.npy"])
    assert result.exit_code == 1, result.output
    message = result.stderr.strip()
    assert "--chunk-size" in message and "--memory-limit" in message and "\n" not in message
    assert not (d / "c.npy").exists()


def test_a_cluster_left_without_workers_ends_the_job_with_exit_5(inputs, monkeypatch):
    from dask_gpuchunk import jobs
    from dask_gpuchunk.io import NoWorkersError

    d, *_ = inputs
    seen = []

    def deserted(*args, **kwargs):
        seen.append(dask.config.get("gpuchunk.no-workers-timeout"))
        raise NoWorkersError("the cluster has had no workers for 2 s (the last one left or "
                             "died) with 3 of 5 chunks to go; nothing was written")

    monkeypatch.setattr(jobs.common, "to_npy", deserted)
    monkeypatch.chdir(d)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "b.npy", "-o", "c.npy",
                                       "--worker-timeout", "2"])
    assert result.exit_code == 5, result.output
    message = result.stderr.strip()
    assert "no workers for 2 s" in message and "\n" not in message, message
    assert seen == [2.0] and dask.config.get("gpuchunk.no-workers-timeout") == 300


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   ValueError("a value the job refused")],
                         ids=["OSError", "ValueError"])
def test_a_job_error_on_a_joined_cluster_is_the_job_s_not_the_cluster_s(inputs, monkeypatch,
                                                                       error):
    # Raised inside the job, these used to meet the joined cluster's own except clause: exit 5,
    # "cannot start or join the cluster: No space left on device".
    from distributed import Client, LocalCluster

    from dask_gpuchunk import cli, jobs

    d, *_ = inputs

    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(jobs.common, "to_npy", failing)
    monkeypatch.chdir(d)
    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster:
        monkeypatch.setattr(cli.running, "connect", lambda **kwargs: Client(cluster))
        result = CliRunner().invoke(main, ["multiply", "a.npy", "b.npy", "-o", "c.npy",
                                           "--scheduler-file", "scheduler.json"])
    message = result.stderr.strip()
    # no room: the output cannot be written (4); a refused value: bad usage (2)
    assert result.exit_code == (4 if isinstance(error, OSError) else 2), result.output
    assert str(error.args[-1]) in message and "cluster" not in message, message
    assert "\n" not in message and not (d / "c.npy").exists()
