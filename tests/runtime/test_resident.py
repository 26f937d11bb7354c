"""``dask_gpuchunk.runtime.resident``: chunks read once per process and kept while they fit."""

from __future__ import annotations

import pickle
import threading
import time
import weakref

import numpy as np
import pytest
from dask.base import tokenize

from dask_gpuchunk.runtime import resident
from dask_gpuchunk.runtime.resident import ResidentChunks, ResidentSource, resident_stats
from dask_gpuchunk import config


def test_chunks_are_kept_least_recently_used_first_out():
    reads = []

    def reader(name, nbytes=8):
        return lambda: reads.append(name) or np.full(nbytes, len(reads), np.uint8)

    cache = ResidentChunks(lambda cache: 24)
    a = cache.get("a", reader("a"))
    cache.get("b", reader("b"))
    assert cache.get("a", reader("a again")) is a  # kept: "a" is now the most recent
    cache.get("c", reader("c"))
    cache.get("d", reader("d"))  # 32 bytes > 24: "b", the least recently used, goes
    assert sorted(cache.keys()) == ["a", "c", "d"] and cache.nbytes == 24
    big = cache.get("big", reader("big", 40))  # more than the limit: returned, never kept
    assert big.nbytes == 40 and "big" not in cache.keys()
    assert reads == ["a", "b", "c", "d", "big"]
    assert cache.stats == {"reads": 5, "read_ahead": 0, "hits": 1, "bytes_read": 72, "dropped": 1}
    cache.clear()
    assert cache.keys() == [] and cache.nbytes == 0


def test_threads_that_need_the_same_chunk_read_it_once():
    cache = ResidentChunks(lambda cache: 1 << 20)
    calls = []

    def slow_read():
        calls.append(1)
        time.sleep(0.2)
        return np.arange(10)

    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.get("x", slow_read)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 4 and all(g is got[0] for g in got)


def test_a_failed_read_is_not_kept_and_the_next_get_reads_again():
    cache = ResidentChunks(lambda cache: 1 << 20)

    def broken():
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        cache.get("x", broken)
    np.testing.assert_array_equal(cache.get("x", lambda: np.ones(3)), np.ones(3))


class CountingReader:
    """Rows of an array, each read logged."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows, self.reads = rows, []

    def __getitem__(self, region):
        self.reads.append(region[0])
        return self.rows[region].copy()


def test_a_source_reads_rows_once_and_drops_them_with_itself():
    rows = np.arange(60, dtype=np.uint64).reshape(20, 3)
    reader = CountingReader(rows)
    reads = reader.reads
    before = resident_stats()["host"]
    source = ResidentSource(reader, "twenty rows")
    first = source.rows(5, 9, on_gpu=False)
    np.testing.assert_array_equal(first, rows[5:9])
    assert source.rows(5, 9, on_gpu=False) is first
    np.testing.assert_array_equal(source.rows(0, 5, on_gpu=False), rows[:5])
    assert reads == [slice(5, 9), slice(0, 5)]
    now = resident_stats()["host"]
    assert now["reads"] - before["reads"] == 2 and now["hits"] - before["hits"] == 1
    assert now["nbytes"] >= 9 * 3 * 8
    # Pickled (sent to a worker) without what it keeps; named by its reader's content.
    copy = pickle.loads(pickle.dumps(source))
    assert copy.token == "twenty rows" and tokenize(copy) == tokenize(source)
    del source, first
    assert resident_stats()["host"]["nbytes"] == 0
    np.testing.assert_array_equal(copy.rows(5, 9, on_gpu=False), rows[5:9])
    assert copy.reader.reads == [slice(5, 9), slice(0, 5), slice(5, 9)]  # its own reader copy


def test_sources_of_one_place_share_its_limit(monkeypatch):
    monkeypatch.setattr(resident, "_host_limit", lambda: 100)
    rows = np.zeros((10, 8), np.uint8)  # 8 bytes a row
    first, second = ResidentSource(rows, "first"), ResidentSource(rows, "second")
    first.rows(0, 10, on_gpu=False)  # 80 bytes kept
    second.rows(0, 5, on_gpu=False)  # 40 more: over 100 with the first's, not kept
    assert resident_stats()["host"]["nbytes"] == 80
    del first
    second.rows(0, 5, on_gpu=False)
    assert resident_stats()["host"]["nbytes"] == 40


def test_kept_device_chunks_are_dropped_when_a_chunk_runs_out_of_memory(monkeypatch):
    # budget.run_reserved calls its hooks before it runs an out-of-memory chunk again alone.
    from dask_gpuchunk.runtime import budget

    monkeypatch.setattr(resident, "_device_limit", lambda: 1 << 20)
    on_device, on_host = resident._cache_for(7), ResidentSource(np.ones((4, 4)), "host rows")
    on_device.get("rows", lambda: np.zeros(100, np.uint8))
    on_host.rows(0, 2, on_gpu=False)
    assert resident._drop_device_chunks in budget.out_of_memory_hooks
    for drop in budget.out_of_memory_hooks:
        drop()
    assert on_device.nbytes == 0 and resident_stats()["host"]["nbytes"] == 2 * 4 * 8


def _join_read_ahead(source, place="host"):
    thread = source._reading_ahead.get(place)
    assert thread is not None, "no read-ahead started"
    thread.join(10)
    assert not thread.is_alive()


def test_a_source_reads_ahead_what_its_blocks_will_ask_for_on_its_own_thread():
    rows = np.arange(200, dtype=np.uint64).reshape(40, 5)
    reader = CountingReader(rows)
    bounds = [(0, 10), (10, 20), (20, 30), (30, 40)]
    source = ResidentSource(reader, "forty rows", read_ahead=bounds)
    np.testing.assert_array_equal(source.rows(10, 20, on_gpu=False), rows[10:20])
    _join_read_ahead(source)
    assert sorted(reader.reads, key=lambda s: s.start) == [slice(a, b) for a, b in bounds]
    # The block's own chunk first, in its thread; then from the next one round.
    assert reader.reads == [slice(10, 20), slice(20, 30), slice(30, 40), slice(0, 10)]
    assert resident_stats()["host"]["read_ahead"] >= 3
    hits = resident_stats()["host"]["hits"]
    for a, b in bounds:  # all kept: no block waits on the reader again
        np.testing.assert_array_equal(source.rows(a, b, on_gpu=False), rows[a:b])
    assert len(reader.reads) == 4 and resident_stats()["host"]["hits"] - hits == 4
    # Sent to a worker with its read-ahead; the copy reads ahead on its own.
    copy = pickle.loads(pickle.dumps(source))
    assert copy.read_ahead == tuple(bounds)
    copy.rows(0, 10, on_gpu=False)
    _join_read_ahead(copy)
    assert len(copy.reader.reads) == 8


def test_a_read_ahead_drops_nothing_and_stops_where_the_limit_is(monkeypatch):
    monkeypatch.setattr(resident, "_host_limit", lambda: 2 * 10 * 5 * 8)  # two chunks
    rows = np.arange(200, dtype=np.uint64).reshape(40, 5)
    reader = CountingReader(rows)
    dropped = resident_stats()["host"]["dropped"]
    source = ResidentSource(reader, "forty rows, room for two",
                            read_ahead=[(0, 10), (10, 20), (20, 30), (30, 40)])
    source.rows(20, 30, on_gpu=False)
    _join_read_ahead(source)
    # From the chunk after the one asked for, round to the one before; no room after one.
    assert reader.reads == [slice(20, 30), slice(30, 40)]
    assert resident_stats()["host"]["dropped"] == dropped
    np.testing.assert_array_equal(source.rows(0, 10, on_gpu=False), rows[0:10])


def test_a_read_ahead_stops_when_the_cache_is_cleared_or_a_read_fails():
    gate = threading.Event()

    class GatedReader(CountingReader):
        def __getitem__(self, region):
            if region[0].start == 10:
                gate.wait(10)  # the read-ahead's first chunk: the cache is cleared meanwhile
            if region[0].start == 30:
                raise OSError("disk gone")
            return super().__getitem__(region)

    rows = np.arange(200, dtype=np.uint64).reshape(40, 5)
    bounds = [(0, 10), (10, 20), (20, 30), (30, 40)]
    cleared = ResidentSource(GatedReader(rows), "cleared", read_ahead=bounds)
    cleared.rows(0, 10, on_gpu=False)
    cleared._caches["host"].clear()
    gate.set()
    _join_read_ahead(cleared)
    assert cleared.reader.reads == [slice(0, 10), slice(10, 20)]  # none after the clear

    failing = ResidentSource(GatedReader(rows), "failing", read_ahead=bounds[::-1])
    failing.rows(0, 10, on_gpu=False)
    _join_read_ahead(failing)
    assert failing.reader.reads == [slice(0, 10)]  # (30, 40) failed first: nothing after it
    with pytest.raises(OSError, match="disk gone"):  # the block that needs it raises itself
        failing.rows(30, 40, on_gpu=False)


def test_a_read_ahead_does_not_keep_its_source_alive():
    import gc
    import weakref

    gate = threading.Event()

    class SlowReader(CountingReader):
        def __getitem__(self, region):
            if region[0].start:
                gate.wait(10)
            return super().__getitem__(region)

    rows = np.arange(200, dtype=np.uint64).reshape(40, 5)
    source = ResidentSource(SlowReader(rows), "slow",
                            read_ahead=[(0, 10), (10, 20), (20, 30), (30, 40)])
    source.rows(0, 10, on_gpu=False)
    thread, gone = source._reading_ahead["host"], weakref.ref(source)
    del source
    gc.collect()
    assert gone() is None  # while its read-ahead still waits on the file
    gate.set()
    thread.join(10)
    assert not thread.is_alive()


def test_source_tasks_read_ahead_only_where_the_setting_is_on():
    import dask

    entries, key = resident.source_tasks("a reader", "t", read_ahead=[(0, 2), (2, 4)])
    assert entries[key][3] == ((0, 2), (2, 4))
    with config.internal_values({"read-ahead": "false"}):
        entries, key = resident.source_tasks("a reader", "t", read_ahead=[(0, 2), (2, 4)])
    assert len(entries[key]) == 3  # (ResidentSource, reader key, token): no read-ahead
    with config.internal_values({"read-ahead": "sometimes"}), \
            pytest.raises(ValueError, match="read-ahead"):
        resident.source_tasks("a reader", "t", read_ahead=[(0, 2)])


def test_a_read_ahead_reads_in_order_and_stops_at_the_first_chunk_that_does_not_fit():
    cache = ResidentChunks(lambda cache: 10)
    reads = []

    def reading(key):
        def read():
            reads.append(key)
            return np.full(4, key, np.uint8)
        return read

    chunks = [(k, 4, reading(k)) for k in range(4)]
    resident._read_ahead(weakref.ref(cache), chunks, None)
    assert reads == [0, 1]  # the third would need a chunk dropped
    assert sorted(cache.keys()) == [0, 1]
    np.testing.assert_array_equal(cache.get(1, lambda: None), np.full(4, 1, np.uint8))


def test_a_reader_that_knows_its_row_size_starts_the_read_ahead_before_its_first_read():
    started = threading.Event()

    class SizedReader(CountingReader):
        row_nbytes = 5 * 8

        def __getitem__(self, region):
            if region[0].start == 0:  # the block's own chunk waits for the read-ahead's
                assert started.wait(10), "the read-ahead did not start first"
            else:
                started.set()
            return super().__getitem__(region)

    rows = np.arange(200, dtype=np.uint64).reshape(40, 5)
    source = ResidentSource(SizedReader(rows), "sized", read_ahead=[(0, 10), (10, 20), (20, 30)])
    np.testing.assert_array_equal(source.rows(0, 10, on_gpu=False), rows[:10])
    _join_read_ahead(source)
    assert sorted(source.reader.reads, key=lambda s: s.start) == [
        slice(0, 10), slice(10, 20), slice(20, 30)]
