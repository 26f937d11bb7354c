"""The compile memo: once per key and process, keys side by side."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dask_gpuchunk._kernels.compiled import compiled_once


def test_a_key_is_made_once_while_many_threads_ask_for_it():
    calls = []

    @compiled_once
    def slow_square(n):
        calls.append(n)
        time.sleep(0.05)
        return n * n

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: slow_square(7), range(16)))
    assert results == [49] * 16 and calls == [7]
    assert slow_square.made == {(7,): 49}


def test_another_key_is_made_while_a_slow_one_compiles():
    started, release = threading.Event(), threading.Event()

    @compiled_once
    def kernel(name):
        if name == "slow":
            started.set()
            assert release.wait(10)
        return name.upper()

    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(kernel, "slow")
        assert started.wait(10)
        # A lock for every key would make this wait for "slow", which waits for this.
        assert pool.submit(kernel, "quick").result(timeout=5) == "QUICK"
        release.set()
        assert slow.result(timeout=10) == "SLOW"
