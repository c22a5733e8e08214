"""The fleet's engine ids under autoscaling (engine/registry.py), without Ray: the lease rule, a restarted
replica keeping its id, a draining one keeping its own, gone ids free again once their aggregator is removed,
dead holders swept, the counters of gone engines kept."""

import asyncio

import pytest

from engine import registry
from engine.registry import EngineRegistryImpl, Lease, choose


def test_a_replica_gets_its_ranks_id_when_free_else_the_lowest_free_one():
    leases = {"e-0": Lease("r0"), "e-1": Lease("r1")}
    assert choose(leases, "e", 2, "r2", {"r0", "r1"}) == "e-2"
    # after a scale-down Serve gave the live replica r1 another rank: a new replica of rank 1 must not take e-1
    assert choose(leases, "e", 1, "r3", {"r0", "r1"}) == "e-2"
    # r1 died: its successor (Serve restarts it with the same rank) takes its id over, and with it its ranks
    assert choose(leases, "e", 1, "r4", {"r0"}) == "e-1"
    assert choose(leases, "e", 0, "r0", {"r0", "r1"}) == "e-0"  # a replica asking again


def test_a_gone_id_is_free_again_only_once_its_aggregator_is_removed():
    leases = {"e-0": Lease("r0"), "e-1": Lease("r1", gone=True, since=100.0)}
    assert choose(leases, "e", 1, "r5", {"r0"}) == "e-2"
    leases["e-1"].aggregator = False
    assert choose(leases, "e", 1, "r5", {"r0"}) == "e-1"


class Registry(EngineRegistryImpl):
    """The registry with the holders' liveness and the clock in the test's hands, and no removal in Ray."""

    def __init__(self) -> None:
        super().__init__("e", retention_s=600, store=False)
        self.alive: set[str] = set()
        self.removed: list[str] = []

    def _alive(self, holder: str) -> bool:
        return holder in self.alive

    def _sweeping(self) -> None:
        pass

    async def _remove(self, eid: str, lease: Lease) -> None:
        lease.final = {"allocTotalBlocks": 10 * len(self.removed) + 7, "reusedBlocks": 1}
        lease.aggregator = False
        self.removed.append(eid)


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(registry.time, "time", lambda: now[0])
    return now


def test_release_marks_gone_and_the_aggregator_goes_after_the_grace(clock):
    async def main():
        r = Registry()
        r.alive = {"a", "b"}
        assert [await r.claim(0, "a"), await r.claim(1, "b")] == ["e-0", "e-1"]
        await r.release("e-1", "someone else")  # only its holder releases an id
        assert not (await r.engines())["engines"]["e-1"]["gone"]
        await r.release("e-1", "b")
        table = (await r.engines())["engines"]
        assert table["e-1"]["gone"] and table["e-1"]["aggregator"] and not r.removed
        clock[0] += registry.GONE_GRACE_S
        got = await r.engines()
        assert not got["engines"]["e-1"]["aggregator"] and r.removed == ["e-1"]
        assert got["engines"]["e-1"]["final"] == {"allocTotalBlocks": 7, "reusedBlocks": 1} and got["retired"] == {}
        clock[0] += 600
        got = await r.engines()
        assert set(got["engines"]) == {"e-0"} and got["retired"] == {"allocTotalBlocks": 7, "reusedBlocks": 1}

    asyncio.run(main())


def test_a_gone_id_leased_again_retires_its_counters(clock):
    async def main():
        r = Registry()
        r.alive = {"a"}
        await r.claim(0, "a")
        await r.release("e-0", "a")
        clock[0] += registry.GONE_GRACE_S
        await r.engines()
        r.alive = {"c"}
        assert await r.claim(0, "c") == "e-0"  # its aggregator is gone: the id is free
        got = await r.engines()
        assert not got["engines"]["e-0"]["gone"] and got["retired"] == {"allocTotalBlocks": 7, "reusedBlocks": 1}

    asyncio.run(main())


def test_a_dead_holder_that_no_replica_replaces_is_swept_as_gone(clock):
    async def main():
        r = Registry()
        r.alive = {"a"}
        await r.claim(0, "a")
        r.alive = set()  # died; Serve scaled it away instead of restarting it
        assert not (await r.engines())["engines"]["e-0"]["gone"]
        clock[0] += registry.DEAD_GRACE_S
        assert (await r.engines())["engines"]["e-0"]["gone"]
        clock[0] += registry.GONE_GRACE_S
        await r.engines()
        assert r.removed == ["e-0"]  # its leftovers (ranks, aggregator) removed

    asyncio.run(main())


def test_a_fixed_fleets_engine_disowns_its_id_so_the_sweep_leaves_its_actors_alone(clock):
    async def main():
        r = Registry()
        r.alive = {"a"}
        await r.claim(0, "a")
        await r.release("e-0", "a")  # the autoscaled app was deleted
        await r.disown("e-0")  # a fixed fleet's engine e-0 starts before the registry removed e-0's aggregator
        clock[0] += registry.GONE_GRACE_S
        assert (await r.engines())["engines"] == {} and r.removed == []

    asyncio.run(main())
