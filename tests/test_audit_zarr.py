"""An audit of the jobs' Zarr inputs and outputs end to end through the command line, as a
hostile or careless neighbour meets them: the job's temporary store swapped for one of
symlinks, inputs changed during the job or damaged before it, ``--overwrite`` onto a directory
that is not only a store. Each case: the documented exit status, one line on stderr, nothing
written anywhere but where it belongs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from dask_gpuchunk.cli import main

zarr = pytest.importorskip("zarr")

PYTHON = [sys.executable, "-m", "dask_gpuchunk"]


def _run(*args: str) -> tuple[int, str]:
    """The command in this process (``--in-process``: no cluster), as (exit status, stderr)."""
    result = CliRunner().invoke(main, [*args, "--in-process"])
    return result.exit_code, (result.stderr or "").strip()


@pytest.fixture
def job(rng, tmp_path, monkeypatch):
    """Inputs of a multiply job in a directory of their own, the current directory."""
    a = rng.standard_normal((64, 12))
    b = rng.standard_normal((64, 12))
    np.save(tmp_path / "b.npy", b)
    code, err = _run_in(tmp_path, monkeypatch, "multiply", "b.npy", "b.npy", "-o", "sq.zarr",
                        "--chunk-size", "2kB")
    assert code == 0, err
    zarr.create_array(str(tmp_path / "a.zarr"), shape=a.shape, chunks=(16, 12),
                      dtype="f8")[:] = a
    return tmp_path, a, b


def _run_in(directory: Path, monkeypatch, *args: str) -> tuple[int, str]:
    monkeypatch.chdir(directory)
    return _run(*args)


def _victim(directory: Path) -> Path:
    victim = directory / "victim.txt"
    victim.write_text("precious")
    return victim


def _plant_symlink_store(place: Path, victim: Path) -> None:
    """What the attacker puts at the job's temporary name: a store of symlinks to the victim."""
    place.mkdir()
    (place / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "array"}))
    for i in range(8):
        (place / "c" / str(i)).mkdir(parents=True)
        os.symlink(victim, place / "c" / str(i) / "0")


# ---- the job's temporary store swapped ---------------------------------------------------------


@pytest.fixture
def request_cleanup():
    """Directories a test made outside pytest's own, removed after it."""
    made: list[Path] = []
    yield made
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def _assert_nothing_written_through(code: int, err: str, d: Path, victim: Path,
                                    swapped: list[Path]) -> None:
    """The job that met a swapped store: exit 4 in one line, the victim and the planted
    symlinks untouched, nothing published."""
    assert swapped
    assert code == 4, err
    assert "replaced" in err and "\n" not in err, err
    assert victim.read_text() == "precious"
    assert not (d / "c.zarr").exists()
    assert all(os.path.islink(p) for p in (swapped[0] / "c").glob("*/0"))  # theirs, untouched


def test_a_swapped_temporary_store_is_never_written_through_nor_published(job, monkeypatch):
    from dask_gpuchunk.io import zarr_store

    d, a, b = job
    victim = _victim(d)
    real = zarr_store.write_chunks
    swapped: list[Path] = []

    def swap_first(target, block, region):
        if not swapped:  # before the first chunk is written, the attacker moves in
            root = Path(target.root)
            root.rename(d / "stolen")
            _plant_symlink_store(root, victim)
            swapped.append(root)
        return real(target, block, region)

    monkeypatch.setattr(zarr_store, "write_chunks", swap_first)
    monkeypatch.setattr("dask_gpuchunk.io.zarr_files.write_chunks", swap_first)
    code, err = _run_in(d, monkeypatch, "multiply", "a.zarr", "b.npy", "-o", "c.zarr",
                        "--chunk-size", "2kB")
    _assert_nothing_written_through(code, err, d, victim, swapped)


def test_a_store_swapped_as_it_is_made_is_never_written_through(job, monkeypatch):
    # Between the job's mkdir and its open of the new directory, the attacker moves in: the
    # job must neither write through the planted symlinks nor remove the planted directory.
    d, a, b = job
    victim = _victim(d)
    real_open = os.open
    swapped: list[Path] = []

    def open_after_a_swap(path, flags, *args, **kwargs):
        name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
        if not swapped and name.endswith(".partial") and ".c.zarr." in name:
            Path(name).rename(d / "stolen")
            _plant_symlink_store(Path(name), victim)
            swapped.append(Path(name))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_after_a_swap)
    code, err = _run_in(d, monkeypatch, "multiply", "a.zarr", "b.npy", "-o", "c.zarr",
                        "--chunk-size", "2kB")
    monkeypatch.setattr(os, "open", real_open)
    _assert_nothing_written_through(code, err, d, victim, swapped)


@pytest.mark.parametrize("when", ["made", "kept open", "written", "published", "renamed"])
def test_a_store_moved_away_and_not_yet_replaced_exits_4(job, monkeypatch, when):
    # The attacker's rename and plant are two steps: a job that looks in between finds no
    # store at its name, which is the same refusal (exit 4), whichever step of the job meets it.
    from dask_gpuchunk.io import files, zarr_files, zarr_store

    d, a, b = job
    real_open, real_publish = os.open, zarr_store.publish_store
    real_rename = files.rename_noreplace
    moved: list[Path] = []
    opens = {"made": 1, "kept open": 2, "written": 3}

    def move_away(root: Path) -> None:
        if not moved:
            root.rename(d / "stolen")
            moved.append(root)

    def open_then_move(path, flags, *args, **kwargs):
        name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else ""
        if name.endswith(".partial") and ".c.zarr." in name:
            opens[when] -= 1
            if opens[when] == 0:
                move_away(Path(name))
        return real_open(path, flags, *args, **kwargs)

    def publish_moved(target, dest, overwrite):
        move_away(Path(target.root))
        return real_publish(target, dest, overwrite)

    def rename_moved(src, dst):
        move_away(Path(src))
        return real_rename(src, dst)

    if when in opens:
        monkeypatch.setattr(os, "open", open_then_move)
    elif when == "published":
        monkeypatch.setattr(zarr_files, "publish_store", publish_moved)
    else:  # between the publish's check of the name and its rename
        monkeypatch.setattr(files, "rename_noreplace", rename_moved)
    code, err = _run_in(d, monkeypatch, "multiply", "a.zarr", "b.npy", "-o", "c.zarr",
                        "--chunk-size", "2kB")
    monkeypatch.setattr(os, "open", real_open)
    assert moved
    assert code == 4, err
    assert "the job's temporary" in err and "\n" not in err, err
    assert not (d / "c.zarr").exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root, to run the attacker as another user")
def test_another_user_swapping_the_store_of_a_root_job(rng, request_cleanup):
    # In a directory anyone may write in (0777, no sticky bit), an unprivileged user renames
    # the root job's temporary store away and puts one of symlinks to a root-owned file there.
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="dgc-audit-", dir="/tmp"))  # reachable by others
    request_cleanup.append(top)
    os.chmod(top, 0o755)
    shared = top / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    victim = top / "victim.txt"  # root's, outside the shared directory
    victim.write_text("precious")
    np.save(shared / "a.npy", rng.standard_normal((20_000, 64)))
    pid = os.fork()
    if pid == 0:  # the attacker: another user, plain system calls only
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            code = _attack(shared, victim)
        finally:
            os._exit(code)
    try:
        done = subprocess.run([*PYTHON, "multiply", str(shared / "a.npy"), str(shared / "a.npy"),
                               "-o", str(shared / "c.zarr"), "--chunk-size", "1MB",
                               "--in-process"], capture_output=True, text=True, timeout=300)
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # it did swap the store
    assert done.returncode == 4, done.stderr
    assert victim.read_text() == "precious"
    assert not (shared / "c.zarr").exists()


def _attack(shared: Path, victim: Path) -> int:
    """Wait for the job's temporary store, rename it away, plant a store of symlinks."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        names = [n for n in os.listdir(shared)
                 if n.startswith(".c.zarr.") and n.endswith(".partial")]
        if names:
            place = shared / names[0]
            os.rename(place, shared / "stolen")
            _plant_symlink_store(place, victim)
            return 0
        time.sleep(0.0005)
    return 1


# ---- inputs changed during the job -------------------------------------------------------------


@pytest.mark.parametrize("how", ["chunk rewritten in place", "store replaced"])
def test_an_input_store_changed_during_the_job_exits_1_and_writes_nothing(job, monkeypatch,
                                                                           how):
    from dask_gpuchunk.io.zarr_files import ZarrReader

    d, a, b = job
    real = ZarrReader.__getitem__
    changed: list[bool] = []

    def change_once(self, region):
        data = real(self, region)
        if not changed:
            changed.append(True)
            if how == "chunk rewritten in place":  # same size, later time: the last chunk
                path = d / "a.zarr" / "c" / "3" / "0"
                raw = bytearray(path.read_bytes())
                raw[-1] ^= 0xFF
                path.write_bytes(bytes(raw))
            else:
                shutil.move(d / "a.zarr", d / "old.zarr")
                shutil.copytree(d / "old.zarr", d / "a.zarr")
        return data

    monkeypatch.setattr(ZarrReader, "__getitem__", change_once)
    code, err = _run_in(d, monkeypatch, "multiply", "a.zarr", "b.npy", "-o", "c.npy")
    assert code == 1, err
    assert "a.zarr changed during the job" in err and "\n" not in err, err
    assert not (d / "c.npy").exists()


# ---- damaged inputs ----------------------------------------------------------------------------


def test_a_chunk_missing_from_a_store_we_wrote_is_damage(job, monkeypatch):
    d, *_ = job
    os.unlink(d / "sq.zarr" / "c" / "1" / "0")
    code, err = _run_in(d, monkeypatch, "multiply", "sq.zarr", "b.npy", "-o", "c.npy")
    assert code == 3, err
    assert "chunk c/1/0 is missing" in err and "damaged" in err, err
    assert not (d / "c.npy").exists()


def test_a_chunk_missing_from_another_store_is_read_as_fill_value_said_once(job, monkeypatch):
    d, a, b = job
    os.unlink(d / "a.zarr" / "c" / "2" / "0")
    code, err = _run_in(d, monkeypatch, "multiply", "a.zarr", "b.npy", "-o", "c.npy")
    assert code == 0, err
    assert err.count("read as the fill value") == 1 and "c/2/0" in err, err
    want = a * b
    want[32:48] = 0.0
    np.testing.assert_array_equal(np.load(d / "c.npy"), want)


def test_a_shape_edited_in_the_metadata_of_a_store_we_wrote_is_damage(job, monkeypatch):
    d, *_ = job
    meta = d / "sq.zarr" / "zarr.json"
    document = json.loads(meta.read_text())
    document["shape"][0] *= 2
    meta.write_text(json.dumps(document))
    code, err = _run_in(d, monkeypatch, "multiply", "sq.zarr", "sq.zarr", "-o", "c.npy")
    assert code == 3, err
    assert "damaged" in err and "\n" not in err, err


def test_a_flipped_byte_of_a_compressed_chunk_fails_its_checksum_naming_it(job, monkeypatch):
    d, a, b = job
    code, err = _run_in(d, monkeypatch, "multiply", "a.zarr", "b.npy", "-o", "z.zarr",
                        "--compression", "zstd", "--chunk-size", "2kB")
    assert code == 0, err
    chunk = d / "z.zarr" / "c" / "1" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    chunk.write_bytes(bytes(raw))
    code, err = _run_in(d, monkeypatch, "multiply", "z.zarr", "b.npy", "-o", "c.npy")
    assert code == 3, err
    assert "z.zarr: chunk c/1/0 cannot be read" in err and "\n" not in err, err
    assert not (d / "c.npy").exists()


def test_a_truncated_raw_chunk_names_the_store_and_the_chunk(job, monkeypatch):
    d, *_ = job
    chunk = d / "a.zarr" / "c" / "1" / "0"
    os.truncate(chunk, 100)
    code, err = _run_in(d, monkeypatch, "multiply", "a.zarr", "b.npy", "-o", "c.npy")
    assert code == 3, err
    assert "a.zarr: chunk c/1/0 cannot be read" in err, err


# ---- --overwrite onto a directory that is more than a store ------------------------------------


@pytest.mark.parametrize("what", ["a group with a thesis", "an array with notes"])
def test_overwrite_replaces_only_a_store_of_zarr_s_own_entries(job, monkeypatch, what):
    d, *_ = job
    target = d / "proj.zarr"
    if what == "a group with a thesis":
        target.mkdir()
        (target / ".zgroup").write_text('{"zarr_format": 2}')
        (target / "thesis.tex").write_text("chapter one")
        foreign = target / "thesis.tex"
    else:
        shutil.copytree(d / "sq.zarr", target)
        (target / "sub").mkdir()
        (target / "sub" / "data.bin").write_bytes(b"mine")
        foreign = target / "sub" / "data.bin"
    before = sorted(str(p) for p in target.rglob("*"))
    code, err = _run_in(d, monkeypatch, "multiply", "a.zarr", "b.npy", "-o", "proj.zarr",
                        "--overwrite")
    assert code == 4, err
    assert ("is not a Zarr array store" in err if what.startswith("a group")
            else "holds sub/data.bin, which is not zarr's" in err), err
    assert sorted(str(p) for p in target.rglob("*")) == before and foreign.exists()
    # a store of zarr's entries alone is replaced
    code, err = _run_in(d, monkeypatch, "multiply", "a.zarr", "b.npy", "-o", "sq.zarr",
                        "--overwrite")
    assert code == 0, err
