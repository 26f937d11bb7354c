"""Joining a running cluster: the scheduler file read only where no one else could have
written it, plain transports said, a peer that does not speak Dask refused in time, and a TLS
batch cluster made from ``dask-gpuchunk tls-credentials`` joined by the jobs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

import dask_gpuchunk as dg
from dask_gpuchunk.distributed.joining import (
    SCHEDULER_FILE_MAX_BYTES,
    PlainTransportWarning,
    read_scheduler_file,
    warn_if_plain,
    write_credentials,
)

PYTHON = [sys.executable, "-m", "dask_gpuchunk"]


def _scheduler_file(path, address="tls://127.0.0.1:8786", mode=0o600):
    path.write_text(json.dumps({"type": "Scheduler", "address": address}))
    os.chmod(path, mode)
    return path


def test_a_scheduler_file_of_this_user_gives_its_address(tmp_path):
    assert read_scheduler_file(_scheduler_file(tmp_path / "s.json")) == "tls://127.0.0.1:8786"


@pytest.mark.parametrize("case, match", [
    ("group-writable", "can be written by its group or others"),
    ("fifo", "not a regular file"),
    ("device", "not a regular file"),
    ("huge", "a scheduler file is a small JSON document"),
    ("empty name", "name is empty"),
    ("not json", "not JSON"),
    ("no address", "names no scheduler address"),
])
def test_a_scheduler_file_that_is_not_safe_to_read_is_refused_at_once(tmp_path, case, match):
    path = tmp_path / "s.json"
    if case == "group-writable":
        _scheduler_file(path, mode=0o664)
    elif case == "fifo":
        os.mkfifo(path)  # opened without waiting for a writer
    elif case == "device":
        path = "/dev/zero"  # never read (it grew to 15 GB before)
    elif case == "huge":
        _scheduler_file(path, address="tcp://" + "9" * SCHEDULER_FILE_MAX_BYTES)
    elif case == "empty name":
        path = ""
    elif case == "not json":
        path.write_text("garbage{")
    else:
        path.write_text('{"type": "Scheduler"}')
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match) as err:
        read_scheduler_file(path)
    assert time.monotonic() - t0 < 5 and len(str(err.value)) < 400


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root, to give the file to another user")
def test_a_scheduler_file_of_another_user_is_refused(tmp_path):
    path = _scheduler_file(tmp_path / "s.json", address="tcp://127.0.0.1:1")
    os.chown(path, 65534, 65534)
    with pytest.raises(ValueError, match="owned by another user"):
        read_scheduler_file(path)
    # A job given it never connects: exit 5, before any address is tried.
    np.save(tmp_path / "a.npy", np.ones((4, 3)))
    done = subprocess.run([*PYTHON, "multiply", str(tmp_path / "a.npy"), str(tmp_path / "a.npy"),
                           "-o", str(tmp_path / "c.npy"), "--scheduler-file", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 5 and "owned by another user" in done.stderr, done.stderr


def test_a_plain_address_is_said_once_tls_is_not():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn_if_plain("tls://10.0.0.1:8786")
        warn_if_plain("tcp://10.0.0.1:8786")
        warn_if_plain("10.0.0.1:8786")
        warn_if_plain("ucx://10.0.0.1:8786")
    said = [str(w.message) for w in seen if w.category is PlainTransportWarning]
    assert len(said) == 3 and all("anyone who can reach it can run code as you" in m
                                  for m in said)


@pytest.fixture
def stranger():
    """A TCP server that is not a Dask scheduler: it answers every connection with garbage
    and keeps it open."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def serve():
        server.settimeout(0.2)
        held = []
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"\xff" * 64)  # frame lengths of exabytes to a Dask reader
            held.append(conn)
        for conn in held:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"tcp://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(timeout=5)
    server.close()


def test_a_peer_that_does_not_speak_dask_is_refused_in_time(stranger):
    import dask

    before = dask.config.get("scheduler", None)
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlainTransportWarning)
        with pytest.raises(OSError, match="answer as a Dask scheduler"):
            dg.connect(address=stranger, timeout=2)
    assert time.monotonic() - t0 < 30
    # distributed's failed Client had left scheduler="dask.distributed": every later compute
    # of the process failed with "no Client active"
    assert dask.config.get("scheduler", None) == before
    assert float(dask.array.ones(3, chunks=2).sum().compute()) == 3.0


def test_the_job_joining_a_stranger_exits_5_in_one_line(stranger, tmp_path):
    np.save(tmp_path / "a.npy", np.ones((4, 3)))
    done = subprocess.run([*PYTHON, "multiply", str(tmp_path / "a.npy"), str(tmp_path / "a.npy"),
                           "-o", str(tmp_path / "c.npy"), "--scheduler-address", stranger],
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith("warning:")]
    assert done.returncode == 5, done.stderr
    assert len(lines) == 1 and "answer as a Dask scheduler" in lines[0], done.stderr
    assert "EiB" not in done.stderr and not (tmp_path / "c.npy").exists()


@pytest.mark.slow
def test_a_tls_batch_cluster_made_from_our_credentials_runs_a_job(rng, tmp_path):
    # The README's batch recipe, on loopback: the credentials, a TLS scheduler and worker, the
    # job joining with them (and refused without them).
    paths = write_credentials(tmp_path / "tls")
    assert oct(os.stat(tmp_path / "tls").st_mode & 0o777) == "0o700"
    tls = ["--tls-ca-file", str(paths["ca"]), "--tls-cert", str(paths["cert"]),
           "--tls-key", str(paths["key"])]
    sched = tmp_path / "s.json"
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler",
                               "--scheduler-file", str(sched), "--protocol", "tls", "--host",
                               "127.0.0.1", "--port", "0", "--dashboard-address",
                               "127.0.0.1:0", *tls], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not sched.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker",
                                       "--scheduler-file", str(sched), "--host", "127.0.0.1",
                                       "--nthreads", "1", "--no-nanny", "--dashboard-address",
                                       "127.0.0.1:0", *tls], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        a = rng.random((500, 7))
        np.save(tmp_path / "a.npy", a)
        job = [*PYTHON, "multiply", str(tmp_path / "a.npy"), str(tmp_path / "a.npy"), "-o",
               str(tmp_path / "c.npy"), "--scheduler-file", str(sched), "--workers", "1"]
        done = subprocess.run([*job, *tls], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        assert "warning" not in done.stderr, done.stderr  # TLS: nothing to warn about
        np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), a * a)
        job[job.index("-o") + 1] = str(tmp_path / "d.npy")
        done = subprocess.run(job, capture_output=True, text=True, timeout=180)
        assert done.returncode == 5 and "talks TLS: give its credentials" in done.stderr
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
