"""An ingress's fleet view under autoscaling (deployment/ingress/stats/fleet.py `FleetStats.apply`), over
in-memory aggregators: an engine that joins is mirrored at once; one that is gone stays readable, keeps its
counters in the fleet's sums, leaves /metrics and the engines up; once forgotten its counters stay retired."""

import asyncio

from deployment.ingress.stats.fleet import FleetStats
from tests.support.http_support import FakeStats

LIVE = {"gone": False, "aggregator": True, "since": 0.0}
GONE = {"gone": True, "aggregator": True, "since": 0.0}
REMOVED = {"gone": True, "aggregator": False, "since": 0.0}


def test_engines_join_leave_and_are_forgotten_with_their_counters_kept():
    async def main():
        fakes = {eid: FakeStats(eid) for eid in ("e-0", "e-1")}
        fleet = FleetStats.over({}, dynamic=True, keepalive_s=0.3)
        assert fleet.single is None  # a fleet of one under autoscaling keeps the fleet's shape
        fleet.apply({"e-0": LIVE}, fakes.get, 600, now=0.0)
        fakes["e-0"].add(4, 1)
        fleet.apply({"e-0": LIVE, "e-1": LIVE}, fakes.get, 600, now=1.0)  # a scale-up
        fakes["e-1"].add(6, 2)
        await asyncio.sleep(0.1)  # the mirrors follow at once, readers or not
        assert [len(fleet.mirrors[e].entries(-1, None)) for e in ("e-0", "e-1")] == [1, 1]

        fleet.apply({"e-0": LIVE, "e-1": GONE}, fakes.get, 600, now=2.0)  # scaled down
        fakes["e-1"].add(2, 0)  # its last record, read before its aggregator is removed
        await asyncio.sleep(0.1)
        fleet.apply({"e-0": LIVE, "e-1": REMOVED}, fakes.get, 600, now=12.0)
        assert fleet.mirrors["e-1"].frozen
        kv = await fleet.kv_cache_stats()
        assert kv["gone"] == ["e-1"] and kv["engines"]["e-1"]["allocTotalBlocks"] == 8
        assert kv["fleet"]["allocTotalBlocks"] == 12 and kv["fleet"]["reusedBlocks"] == 3  # gone ones counted
        health = await fleet.engines_health(1.0)
        assert health["e-0"]["up"] and health["e-1"] == {**health["e-1"], "up": False, "gone": True}
        text = await fleet.metrics_text()
        assert 'engine="e-0"' in text and 'engine="e-1"' not in text  # a gone engine's series stop
        assert [r["iter"] for r in await fleet.records({}, None)] == [0, 0, 1]  # still readable

        fleet.apply({"e-0": LIVE}, fakes.get, 600, now=602.0)  # retention passed (and the registry forgot it)
        assert fleet.ids == ["e-0"] and fleet.retired["allocTotalBlocks"] == 8
        kv = await fleet.kv_cache_stats()
        assert kv["fleet"]["allocTotalBlocks"] == 12 and set(kv["engines"]) == {"e-0"}  # the sum never goes back
        await fleet.close()

    asyncio.run(main())


def test_a_gone_id_leased_to_a_new_engine_is_followed_afresh():
    async def main():
        old = FakeStats("e-0")
        fleet = FleetStats.over({}, dynamic=True, keepalive_s=0.3)
        fleet.apply({"e-0": LIVE}, lambda eid: old, 600, now=0.0)
        old.add(4, 1)
        await asyncio.sleep(0.1)
        fleet.apply({"e-0": REMOVED}, lambda eid: old, 600, now=1.0)
        old.restart()  # the new engine's fresh aggregator: another history
        old.add(2, 0)
        fleet.apply({"e-0": LIVE}, lambda eid: old, 600, now=700.0)
        assert "e-0" not in fleet.gone and not fleet.mirrors["e-0"].frozen
        for _ in range(100):
            got = fleet.mirrors["e-0"].entries(-1, None)
            if got and got[-1]["record"]["kvCacheStats"]["allocTotalBlocks"] == 2:
                break
            await asyncio.sleep(0.05)  # poll: the mirror resyncs on its next call
        assert [e["record"]["kvCacheStats"]["allocTotalBlocks"] for e in fleet.mirrors["e-0"].entries(-1, None)] == [2]
        await fleet.close()

    asyncio.run(main())
