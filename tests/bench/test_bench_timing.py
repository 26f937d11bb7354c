"""The benches' harness: how a row that cannot be checked, or is wrong, is reported."""

from __future__ import annotations

from dask_gpuchunk.bench.timing import Bench


def test_a_check_that_cannot_run_is_said_and_the_bench_goes_on():
    """A row whose check runs out of memory (a device cap) is reported unchecked, untimed; a
    wrong result is reported as such; the rows after them still run."""
    bench = Bench(2, (), lambda line: None)

    def out_of_memory() -> None:
        raise MemoryError("Out of memory allocating 4,294,967,296 bytes")

    def wrong() -> None:
        raise AssertionError("row 3 differs")

    no_room = bench.timed("t", "ours a", lambda: None, check=out_of_memory)
    bad = bench.timed("t", "ours b", lambda: None, check=wrong)
    fine = bench.timed("t", "ours c", lambda: None, check=lambda: None)
    assert no_room.seconds is None and no_room.skipped == (
        "not checked: MemoryError: Out of memory allocating 4,294,967,296 bytes")
    assert bad.seconds is None and bad.skipped == "WRONG RESULT: row 3 differs"
    assert fine.skipped is None and fine.seconds is not None and fine.seconds >= 0
