"""Fault tests on the real local Ray cluster: the aggregator actor killed mid-stream (Ray restarts it and
retries the call in flight; the engine's channel re-sends what was not acknowledged), and a rank actor killed
under a real engine (its group's ranks are named missing at once, the other group keeps serving)."""

import asyncio
import time

import pytest
import ray

from aggregator import get_or_create_aggregator
from aggregator.delta import KV_STATS
from engine.stats_channel import StatsChannel
from tests.support.aggregator_support import FakeCluster


def test_aggregator_killed_mid_stream_loses_and_doubles_nothing(ray_cluster):
    cluster = FakeCluster(2, 2, seed=7)
    agg = get_or_create_aggregator("t-agg-kill", world_size=4, tp=2)

    async def run() -> StatsChannel:
        channel = StatsChannel(agg)
        await channel.register(cluster.layouts)
        for i in range(60):
            channel.put(cluster.iteration(i))
            if i == 30:
                # some of epoch 1 emitted first (a loaded machine may not have got that far by iteration 30)
                while (await agg.health.remote()).last_iter in (None, *range(10)):
                    await asyncio.sleep(0.01)  # poll interval
                ray.kill(agg, no_restart=False)  # mid-stream, calls in flight
            await asyncio.sleep(0.002)
        await asyncio.wait_for(channel.drained(), 60)
        return channel

    channel = asyncio.run(run())
    health = ray.get(agg.health.remote())
    assert health.epoch == 2 and health.last_iter == 59 and channel.epoch == 2
    recs = ray.get(agg.query.remote(-1))
    iters = [r["iter"] for r in recs]
    assert iters == list(range(60))  # the restored tail and the new epoch's records: no gap, none twice
    epochs = [r["aggregatorEpoch"] for r in recs]
    assert epochs == sorted(epochs) and set(epochs) == {1, 2} and all(r["complete"] for r in recs)
    truth = {k: sum(r.kv[KV_STATS.index(k)] for r in cluster.ranks if r.layout.tp_rank == 0)
             for k in ("allocTotalBlocks", "reusedBlocks", "missedBlocks")}
    stats = ray.get(agg.kv_cache_stats.remote())
    assert {k: stats[k] for k in truth} == truth  # every delta counted exactly once across the restart
    ray.kill(agg, no_restart=True)


@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["compiled_graph", "actor_calls"])
def test_a_rank_killed_mid_generation_is_restarted_and_its_requests_complete(ray_cluster, transport):
    """A real rank actor killed while its group generates: every request completes with the tokens of the run
    without the fault; records name the rank missing at once, then are complete again with a new incarnation."""
    from deployment.settings import Settings
    from engine.core import Engine
    from workers.sampling_params import SamplingParams

    async def main():
        eng = Engine(Settings(model="random", engine_id=f"t-rank-kill-{transport}", dp=2, tp=1, device="cpu",
                              max_seq_len=128, kv_cache_bytes=256 << 10, host_cache_bytes=0, restart_backoff_s=0.1,
                              step_transport=transport).engine_config())
        await eng.start()
        try:
            params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

            async def one(i):
                return [ev.token_id async for ev in eng.generate(None, [1, 2, 3, i + 4], params)]

            expected = [await one(i) for i in range(4)]
            before = (await eng.aggregator.ranks.remote())["1"].incarnation
            runs = [asyncio.ensure_future(one(i)) for i in range(4)]
            deadline = time.monotonic() + 60
            while not any(len(r.generated) >= 2 for r in eng._groups[1].running):
                assert time.monotonic() < deadline, "group 1 never generated"
                await asyncio.sleep(0.005)
            ray.kill(eng.workers[1], no_restart=True)
            assert await asyncio.gather(*runs) == expected
            while eng._groups[1].down is not None:
                assert time.monotonic() < deadline, "group 1 never came back"
                await asyncio.sleep(0.05)
            assert [await one(i) for i in range(4)] == expected
            await asyncio.wait_for(eng.stats.drained(), 30)
            after = (await eng.aggregator.ranks.remote())["1"].incarnation
            return before, after, eng.aggregator
        finally:
            await eng.shutdown()

    before, after, agg = asyncio.run(main())
    assert before != after
    recs = ray.get(agg.query.remote(-1))
    down = [i for i, r in enumerate(recs) if r["missingRanks"]]
    assert down and all(recs[i]["missingRanks"] == [1] and not recs[i]["complete"] for i in down)
    assert recs[-1]["complete"] and down[-1] < len(recs) - 1
    totals = [r["kvCacheStats"]["allocTotalBlocks"] for r in recs]
    assert totals == sorted(totals)  # the cluster cumulative never goes backwards across the restart
    assert ray.get(agg.ranks.remote())["1"].healthy
    ray.kill(agg, no_restart=True)
