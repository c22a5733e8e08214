"""Fault tests on the real local Ray cluster: the aggregator actor killed mid-stream (Ray restarts it and
retries the call in flight; the engine's channel re-sends what was not acknowledged), and a rank actor killed
under a real engine (its group's ranks are named missing at once, the other group keeps serving)."""

import asyncio
import time

import pytest
import ray

from aggregator import get_or_create_aggregator
from aggregator.delta import KV_STATS
from tests.aggregator_support import FakeCluster
from workers.stats_channel import StatsChannel

pytestmark = pytest.mark.ray


def test_aggregator_killed_mid_stream_loses_and_doubles_nothing(ray_cluster):
    cluster = FakeCluster(2, 2, seed=7)
    agg = get_or_create_aggregator("t-agg-kill", world_size=4, tp=2)

    async def run() -> StatsChannel:
        channel = StatsChannel(agg)
        await channel.register(cluster.layouts)
        for i in range(60):
            channel.put(cluster.iteration(i))
            if i == 30:
                ray.kill(agg, no_restart=False)  # mid-stream, calls in flight
            await asyncio.sleep(0.002)
        await asyncio.wait_for(channel.drained(), 60)
        return channel

    channel = asyncio.run(run())
    health = ray.get(agg.health.remote())
    assert health["epoch"] == 2 and health["last_iter"] == 59 and channel.epoch == 2
    recs = ray.get(agg.query.remote(-1))
    iters = [r["iter"] for r in recs]
    assert iters == list(range(iters[0], 60))  # the new epoch's records: contiguous, none twice
    assert all(r["aggregatorEpoch"] == 2 and r["complete"] for r in recs)
    truth = {k: sum(r.kv[KV_STATS.index(k)] for r in cluster.ranks if r.layout.tp_rank == 0)
             for k in ("allocTotalBlocks", "reusedBlocks", "missedBlocks")}
    stats = ray.get(agg.kv_cache_stats.remote())
    assert {k: stats[k] for k in truth} == truth  # every delta counted exactly once across the restart
    ray.kill(agg, no_restart=True)


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["compiled_graph", "actor_calls"])
def test_a_killed_rank_is_named_missing_at_once_and_the_other_group_serves(ray_cluster, transport):
    from deployment.settings import Settings
    from workers.engine import Engine, EngineError
    from workers.sampling import SamplingParams

    async def main():
        eng = Engine(Settings(model="random", engine_id=f"t-rank-kill-{transport}", dp=2, tp=1, device="cpu",
                              max_seq_len=128, kv_cache_bytes=256 << 10, host_cache_bytes=0, step_transport=transport))
        await eng.start()
        try:
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

            async def one(i):
                return [ev.token_id async for ev in eng.generate(None, [1, 2, 3, i + 4], params)]

            assert len(await one(0)) == 4
            ray.kill(eng.workers[1], no_restart=True)
            outs = await asyncio.gather(*[one(i) for i in range(4)], return_exceptions=True)
            assert any(isinstance(o, EngineError) for o in outs) or eng._groups[1].down
            assert await one(9) and (await eng.health())["down_groups"] == {"1": eng._groups[1].down}
            await asyncio.wait_for(eng.stats.drained(), 30)
            return eng.iteration - 1, eng.aggregator
        finally:
            await eng.shutdown()

    t0 = time.monotonic()
    last, agg = asyncio.run(main())
    recs = ray.get(agg.query.remote(-1))
    down = [r for r in recs if r["missingRanks"]]
    assert down and all(r["missingRanks"] == [1] and not r["complete"] for r in down)
    assert recs[-1]["iter"] >= last - 1 and time.monotonic() - t0 < 120
    ranks = ray.get(agg.ranks.remote())
    assert ranks["0"]["healthy"] and not ranks["1"]["healthy"]
    ray.kill(agg, no_restart=True)
