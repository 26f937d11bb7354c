"""Files never clobbered, swapped or silently changed (dask_gpuchunk.io.files), and how to_npy and
from_npy use them."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import dask.array as da
import numpy as np
import pytest

import dask_gpuchunk as dg
from dask_gpuchunk.io import files
from dask_gpuchunk.io.files import FileReplacedError, InputChangedError


@pytest.fixture(params=["renameat2", "link and unlink"])
def rename_way(request, monkeypatch):
    """Both ways of renaming without replacing: renameat2, and the fallback without it."""
    if request.param != "renameat2":
        monkeypatch.setattr(files, "_renameat2", lambda: None)
    elif files._renameat2() is None:
        pytest.skip("no renameat2 in this C library")
    return request.param


def test_rename_noreplace_keeps_an_existing_target(tmp_path, rename_way):
    (tmp_path / "new").write_text("new")
    (tmp_path / "old").write_text("old")
    with pytest.raises(FileExistsError, match="not replaced"):
        files.rename_noreplace(tmp_path / "new", tmp_path / "old")
    assert (tmp_path / "old").read_text() == "old" and (tmp_path / "new").exists()
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")  # a name taken, even if dangling
    with pytest.raises(FileExistsError):
        files.rename_noreplace(tmp_path / "new", tmp_path / "dangling")
    files.rename_noreplace(tmp_path / "new", tmp_path / "free")
    assert (tmp_path / "free").read_text() == "new" and not (tmp_path / "new").exists()


def _made(tmp_path, name="t"):
    path = tmp_path / name
    fd = files.create_exclusive(path)
    key = files.file_key(os.fstat(fd))
    os.write(fd, b"result")
    os.close(fd)
    return path, key


def test_publish_with_overwrite_replaces_only_regular_files_and_keeps_their_mode(tmp_path):
    tmp, ident = _made(tmp_path)
    target = tmp_path / "out.npy"
    target.write_text("before")
    os.chmod(target, 0o600)
    files.publish(tmp, target, ident, overwrite=True)
    assert target.read_text() == "result" and stat.S_IMODE(os.stat(target).st_mode) == 0o600
    os.mkfifo(tmp_path / "fifo")
    os.symlink(target, tmp_path / "link")
    (tmp_path / "dir").mkdir()
    for name, kind in (("fifo", "a FIFO"), ("link", "a symlink"), ("dir", "a directory")):
        tmp, ident = _made(tmp_path, f"t-{name}")
        with pytest.raises(FileExistsError, match=kind):
            files.publish(tmp, tmp_path / name, ident, overwrite=True)
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    assert os.path.islink(tmp_path / "link") and target.read_text() == "result"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_overwrite_refuses_a_device_node(tmp_path):
    os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    tmp, ident = _made(tmp_path)
    with pytest.raises(FileExistsError, match="a device node"):
        files.publish(tmp, tmp_path / "null", ident, overwrite=True)
    assert stat.S_ISCHR(os.lstat(tmp_path / "null").st_mode)


def test_a_temporary_file_swapped_for_a_symlink_is_never_written_or_published(tmp_path):
    # A shared directory without the sticky bit: anyone may rename or replace the entry.
    os.chmod(tmp_path, 0o777)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    tmp, ident = _made(tmp_path, ".out.npy.partial")
    os.unlink(tmp)
    os.symlink(victim, tmp)
    with pytest.raises(FileReplacedError):
        files.open_same(tmp, ident)
    with pytest.raises(FileReplacedError):
        files.publish(tmp, tmp_path / "out.npy", ident, overwrite=False)
    with pytest.raises(FileExistsError):  # nor is a planted name ever followed when created
        files.create_exclusive(tmp)
    assert victim.read_text() == "precious" and not (tmp_path / "out.npy").exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_swapped_in_between_the_check_and_the_rename_is_taken_back(tmp_path, monkeypatch,
                                                                         overwrite):
    tmp, ident = _made(tmp_path, ".out.npy.partial")
    if overwrite:
        (tmp_path / "out.npy").write_text("old")
    real_lstat = os.lstat

    def swap_after_the_check(path, *args, **kwargs):
        st = real_lstat(path, *args, **kwargs)
        if os.fspath(path) == os.fspath(tmp) and not (tmp_path / "job's").exists():
            os.rename(tmp, tmp_path / "job's")  # the check saw the job's; then the swap
            tmp.write_text("someone else's")
        return st

    monkeypatch.setattr(files.os, "lstat", swap_after_the_check)
    with pytest.raises(FileReplacedError, match="replaced as it was published"):
        files.publish(tmp, tmp_path / "out.npy", ident, overwrite=overwrite)
    monkeypatch.undo()
    assert (Path(f"{tmp}.replaced")).read_text() == "someone else's"
    assert not (tmp_path / "out.npy").exists()



@pytest.mark.parametrize("when", ["before the check", "between the check and the rename"])
def test_a_temporary_file_moved_away_is_refused_not_missing(tmp_path, monkeypatch, when):
    # A neighbour's rename caught before they plant anything: the same refusal as a swap
    # (the jobs' exit 4), not a bare FileNotFoundError (exit 1).
    tmp, ident = _made(tmp_path, ".out.npy.partial")
    if when == "before the check":
        os.rename(tmp, tmp_path / "moved away")
    else:
        real_lstat = os.lstat

        def move_after_the_check(path, *args, **kwargs):
            st = real_lstat(path, *args, **kwargs)
            if os.fspath(path) == os.fspath(tmp):
                os.rename(tmp, tmp_path / "moved away")
            return st

        monkeypatch.setattr(files.os, "lstat", move_after_the_check)
    with pytest.raises(FileReplacedError, match="nothing was published"):
        files.publish(tmp, tmp_path / "out.npy", ident, overwrite=False)
    monkeypatch.undo()
    assert not (tmp_path / "out.npy").exists()
    assert (tmp_path / "moved away").read_bytes() == b"result"

def test_a_temporary_file_replaced_by_another_file_is_refused(tmp_path):
    # (Moved away rather than removed: a removed file's inode number may go to the next new
    # file at once; the key's owner tells another user's file apart then.)
    tmp, ident = _made(tmp_path)
    os.replace(tmp, tmp_path / "moved away")
    tmp.write_text("someone else's")
    with pytest.raises(FileReplacedError, match="replaced"):
        files.open_same(tmp, ident)


def test_check_unchanged_names_the_input_and_what_happened(tmp_path):
    path = tmp_path / "a.npy"
    path.write_bytes(b"x" * 100)
    pinned = files.identity(path)
    files.check_unchanged(path, pinned)
    os.utime(path, ns=(pinned.mtime_ns + 10**9, pinned.mtime_ns + 10**9))
    with pytest.raises(InputChangedError, match="a.npy was modified"):
        files.check_unchanged(path, pinned)
    os.unlink(path)
    path.write_bytes(b"y" * 100)
    with pytest.raises(InputChangedError, match="replaced by another file|modified"):
        files.check_unchanged(path, pinned)
    os.unlink(path)
    with pytest.raises(InputChangedError, match="removed"):
        files.check_unchanged(path, pinned)


# ---- through from_npy and to_npy -------------------------------------------------------------


def _touch_later(path):
    def touch(block):
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        return block
    return touch


def test_an_input_modified_after_it_was_read_is_caught_before_publishing(rng, tmp_path):
    a = rng.random((50, 7))
    np.save(tmp_path / "a.npy", a)
    x = dg.from_npy(tmp_path / "a.npy", chunks=-1)  # one read, before the change
    y = x.map_blocks(_touch_later(tmp_path / "a.npy"), dtype=x.dtype, meta=x._meta)
    with pytest.raises(InputChangedError, match="a.npy was modified"):
        dg.to_npy(y * 2, tmp_path / "c.npy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npy"]  # nothing written or left


def test_a_reading_task_refuses_an_input_replaced_since_the_graph_was_built(rng, tmp_path):
    a = rng.random((40, 3))
    np.save(tmp_path / "a.npy", a)
    x = dg.from_npy(tmp_path / "a.npy", chunks=(10, 3))
    os.replace(tmp_path / "a.npy", tmp_path / "old.npy")
    np.save(tmp_path / "a.npy", a + 1)  # same size, another file
    with pytest.raises(InputChangedError, match="replaced by another file"):
        x.compute(scheduler="sync")


def test_a_target_that_appears_during_the_job_is_kept(rng, tmp_path):
    target = tmp_path / "c.npy"

    def another_job_finishes_first(block):
        if not target.exists():
            np.save(target, np.zeros(3))
        return block

    x = da.from_array(rng.random((20, 4)), chunks=(5, 4))
    with pytest.raises(FileExistsError, match="not replaced"):
        dg.to_npy(x.map_blocks(another_job_finishes_first, dtype=x.dtype, meta=x._meta), target)
    np.testing.assert_array_equal(np.load(target), np.zeros(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npy"]


@pytest.mark.parametrize("chunks", [(-3, 4), (0, 4), (5, -2)])
def test_from_npy_refuses_chunks_that_do_not_tile_the_file(rng, tmp_path, chunks):
    np.save(tmp_path / "a.npy", rng.random((10, 4)))
    with pytest.raises(ValueError, match="chunks="):
        dg.from_npy(tmp_path / "a.npy", chunks=chunks)


def test_to_npy_keeps_the_mode_of_the_file_it_overwrites(rng, tmp_path):
    target = tmp_path / "c.npy"
    np.save(target, np.zeros(2))
    os.chmod(target, 0o600)
    dg.to_npy(da.ones(4, chunks=2), target, overwrite=True)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    np.testing.assert_array_equal(np.load(target), np.ones(4))
