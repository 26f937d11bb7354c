"""``dask_gpuchunk.peer_chunks``: each chunk read from the host once per node, the node's other
processes handed it (CUDA IPC on a GPU; here, on the CPU, a transport through files)."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import dask_gpuchunk as dg
from dask_gpuchunk import peer_chunks
from dask_gpuchunk.peer_chunks import chunk_checksum, peer_stats, read_once_per_node, unpublish
from dask_gpuchunk.resident import ResidentSource


class FileTransport:
    """Chunks handed over as files (what CUDA IPC does between GPUs, done with the CPU's
    means): ``export`` saves the chunk, ``fetch`` loads it and checks its checksum."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def export(self, chunk):
        path = self.directory / f"{uuid.uuid4().hex}.npy"
        np.save(path, chunk)
        return {"path": str(path), "checksum": chunk_checksum(chunk)}

    def fetch(self, ticket):
        try:
            chunk = np.load(ticket["path"])
        except OSError:
            return None
        return chunk if chunk_checksum(chunk) == ticket["checksum"] else None


class Refusing:
    """A process that cannot share (an export refused)."""

    def export(self, chunk):
        return None

    def fetch(self, ticket):
        return None


def chunk_of(name: str) -> np.ndarray:
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    return rng.integers(0, 2**63, size=(7, 5), dtype=np.int64)


@pytest.fixture
def node(tmp_path):
    (tmp_path / "node").mkdir()
    (tmp_path / "handed").mkdir()
    return tmp_path / "node", FileTransport(tmp_path / "handed")


@pytest.mark.parametrize("dtype", [np.uint8, np.uint32, np.int64, np.float32, np.float64])
def test_a_checksum_tells_a_chunk_from_one_with_a_byte_changed(dtype):
    rng = np.random.default_rng(3)
    for shape in [(13, 7), (1,), (0, 4), (3, 3, 3)]:
        chunk = (rng.random(shape) * 200).astype(dtype)
        assert chunk_checksum(chunk) == chunk_checksum(chunk.copy())
        assert chunk_checksum(np.asfortranarray(chunk)) == chunk_checksum(chunk)
        if chunk.size:
            changed = chunk.copy()
            changed.reshape(-1).view(np.uint8)[-1] ^= 1  # the last byte, past the whole words
            assert chunk_checksum(changed) != chunk_checksum(chunk)
            changed = chunk.copy()
            changed.reshape(-1).view(np.uint8)[0] ^= 0x80
            assert chunk_checksum(changed) != chunk_checksum(chunk)


def _process_of_a_node(directory, handed, names, log, results, barrier):
    transport = FileTransport(handed)
    got, published = {}, set()
    for name in names:
        def read(name=name):
            with open(log, "a") as f:
                f.write(f"{name} {os.getpid()}\n")
            time.sleep(0.05)  # long enough for the others to find the claim and wait
            return chunk_of(name)

        got[name] = read_once_per_node(name, read, transport, published, directory=directory)
    barrier.wait()  # the chunks this process read stay until every process has its copies
    results.put((os.getpid(), {n: c.tolist() for n, c in got.items()}, peer_stats(),
                 sorted(published)))


def test_processes_of_a_node_read_each_chunk_once_and_hand_it_to_the_others(node, tmp_path):
    directory, transport = node
    names = [f"rows-{i}" for i in range(5)]
    context = multiprocessing.get_context("fork")
    results, barrier = context.Queue(), context.Barrier(3)
    log = tmp_path / "reads.log"
    processes = [context.Process(target=_process_of_a_node,
                                 args=(directory, transport.directory,
                                       names[k:] + names[:k], log, results, barrier))
                 for k in (0, 2, 4)]
    for process in processes:
        process.start()
    reports = [results.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    reads = [line.split()[0] for line in log.read_text().splitlines()]
    assert sorted(reads) == names  # each chunk read once on the node
    for _, got, stats, _ in reports:
        for name in names:
            np.testing.assert_array_equal(np.array(got[name]), chunk_of(name))
    received = sum(stats["received"] for _, _, stats, _ in reports)
    assert received == 3 * len(names) - len(names)
    assert sorted(n for *_, published in reports for n in published) == names
    assert all(stats["stale"] == 0 and stats["unshared"] == 0 for _, _, stats, _ in reports)


def _write_ticket(directory, name, ticket):
    (directory / f"{name}.ticket").write_text(json.dumps(ticket))


def test_a_stale_ticket_is_replaced_by_a_new_read(node):
    directory, transport = node
    # Another process's ticket whose chunk is gone (its memory freed, here its file).
    _write_ticket(directory, "stale", {"path": str(transport.directory / "gone.npy"),
                                       "checksum": 1, "pid": os.getppid()})
    (directory / "stale.claim").write_text(str(os.getppid()))
    # And one whose bytes changed since it was published: the checksum tells.
    changed = transport.export(chunk_of("changed"))
    np.save(changed["path"], chunk_of("changed") + 1)
    _write_ticket(directory, "changed", {**changed, "pid": os.getppid()})
    before = peer_stats()
    reads = []
    for name in ("stale", "changed"):
        chunk = read_once_per_node(name, lambda name=name: reads.append(name) or chunk_of(name),
                                   transport, directory=directory)
        np.testing.assert_array_equal(chunk, chunk_of(name))
        assert json.loads((directory / f"{name}.ticket").read_text())["pid"] == os.getpid()
    assert reads == ["stale", "changed"]
    assert peer_stats()["stale"] - before["stale"] == 2


def test_a_ticket_of_another_process_is_taken_without_a_read(node):
    directory, transport = node
    _write_ticket(directory, "kept", {**transport.export(chunk_of("kept")), "pid": os.getppid()})
    chunk = read_once_per_node("kept", lambda: pytest.fail("read again"), transport,
                               directory=directory)
    np.testing.assert_array_equal(chunk, chunk_of("kept"))


def test_this_process_s_own_ticket_means_it_dropped_the_chunk_and_reads_it_again(node):
    directory, transport = node
    _write_ticket(directory, "own", {**transport.export(chunk_of("own")), "pid": os.getpid()})
    reads = []
    chunk = read_once_per_node("own", lambda: reads.append(1) or chunk_of("own"), transport,
                               directory=directory)
    np.testing.assert_array_equal(chunk, chunk_of("own"))
    assert reads == [1]


def test_a_claim_of_a_process_that_is_gone_is_taken_over_at_once(node):
    directory, transport = node
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (directory / "orphan.claim").write_text(str(gone.pid))
    t0 = time.perf_counter()
    chunk = read_once_per_node("orphan", lambda: chunk_of("orphan"), transport,
                               directory=directory, wait_seconds=30)
    assert time.perf_counter() - t0 < 5
    np.testing.assert_array_equal(chunk, chunk_of("orphan"))
    assert (directory / "orphan.claim").read_text() == str(os.getpid())


def test_a_claim_that_is_never_published_is_waited_for_a_while_then_read_here(node):
    directory, transport = node
    (directory / "slow.claim").write_text(str(os.getppid()))  # alive, never publishes
    before = peer_stats()
    t0 = time.perf_counter()
    chunk = read_once_per_node("slow", lambda: chunk_of("slow"), transport,
                               directory=directory, wait_seconds=0.2)
    assert time.perf_counter() - t0 >= 0.2
    np.testing.assert_array_equal(chunk, chunk_of("slow"))
    assert peer_stats()["unshared"] - before["unshared"] == 1
    assert not (directory / "slow.ticket").exists()


def test_a_reader_that_will_not_wait_is_told_the_chunk_is_claimed(node):
    directory, transport = node
    (directory / "taken.claim").write_text(str(os.getppid()))  # alive, reading it
    t0 = time.perf_counter()
    with pytest.raises(peer_chunks.ClaimedElsewhere):
        read_once_per_node("taken", lambda: pytest.fail("read here"), transport,
                           directory=directory, wait=False)
    assert time.perf_counter() - t0 < 1
    assert (directory / "taken.claim").read_text() == str(os.getppid())


def test_a_failed_read_gives_up_its_claim_and_raises(node):
    directory, transport = node

    def broken():
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        read_once_per_node("broken", broken, transport, directory=directory)
    assert not (directory / "broken.claim").exists()
    chunk = read_once_per_node("broken", lambda: chunk_of("broken"), transport,
                               directory=directory)
    np.testing.assert_array_equal(chunk, chunk_of("broken"))


def test_a_process_that_cannot_share_publishes_nothing(node):
    directory, _ = node
    chunk = read_once_per_node("refused", lambda: chunk_of("refused"), Refusing(),
                               directory=directory)
    np.testing.assert_array_equal(chunk, chunk_of("refused"))
    assert list(directory.iterdir()) == []


def test_a_directory_removed_meanwhile_is_made_again(node):
    directory, transport = node
    directory.rmdir()
    chunk = read_once_per_node("again", lambda: chunk_of("again"), transport,
                               directory=directory)
    np.testing.assert_array_equal(chunk, chunk_of("again"))
    assert (directory / "again.ticket").exists()


def test_a_directory_that_cannot_be_written_leaves_each_process_to_read_its_own(node,
                                                                               monkeypatch):
    directory, transport = node

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(peer_chunks.os, "open", refused)
    before = peer_stats()
    chunk = read_once_per_node("locked", lambda: chunk_of("locked"), transport,
                               directory=directory)
    np.testing.assert_array_equal(chunk, chunk_of("locked"))
    assert peer_stats()["unshared"] - before["unshared"] == 1
    assert list(directory.iterdir()) == []


def test_no_directory_to_meet_in_leaves_each_process_to_read_its_own(monkeypatch):
    def refused():
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(peer_chunks, "node_directory", refused)
    chunk = read_once_per_node("nowhere", lambda: chunk_of("nowhere"), Refusing())
    np.testing.assert_array_equal(chunk, chunk_of("nowhere"))


def test_a_ticket_that_cannot_be_written_gives_up_the_claim(node, monkeypatch):
    directory, transport = node

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    chunk = read_once_per_node("full", lambda: chunk_of("full"), transport,
                               directory=directory)
    np.testing.assert_array_equal(chunk, chunk_of("full"))
    assert list(directory.iterdir()) == []


def test_only_a_directory_of_this_user_that_no_one_else_may_write_is_met_in(tmp_path):
    private = peer_chunks.private_directory(tmp_path / "made")
    assert private.is_dir() and private.stat().st_mode & 0o777 == 0o700
    open_to_all = tmp_path / "open"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o777)
    with pytest.raises(PermissionError, match="others may read or write"):
        peer_chunks.private_directory(open_to_all)
    readable = tmp_path / "readable"  # tickets name GPU memory: 0755 is refused too
    readable.mkdir(mode=0o755)
    readable.chmod(0o755)
    with pytest.raises(PermissionError, match="mode 0o755"):
        peer_chunks.private_directory(readable)
    (tmp_path / "link").symlink_to(private)
    with pytest.raises(PermissionError, match="not a directory"):
        peer_chunks.private_directory(tmp_path / "link")
    if os.getuid() == 0:  # root can make a directory another user owns
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 12345, 12345)
        with pytest.raises(PermissionError, match="belongs to user 12345"):
            peer_chunks.private_directory(theirs)


def test_a_ticket_that_is_not_json_is_not_taken(node):
    directory, transport = node
    (directory / "garbled.ticket").write_bytes(b"\x80\x04not json")
    chunk = read_once_per_node("garbled", lambda: chunk_of("garbled"), transport,
                               directory=directory)
    np.testing.assert_array_equal(chunk, chunk_of("garbled"))


def test_unpublish_removes_this_process_s_tickets_and_claims_only(node):
    directory, transport = node
    published = set()
    read_once_per_node("mine", lambda: chunk_of("mine"), transport, published,
                       directory=directory)
    _write_ticket(directory, "theirs", {"pid": os.getppid()})
    (directory / "theirs.claim").write_text(str(os.getppid()))
    unpublish(published | {"theirs"}, directory=directory)
    assert sorted(p.name for p in directory.iterdir()) == ["theirs.claim", "theirs.ticket"]


def test_a_source_s_tickets_go_with_it_and_are_not_pickled():
    source = ResidentSource(np.ones((4, 2)), f"tickets-{uuid.uuid4().hex}")
    name = f"{source.token}-0-2"
    directory = peer_chunks.node_directory()
    _write_ticket(directory, name, {"pid": os.getpid()})
    (directory / f"{name}.claim").write_text(str(os.getpid()))
    source._published.add(name)
    assert pickle.loads(pickle.dumps(source))._published == set()
    del source
    gc.collect()
    assert not (directory / f"{name}.ticket").exists()
    assert not (directory / f"{name}.claim").exists()


def test_large_chunks_are_shared_unless_the_setting_is_off():
    import dask

    assert peer_chunks.sharing_on(64 << 20)
    assert not peer_chunks.sharing_on((64 << 20) - 1)  # read here: cheaper than a handle
    assert not peer_chunks.sharing_on(None)
    with dask.config.set({"gpuchunk.share-min-bytes": "1 kB"}):
        assert peer_chunks.sharing_on(1000) and not peer_chunks.sharing_on(999)
    with dask.config.set({"gpuchunk.share-reads": False}):
        assert not peer_chunks.sharing_on(1 << 30)
    with dask.config.set({"gpuchunk.share-min-bytes": "lots"}), pytest.raises(ValueError):
        peer_chunks.sharing_on(1 << 30)


# ---- on a GPU --------------------------------------------------------------------------------

_READER_PROCESS = textwrap.dedent("""
    import json, os, sys, time
    devices, rank, path, done = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str((rank + i) % devices)
                                                  for i in range(devices))
    os.environ["DASK_GPUCHUNK__SHARE_MIN_BYTES"] = "0"  # the test's chunks are small
    import numpy as np
    import cupy
    from dask.base import tokenize
    import dask_gpuchunk as dg
    from dask_gpuchunk.backend import staging_totals
    from dask_gpuchunk.io import npy_reader_of
    from dask_gpuchunk.peer_chunks import peer_stats
    from dask_gpuchunk.resident import ResidentSource, row_bounds

    words = np.load(path)
    reader = npy_reader_of(dg.from_npy(path, chunks=(1000, -1)))
    source = ResidentSource(reader, tokenize(reader))
    bounds = row_bounds((1000,) * (len(words) // 1000) + ((len(words) % 1000,) if len(words) % 1000 else ()))
    bounds = bounds[rank:] + bounds[:rank]
    for start, stop in bounds:
        rows = source.rows(start, stop, on_gpu=True)
        assert isinstance(rows, cupy.ndarray) and rows.device.id == 0
        np.testing.assert_array_equal(cupy.asnumpy(rows), words[start:stop])
    open(f"{done}.{rank}", "w").close()
    while len([f for f in os.listdir(os.path.dirname(done)) if f.startswith("done.")]) < 2:
        time.sleep(0.01)  # what this process read stays until the other has its copies
    print(json.dumps({"staged": staging_totals.snapshot(), "peers": peer_stats(),
                      "pci": cupy.cuda.Device(0).pci_bus_id}))
""")


@pytest.mark.gpu
def test_two_processes_on_the_gpus_read_each_chunk_from_the_host_once(tmp_path):
    path = _npy(tmp_path)
    if dg.io.npy_reader_of(dg.from_npy(path, chunks=(1000, -1))) is None:
        pytest.skip("dask's array query planning is on: no reader to take")
    words = np.load(path)
    devices = dg.gpu_count()
    processes = [subprocess.Popen([sys.executable, "-c", _READER_PROCESS, str(devices),
                                   str(rank), str(path), str(tmp_path / "done")],
                                  stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    reports = [json.loads(p.communicate(timeout=300)[0].splitlines()[-1]) for p in processes]
    assert all(p.returncode == 0 for p in processes)
    chunks = -(-len(words) // 1000)
    assert sum(r["peers"]["read"] for r in reports) == chunks
    assert sum(r["peers"]["received"] for r in reports) == chunks
    assert sum(r["staged"]["h2d_bytes"] for r in reports) == words.nbytes
    assert sum(r["staged"]["peer_bytes"] for r in reports) == words.nbytes
    if devices > 1:
        assert reports[0]["pci"] != reports[1]["pci"]


def _npy(tmp_path) -> Path:
    path = tmp_path / "words.npy"
    if not path.exists():
        rng = np.random.default_rng(11)
        np.save(path, rng.integers(0, 256, size=(4500, 257), dtype=np.uint8))
    return path


@pytest.mark.gpu
def test_a_gram_on_every_gpu_of_the_node_reads_its_words_from_the_host_once(tmp_path):
    import dask

    from dask_gpuchunk.jobs import staged_by_workers

    path = tmp_path / "bits.npy"
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 256, size=(3000, 96), dtype=np.uint8)
    np.save(path, bits)
    x = dg.from_npy(path, chunks=(512, -1))
    if dg.io.npy_reader_of(x) is None:
        pytest.skip("dask's array query planning is on: the Gram's words go through dask")
    ones = np.unpackbits(bits, axis=1).astype(np.float64)
    expected = (ones @ ones.T).astype(np.int64)
    # The test's chunks are small: shared all the same (the workers take this process's config).
    with dask.config.set({"gpuchunk.share-min-bytes": 0}), \
            dg.local_cluster(dashboard_address=None) as client:
        before = staged_by_workers(client)
        got = dg.gram(x, packed=True).compute()
        staged = staged_by_workers(client, before)
    np.testing.assert_array_equal(got, expected)
    assert sum(w["h2d_bytes"] for w in staged.values()) == bits.nbytes
    if len(staged) > 1:
        assert sum(w["peer_bytes"] for w in staged.values()) > 0


def test_each_step_of_a_chunks_way_is_logged_with_its_parts(node):
    directory, transport = node
    since = time.time()
    read_once_per_node("logged", lambda: chunk_of("logged"), transport, directory=directory)
    steps = [s for s in peer_chunks.peer_events(since) if s["name"] == "logged"]
    assert [s["kind"] for s in steps] == ["read for the node"]
    step = steps[0]
    assert step["at"] >= since and step["seconds"] >= step["read"] >= 0
    assert step["export"] >= 0 and abs(step["read"] + step["export"] - step["seconds"]) < 1e-5
    assert peer_chunks.peer_events(time.time() + 60) == []
