"""The job commands end to end: ``multiply``, ``gram``, ``similarity``, ``demo``; local and
joined clusters; a scheduler or a worker killed mid-job; which jobs run in process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from cli_runs import PYTHON, leftovers, run_cli, setup_bad, write_inputs
from helpers import bit_products, random_bits

from dask_gpuchunk.cli import main


@pytest.fixture
def inputs(rng, tmp_path):
    return write_inputs(rng, tmp_path)


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
    while not leftovers(tmp_path) and time.monotonic() < deadline:  # joined, and writing
        time.sleep(0.02)
    procs[0].kill()  # the scheduler
    killed = time.monotonic()
    _, err = job.communicate(timeout=120)
    lines = [line for line in err.strip().splitlines() if not line.startswith("warning:")]
    assert job.returncode == 5, err
    # At once, not after distributed's client gave up reconnecting (15 s on the CI machine)
    assert time.monotonic() - killed < 10, err
    assert len(lines) == 1 and "lost its cluster" in lines[0], err
    assert not (tmp_path / "c.npy").exists() and leftovers(tmp_path) == []


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
    setup_bad(tmp_path)
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
