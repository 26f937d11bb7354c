"""The job commands end to end: ``multiply``, ``gram``, ``demo``; local and joined clusters;
bad input (each a non-zero exit, one line on stderr, nothing written); a worker killed mid-job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import bit_products, random_bits

from dask_gpuchunk.cli import main

PYTHON = [sys.executable, "-m", "dask_gpuchunk"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command in a fresh process, as a user runs it."""
    return subprocess.run([*PYTHON, *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.fixture
def inputs(rng, tmp_path):
    a = rng.random((2000, 30))
    b = rng.random((1, 30))  # broadcast along the rows
    bits = random_bits(rng, (300, 1043), 0.4)
    for name, arr in (("a", a), ("b", b), ("bits", bits)):
        np.save(tmp_path / f"{name}.npy", arr)
    np.save(tmp_path / "packed.npy", np.packbits(bits, axis=1))
    return tmp_path, a, b, bits


def test_multiply_and_gram_on_a_local_cluster(inputs):
    d, a, b, bits = inputs
    r = run_cli("multiply", str(d / "a.npy"), str(d / "b.npy"), "-o", str(d / "c.npy"),
                "--chunk-size", "100kB", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["output"]["shape"] == [2000, 30] and summary["chunks"] > 1
    assert summary["where"]["workers"] == 1 and summary["seconds"] > 0
    np.testing.assert_array_equal(np.load(d / "c.npy"), a * b)

    # The CPU's default layout (each slab's strip from the diagonal, also written transposed)
    # on the cluster and dask's blocks (in this process: a cluster's start is most of a run
    # here) give the same file.
    expected = bit_products(bits, bits)
    for layout, chosen, where in (("auto", "upper", ()), ("blocks", "blocks", ("--in-process",))):
        r = run_cli("gram", str(d / "bits.npy"), "-o", str(d / f"g-{layout}.npy"),
                    "--chunk-rows", "128", "--layout", layout, "--json", *where)
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert summary["layout"] == chosen
        np.testing.assert_array_equal(np.load(d / f"g-{layout}.npy"), expected)


def test_gram_of_packed_words_and_in_row_slabs(inputs):
    # In this process (the test above runs gram on the default local cluster): a cluster's
    # start is most of a CLI run's time here.
    d, _, _, bits = inputs
    expected = bit_products(bits, bits)
    r = run_cli("gram", str(d / "packed.npy"), "-o", str(d / "g2.npy"), "--packed",
                "--in-process")
    assert r.returncode == 0, r.stderr
    assert "gram:" in r.stdout and "bit-MAC/s" in r.stdout
    np.testing.assert_array_equal(np.load(d / "g2.npy"), expected)

    r = run_cli("gram", str(d / "bits.npy"), "-o", str(d / "g3.npy"), "--chunk-rows", "70",
                "--layout", "rows", "--json", "--in-process")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["layout"] == "rows" and summary["chunks"] == -(-len(bits) // 70)
    np.testing.assert_array_equal(np.load(d / "g3.npy"), expected)


def test_demo_runs_and_checks_itself():
    r = run_cli("demo", "--rows", "20000", "--bit-rows", "300", "--bits", "2000", "--json",
                "--in-process")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["command"] == "demo"
    assert summary["checked"]["multiply_rows"] > 0 and summary["checked"]["gram_rows"] > 0
    assert summary["gram"]["output"]["shape"] == [300, 300]


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def scheduler_and_two_workers(tmp_path):
    """``dask scheduler`` and two ``dask worker`` processes on loopback, through a scheduler file."""
    sched_file = tmp_path / "scheduler.json"
    dask = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
    procs = [_start([*dask, "--scheduler-file", str(sched_file), "--host", "127.0.0.1",
                     "--port", "0", "--dashboard-address", ":0"])]
    deadline = time.time() + 60
    while not sched_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    worker = [sys.executable, "-m", "distributed.cli.dask_worker"]
    for i in range(2):
        # One with the preload shim, one without: a job's worker plugin sets up both.
        preload = ["--preload", "dask_gpuchunk.distributed.cluster"] if i == 0 else []
        procs.append(_start([*worker, "--scheduler-file", str(sched_file), "--nthreads", "1",
                             "--no-nanny", "--host", "127.0.0.1", "--name", f"w{i}",
                             "--dashboard-address", ":0", "--local-directory", str(tmp_path),
                             *preload]))
    from distributed import Client

    with Client(scheduler_file=str(sched_file), timeout=60) as client:
        client.wait_for_workers(2, timeout=60)
    yield sched_file, procs
    for p in procs:
        p.kill()
        p.wait(timeout=30)


def test_jobs_on_a_cluster_joined_through_a_scheduler_file(inputs, scheduler_and_two_workers):
    d, a, b, bits = inputs
    sched_file, _ = scheduler_and_two_workers
    r = run_cli("multiply", str(d / "a.npy"), str(d / "b.npy"), "-o", str(d / "c.npy"),
                "--chunk-size", "50kB", "--scheduler-file", str(sched_file), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["where"]["workers"] == 2
    np.testing.assert_array_equal(np.load(d / "c.npy"), a * b)
    from distributed import Client

    with Client(scheduler_file=str(sched_file), timeout=60) as client:
        plugins = client.run(lambda dask_worker: sorted(dask_worker.plugins))
    assert all("dask-gpuchunk-setup" in names for names in plugins.values()), plugins
    r = run_cli("gram", str(d / "bits.npy"), "-o", str(d / "g.npy"), "--chunk-rows", "100",
                "--scheduler-file", str(sched_file))
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(d / "g.npy"), bit_products(bits, bits))
    # GPU work is checked where it runs, once joined (a batch job's submitting host may have
    # no GPU where its workers do): these workers have none, and say so.
    for args in (["gram", str(d / "bits.npy"), "-o", str(d / "g-bmma.npy"), "--method", "bmma"],
                 ["multiply", str(d / "a.npy"), str(d / "b.npy"), "-o", str(d / "c-gpu.npy"),
                  "--device", "gpu"]):
        r = run_cli(*args, "--scheduler-file", str(sched_file))
        assert r.returncode == 5, r.stderr
        assert "none of the cluster's 2 worker(s) sees one" in r.stderr
        lines = [line for line in r.stderr.strip().splitlines()
                 if not line.startswith("warning: the scheduler at tcp://")]  # plain TCP, said
        assert len(lines) == 1 and not Path(args[args.index("-o") + 1]).exists()


def test_a_scheduler_killed_mid_job_ends_it_with_exit_5_in_one_line(rng, tmp_path,
                                                                      scheduler_and_two_workers):
    sched_file, procs = scheduler_and_two_workers
    np.save(tmp_path / "big.npy", rng.random((3_000_000, 8)))
    job = subprocess.Popen([*PYTHON, "multiply", str(tmp_path / "big.npy"),
                            str(tmp_path / "big.npy"), "-o", str(tmp_path / "c.npy"),
                            "--chunk-size", "256kB", "--scheduler-file", str(sched_file)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not _leftovers(tmp_path) and time.monotonic() < deadline:  # joined, and writing
        time.sleep(0.02)
    procs[0].kill()  # the scheduler
    killed = time.monotonic()
    _, err = job.communicate(timeout=120)
    lines = [line for line in err.strip().splitlines() if not line.startswith("warning:")]
    assert job.returncode == 5, err
    # At once, not after distributed's client gave up reconnecting (15 s on the CI machine)
    assert time.monotonic() - killed < 10, err
    assert len(lines) == 1 and "lost its cluster" in lines[0], err
    assert not (tmp_path / "c.npy").exists() and _leftovers(tmp_path) == []


def test_a_job_joining_a_cluster_waits_for_its_workers(inputs, tmp_path):
    # A batch job's workers join after its scheduler starts: the job waits for them (here none
    # comes), then ends with exit 5 and nothing written, no hidden partial file either.
    d, _, _, _ = inputs
    sched_file = tmp_path / "scheduler.json"
    scheduler = _start([sys.executable, "-m", "distributed.cli.dask_scheduler", "--scheduler-file",
                        str(sched_file), "--host", "127.0.0.1", "--port", "0",
                        "--dashboard-address", ":0"])
    try:
        deadline = time.time() + 60
        while not sched_file.exists() and time.time() < deadline:
            time.sleep(0.2)
        before = sorted(p.name for p in d.iterdir())
        t0 = time.time()
        r = run_cli("multiply", str(d / "a.npy"), str(d / "b.npy"), "-o", str(d / "c.npy"),
                    "--scheduler-file", str(sched_file), "--workers", "2", "--worker-timeout", "3")
        assert r.returncode == 5, r.stderr
        assert time.time() - t0 < 60
        assert "waiting for workers: 0 of 2 joined" in r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("error:") and "0 of 2" in r.stderr
        assert sorted(p.name for p in d.iterdir()) == before
    finally:
        scheduler.kill()
        scheduler.wait(timeout=30)


@pytest.mark.parametrize("option", ["--workers", "--wait-workers"])
def test_workers_option_needs_a_joined_cluster(tmp_path, monkeypatch, option):
    _setup_bad(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["multiply", "a.npy", "b.npy", "-o", "c.npy", option, "2"])
    assert result.exit_code == 2 and "joined cluster" in result.output


def test_worker_killed_mid_job_completes_or_fails_cleanly(rng, tmp_path, scheduler_and_two_workers):
    sched_file, procs = scheduler_and_two_workers
    a = rng.random((400_000, 50))  # 160 MB, in 1 MB chunks: long enough to kill a worker
    np.save(tmp_path / "a.npy", a)
    out = tmp_path / "out" / "c.npy"
    out.parent.mkdir()
    job = subprocess.Popen([*PYTHON, "multiply", str(tmp_path / "a.npy"), str(tmp_path / "a.npy"),
                            "-o", str(out), "--chunk-size", "1MB", "--scheduler-file",
                            str(sched_file), "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not any(out.parent.iterdir()) and time.time() < deadline and job.poll() is None:
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)  # a worker dies while chunks are being written
    _, stderr = job.communicate(timeout=240)
    names = sorted(p.name for p in out.parent.iterdir())
    print(f"job exit status after the kill: {job.returncode}; {stderr.strip()[:200]}")
    if job.returncode == 0:
        assert names == ["c.npy"]
        np.testing.assert_array_equal(np.load(out), a * a)
    else:
        assert names == [], names  # never a half-written file
        assert stderr.strip().count("\n") == 0 and stderr.startswith("error:")


# ---- bad input: a non-zero exit, one line on stderr, nothing written -----------------------


def _setup_bad(d: Path) -> None:
    np.save(d / "a.npy", np.ones((10, 4)))
    np.save(d / "b.npy", np.ones((10, 4)))
    np.save(d / "mismatch.npy", np.ones((7, 4)))
    np.save(d / "half.npy", np.ones((10, 4), np.float16))
    np.save(d / "strings.npy", np.array(["a", "b"]))
    np.save(d / "obj.npy", np.array([{}, 1], dtype=object))
    np.save(d / "vec.npy", np.ones(10, np.uint8))
    np.save(d / "floats.npy", np.ones((4, 9)))
    np.save(d / "signed.npy", np.ones((4, 9), np.int16))
    bad_bits = np.ones((6, 70), np.uint8)
    bad_bits[4, 66] = 2
    np.save(d / "badbits.npy", bad_bits)
    np.save(d / "bits.npy", np.ones((6, 70), np.uint8))
    np.save(d / "bits71.npy", np.ones((3, 71), np.uint8))
    np.save(d / "norows.npy", np.ones((0, 70), np.uint8))
    (d / "zerochunks.zarr").mkdir()
    (d / "zerochunks.zarr" / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [4, 4], "chunks": [0, 4], "dtype": "<f8", "order": "C",
        "compressor": None, "filters": None, "fill_value": 0}))
    np.save(d / "exists.npy", np.zeros(3))
    np.save(d / "long.npy", np.ones((200_001, 1)))
    (d / "text.npy").write_text("not numpy at all")
    (d / "empty.npy").write_bytes(b"")
    np.save(d / "trunc.npy", np.ones((100, 100)))
    os.truncate(d / "trunc.npy", 500)
    (d / "corrupt.npy").write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': nonsense")
    # A header that claims 2**64 bytes (which wraps to 0 in int64) in a 128-byte file.
    text = repr({"descr": "|u1", "fortran_order": False, "shape": (2**32, 2**32)}).encode()
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"
    (d / "liar.npy").write_bytes(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text)
    os.mkfifo(d / "fifo.npy")
    (d / "empty.json").write_text("")
    (d / "garbage.json").write_text("garbage{")
    (d / "noaddr.json").write_text('{"type": "Scheduler"}')
    (d / "adir").mkdir()
    (d / "readonly").mkdir()
    os.chmod(d / "readonly", 0o500)


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
    _setup_bad(tmp_path)
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
    _setup_bad(tmp_path)
    monkeypatch.chdir(tmp_path)
    with dask.config.set({"gpuchunk.file-writes": "abc"}):
        result = CliRunner().invoke(main, ["gram", "bits.npy", "-o", "c.npy"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("error: setting gpuchunk.file-writes (environment: "
                                     "DASK_GPUCHUNK__FILE_WRITES) is 'abc'; it takes a whole "
                                     "number, 0 or more")
    assert not (tmp_path / "c.npy").exists()


def test_an_unknown_setting_is_a_usage_error_naming_the_closest(tmp_path, monkeypatch):
    _setup_bad(tmp_path)
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

    _setup_bad(tmp_path)
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
    while not _leftovers(tmp_path) and job.poll() is None and time.monotonic() < deadline:
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
    _setup_bad(tmp_path)
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


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".partial"))


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
    assert _leftovers(d) == []


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
    assert _leftovers(d) == []


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
    assert not (d / "c.npy").exists() and _leftovers(d) == []


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


def test_similarity_top_k_through_the_command_line(rng, tmp_path):
    fps = random_bits(rng, (90, 200), 0.2)
    np.save(tmp_path / "fps.npy", np.packbits(fps, axis=1))
    r = run_cli("similarity", str(tmp_path / "fps.npy"), "--packed", "--top-k", "3",
                "--chunk-rows", "32", "-o", str(tmp_path / "top.npz"), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["command"] == "similarity" and summary["output"]["shape"] == [90, 3]
    # Top-k on one GPU or none runs in this process unless a cluster is asked for.
    assert summary["where"]["cluster"] == "local threads"
    with np.load(tmp_path / "top.npz") as got:
        in_process = dict(got)
    r = run_cli("similarity", str(tmp_path / "fps.npy"), "--packed", "--top-k", "3",
                "--chunk-rows", "32", "-o", str(tmp_path / "top.npz"), "--json", "--overwrite",
                "--local-cluster")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["where"]["cluster"] == "LocalCluster"
    with np.load(tmp_path / "top.npz") as got:
        assert all(np.array_equal(got[name], in_process[name]) for name in in_process)
    c = bit_products(fps, fps)
    a = fps.sum(axis=1)
    s = np.float32(c) / np.float32(a[:, None] + a[None, :] - c)
    np.fill_diagonal(s, -1)
    with np.load(tmp_path / "top.npz") as got:
        order = np.argsort(-s.astype(np.float64), axis=1, kind="stable")[:, :3]
        np.testing.assert_array_equal(got["indices"], order)
    both = CliRunner().invoke(main, ["similarity", str(tmp_path / "fps.npy"), "--top-k", "3",
                                     "--dense", "-o", str(tmp_path / "x.npz")])
    assert both.exit_code == 2 and "leave out --top-k and --threshold" in both.output
    both = CliRunner().invoke(main, ["similarity", str(tmp_path / "fps.npy"), "--top-k", "3",
                                     "--local-cluster", "--in-process", "-o",
                                     str(tmp_path / "x.npz")])
    assert both.exit_code == 2 and "--local-cluster or --in-process" in both.output
    both = CliRunner().invoke(main, ["similarity", str(tmp_path / "fps.npy"), "--top-k", "3",
                                     "--local-cluster", "--scheduler-file", "s.json", "-o",
                                     str(tmp_path / "x.npz")])
    assert both.exit_code == 2 and "--scheduler-file joins one" in both.output
    assert sorted(os.listdir(tmp_path)) == ["fps.npy", "top.npz"]


def test_packed_bytes_without_packed_exit_3_naming_it_and_following_it_is_exact(rng, tmp_path,
                                                                                 monkeypatch):
    fps = random_bits(rng, (40, 300), 0.15)
    np.save(tmp_path / "fps.npy", np.packbits(fps, axis=1))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["similarity", "fps.npy", "--top-k", "3", "-o", "top.npz",
                                  "--in-process"])
    assert r.exit_code == 3, r.output
    message = r.stderr.strip()
    assert message.startswith("error: input: found") and "\n" not in message, message
    assert "pass --packed to use them as they are" in message and "packed=True" not in message
    assert not (tmp_path / "top.npz").exists()
    r = CliRunner().invoke(main, ["similarity", "fps.npy", "--top-k", "3", "-o", "top.npz",
                                  "--in-process", "--packed"])  # the hint, followed
    assert r.exit_code == 0, r.output
    c = bit_products(fps, fps)
    a = fps.sum(axis=1)
    s = np.float32(c) / np.float32(a[:, None] + a[None, :] - c)
    np.fill_diagonal(s, -1)
    with np.load(tmp_path / "top.npz") as got:
        np.testing.assert_array_equal(got["scores"], -np.sort(-s, axis=1)[:, :3])
        np.testing.assert_array_equal(np.take_along_axis(s, got["indices"], axis=1),
                                      got["scores"])


def test_a_job_in_process_needs_no_cluster_and_refuses_cluster_options(rng, tmp_path,
                                                                        monkeypatch):
    fps = random_bits(rng, (70, 130), 0.25)
    np.save(tmp_path / "fps.npy", fps)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["similarity", "fps.npy", "--metric", "dice", "--top-k", "4",
                                  "--chunk-rows", "16", "-o", "top.npz", "--json",
                                  "--in-process"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output.strip().splitlines()[-1])
    assert summary["where"]["cluster"] == "local threads"
    c = bit_products(fps, fps)
    a = fps.sum(axis=1)
    s = np.float32(2 * c) / np.float32(a[:, None] + a[None, :])
    np.fill_diagonal(s, -1)
    order = np.argsort(-s.astype(np.float64), axis=1, kind="stable")[:, :4]
    with np.load(tmp_path / "top.npz") as got:
        np.testing.assert_array_equal(got["indices"], order)
        np.testing.assert_array_equal(got["scores"], np.take_along_axis(s, order, axis=1))
    for extra in (["--gpus", "1"], ["--memory-limit", "4GB"], ["--scheduler-address",
                                                                "tcp://127.0.0.1:1"]):
        r = CliRunner().invoke(main, ["similarity", "fps.npy", "--top-k", "4", "-o", "x.npz",
                                      "--in-process", *extra])
        assert r.exit_code == 2 and "--in-process runs the job without a cluster" in r.output
        assert extra[0] in r.output
    assert sorted(os.listdir(tmp_path)) == ["fps.npy", "top.npz"]


def test_which_similarity_jobs_run_in_process_by_default(monkeypatch):
    from dask_gpuchunk import cli

    defaults = dict(cli.running._CLUSTER_DEFAULTS, in_process=False)
    monkeypatch.setattr(cli.commands, "gpu_count", lambda: 1)
    assert cli.commands._in_process_by_default(defaults)
    for name, value in (("gpus", "1"), ("scheduler_file", "s.json"), ("memory_limit", "8GB"),
                        ("device_memory_limit", "4GB"), ("threads_per_gpu", 4),
                        ("no_tls", True), ("spill_dir", "/tmp")):
        assert not cli.commands._in_process_by_default({**defaults, name: value}), name
    monkeypatch.setattr(cli.commands, "gpu_count", lambda: 2)  # several GPUs: a worker each
    assert not cli.commands._in_process_by_default(defaults)
