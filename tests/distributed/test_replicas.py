"""The active memory manager's ReduceReplicas, keeping resident sources' replicas."""

from __future__ import annotations

import dask
import pytest

import dask_gpuchunk as dg
from dask_gpuchunk.distributed.replicas import (REDUCE_REPLICAS, ReduceReplicasKeepingSources,
                                    policies_keeping_sources)
from dask_gpuchunk.runtime.resident import SOURCE_KEY_PREFIX, source_tasks


class _State:
    """A stand-in for the scheduler's task and worker states: attributes, hashed by identity."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)


def _manager_with(*tasks):
    return _State(scheduler=_State(replicated_tasks=set(tasks)), pending={})


def _task(key, holders, waiting_on=()):
    return _State(key=key, who_has=set(holders),
                  waiters={_State(processing_on=w) for w in waiting_on})


def _drops(policy):
    return sorted(str(suggestion[1].key) for suggestion in policy.run()
                  if suggestion[0] == "drop")


def test_a_source_is_never_dropped_where_distributed_would_drop_it():
    from distributed.active_memory_manager import ReduceReplicas

    _, source_key = source_tasks("a reader", "x-1234")
    assert source_key.startswith(SOURCE_KEY_PREFIX)
    # Two replicas each, the one waiter running on one holder: distributed drops the other.
    tasks = [_task(source_key, ["w0", "w1"], ["w1"]), _task("block-7", ["w0", "w1"], ["w1"]),
             _task(("chunk", 3), ["w0", "w1", "w2"])]
    plain, keeping = ReduceReplicas(), ReduceReplicasKeepingSources()
    plain.manager = keeping.manager = _manager_with(*tasks)
    chunk = str(("chunk", 3))
    assert _drops(plain) == sorted([source_key, "block-7", chunk, chunk])
    assert _drops(keeping) == sorted(["block-7", chunk, chunk])


def test_policies_keep_the_callers_other_policies():
    policies = [{"class": "my.Policy", "n": 2}, {"class": REDUCE_REPLICAS}]
    assert policies_keeping_sources(policies) == [
        {"class": "my.Policy", "n": 2},
        {"class": "dask_gpuchunk.distributed.replicas.ReduceReplicasKeepingSources"}]
    assert policies_keeping_sources([]) == []


def _policy_classes(dask_scheduler):
    return [type(p).__name__ for p in dask_scheduler.extensions["amm"].policies]


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_local_cluster_keeps_sources_and_only_while_it_starts():
    key = "distributed.scheduler.active-memory-manager.policies"
    before = dask.config.get(key)
    with dg.local_cluster(processes=False, dashboard_address=None) as client:
        assert client.run_on_scheduler(_policy_classes) == ["ReduceReplicasKeepingSources"]
    assert dask.config.get(key) == before
