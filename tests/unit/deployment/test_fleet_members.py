"""An ingress's fleet view under autoscaling (deployment/ingress/stats/fleet.py `FleetStats.apply`), over
in-memory aggregators: an engine that joins is mirrored at once; one that is gone stays readable, keeps its
counters in the fleet's sums, leaves /metrics and the engines up; once forgotten its counters stay retired."""

import asyncio

from deployment.ingress.stats.fleet import FleetStats
from tests.support.http_support import FakeStats

LIVE = {"gone": False, "aggregator": True, "since": 0.0, "final": None}
GONE = {"gone": True, "aggregator": True, "since": 0.0, "final": None}


def removed(final: dict | None = None) -> dict:
    return {"gone": True, "aggregator": False, "since": 0.0, "final": final}


def answer(retired: dict | None = None, **engines: dict) -> dict:
    """What the registry's `engines()` answers (ids with `-` spelled `_` here)."""
    return {"engines": {eid.replace("_", "-"): lease for eid, lease in engines.items()}, "retired": retired or {}}


def test_engines_join_leave_and_are_forgotten_with_their_counters_kept():
    async def main():
        fakes = {eid: FakeStats(eid) for eid in ("e-0", "e-1")}
        fleet = FleetStats.over({}, dynamic=True, keepalive_s=0.3)
        assert fleet.single is None  # a fleet of one under autoscaling keeps the fleet's shape
        fleet.apply(answer(e_0=LIVE), fakes.get)
        fakes["e-0"].add(4, 1)
        fleet.apply(answer(e_0=LIVE, e_1=LIVE), fakes.get)  # a scale-up
        fakes["e-1"].add(6, 2)
        await asyncio.sleep(0.1)  # the mirrors follow at once, readers or not
        assert [len(fleet.mirrors[e].entries(-1, None)) for e in ("e-0", "e-1")] == [1, 1]

        fleet.apply(answer(e_0=LIVE, e_1=GONE), fakes.get)  # scaled down
        fakes["e-1"].add(2, 0)  # its last record, read before its aggregator is removed
        await asyncio.sleep(0.1)
        final = {"allocTotalBlocks": 8, "allocNewBlocks": 0, "reusedBlocks": 2, "missedBlocks": 6}
        fleet.apply(answer(e_0=LIVE, e_1=removed(final)), fakes.get)
        assert fleet.mirrors["e-1"].frozen
        kv = await fleet.kv_cache_stats()
        assert kv["gone"] == ["e-1"] and kv["engines"]["e-1"]["allocTotalBlocks"] == 8
        assert kv["fleet"]["allocTotalBlocks"] == 12 and kv["fleet"]["reusedBlocks"] == 3  # gone ones counted
        health = await fleet.engines_health(1.0)
        assert health["e-0"]["up"] and health["e-1"] == {**health["e-1"], "up": False, "gone": True}
        assert set(await fleet.ranks()) == {"e-0"}  # a gone engine has no ranks
        text = await fleet.metrics_text()
        assert 'engine="e-0"' in text and 'engine="e-1"' not in text  # a gone engine's series stop
        assert "kvfleet_fleet_kv_cache_alloc_total_blocks_total 12" in text
        assert [r["iter"] for r in await fleet.records({}, None)] == [0, 0, 1]  # still readable

        fleet.apply(answer(retired=final, e_0=LIVE), fakes.get)  # the registry forgot it: its counters retired
        assert fleet.ids == ["e-0"]
        kv = await fleet.kv_cache_stats()
        assert kv["fleet"]["allocTotalBlocks"] == 12 and set(kv["engines"]) == {"e-0"}  # the sum never goes back
        await fleet.close()

    asyncio.run(main())


def test_an_ingress_that_starts_later_sums_the_same_counters():
    async def main():
        fake = FakeStats("e-0")
        fake.add(4, 1)
        final = {"allocTotalBlocks": 5, "reusedBlocks": 5}
        fleet = FleetStats.over({}, dynamic=True, keepalive_s=0.3)
        fleet.apply(answer(retired={"allocTotalBlocks": 100}, e_0=LIVE, e_1=removed(final)), {"e-0": fake}.get)
        await asyncio.sleep(0.1)
        kv = await fleet.kv_cache_stats()
        assert kv["gone"] == ["e-1"] and kv["fleet"]["allocTotalBlocks"] == 4 + 5 + 100
        assert kv["fleet"]["reusedBlocks"] == 1 + 5
        await fleet.close()

    asyncio.run(main())


def test_a_gone_id_leased_to_a_new_engine_is_followed_afresh():
    async def main():
        old, new = FakeStats("e-0"), FakeStats("e-0")
        fleet = FleetStats.over({}, dynamic=True, keepalive_s=0.3)
        fleet.apply(answer(e_0=LIVE), lambda eid: old)
        old.add(4, 1)
        await asyncio.sleep(0.1)
        fleet.apply(answer(e_0=removed({"allocTotalBlocks": 4})), lambda eid: old)
        new.add(2, 0)  # the new engine's fresh aggregator
        fleet.apply(answer(retired={"allocTotalBlocks": 4}, e_0=LIVE), lambda eid: new)
        assert "e-0" not in fleet.gone and not fleet.mirrors["e-0"].frozen
        await asyncio.sleep(0.1)
        assert [e["record"]["kvCacheStats"]["allocTotalBlocks"] for e in fleet.mirrors["e-0"].entries(-1, None)] == [2]
        assert (await fleet.kv_cache_stats())["fleet"]["allocTotalBlocks"] == 6
        await fleet.close()

    asyncio.run(main())
