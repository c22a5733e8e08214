"""The whole stats channel without Ray: the engine's StatsChannel into the aggregator's body, with faults.

Nothing is lost or counted twice across lost replies, aggregator restarts (a new body restored from the
checkpoint, the call in flight retried on it, as Ray's max_task_retries does) and rank restarts.
"""

import asyncio
import pickle
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.actor import TAIL_RECORDS, StaleSession, StatsAggregatorImpl
from engine.stats_channel import StatsChannel
from tests.support.aggregator_support import FakeCluster


class MemoryCheckpoint:
    def __init__(self) -> None:
        self.saved: dict[str, bytes] = {}

    def load(self, part: str):
        raw = self.saved.get(part)
        return pickle.loads(raw) if raw else None

    def save(self, part: str, value) -> None:
        self.saved[part] = pickle.dumps(value)


class Handle:
    """The aggregator actor as Ray runs it: `faults` say what happens to the next ingest calls."""

    def __init__(self, world_size: int, tp: int) -> None:
        self.ckpt = MemoryCheckpoint()
        self.make = lambda: StatsAggregatorImpl("e", world_size, tp, checkpoint=self.ckpt)
        self.bodies = [self.make()]
        self.faults: list[str] = []
        self.ingest = types.SimpleNamespace(remote=self._ingest)
        self.register = types.SimpleNamespace(remote=lambda layouts, session: self.bodies[-1].register(layouts,
                                                                                                      session))

    async def _ingest(self, batch, session):
        fault = self.faults.pop(0) if self.faults else None
        if fault == "restart":  # dies while the call is in flight: Ray restarts it and retries the call
            self.bodies.append(self.make())
        reply = await self.bodies[-1].ingest(list(batch), session)
        if fault == "restart_after":  # dies after taking the call, before replying: retried as well
            self.bodies.append(self.make())
            reply = await self.bodies[-1].ingest(list(batch), session)
        if fault == "lost_reply":
            raise ConnectionError("the reply was lost")
        return reply


@settings(max_examples=40, deadline=None)
@given(dp=st.integers(1, 3), tp=st.integers(1, 2), seed=st.integers(0, 2**32),
       ops=st.lists(st.sampled_from(["step", "step", "step", "burst", "restart", "restart_after", "lost_reply",
                                     "rank_restart"]), min_size=1, max_size=40))
def test_nothing_lost_or_counted_twice(dp, tp, seed, ops):
    cluster = FakeCluster(dp, tp, seed)
    handle = Handle(dp * tp, tp)

    async def run():
        channel = StatsChannel(handle, retry_s=(0.0, 0.0))
        await channel.register(cluster.layouts)
        i = 0
        for op in ops:
            if op in ("restart", "restart_after", "lost_reply"):
                handle.faults.append(op)
            elif op == "rank_restart":
                rank = cluster.ranks[cluster.rng.randrange(dp * tp)]
                rank.restart()
                await channel.register([rank.layout])
            n = 5 if op == "burst" else 1
            for _ in range(n):
                channel.put(cluster.iteration(i))
                i += 1
            if op != "burst":
                await asyncio.sleep(0)
        await asyncio.wait_for(channel.drained(), 10)
        await channel.close()
        return i

    n = asyncio.run(run())
    assert n <= TAIL_RECORDS  # what a restart restores: here, the whole stream
    records = handle.bodies[-1].buffer.since(-1)
    assert [r["iter"] for r in records] == list(range(n))  # every iteration exactly once, across restarts
    final = handle.bodies[-1].asm.cumulative.stats()
    for field, key in (("iterAllocTotalBlocks", "allocTotalBlocks"), ("iterReusedBlocks", "reusedBlocks"),
                       ("iterMissedBlocks", "missedBlocks")):
        assert sum(b[field] for r in records for b in r["kvCacheIterationStats"].values()) == final[key]
        series = [r["kvCacheStats"][key] for r in records]
        assert series == sorted(series)  # cluster cumulative never goes backwards
    epochs = [r["aggregatorEpoch"] for r in records]
    assert epochs == sorted(epochs) and handle.bodies[-1].asm.epoch == len(handle.bodies)


def test_a_replaced_engines_late_ingest_is_refused_and_the_new_numbering_stands():
    """An engine replica dies with an ingest in flight (Ray retries it); a new engine attaches, continues after
    the last emitted iteration, and the old call arrives after that: it must not count or renumber anything."""
    old_cluster, new_cluster = FakeCluster(1, 1, seed=1), FakeCluster(1, 1, seed=2)
    handle = Handle(1, 1)

    async def run():
        old = StatsChannel(handle, retry_s=(0.0, 0.0))
        assert await old.register(old_cluster.layouts) is None  # a fresh aggregator: iterations from 0
        for i in range(3):
            old.put(old_cluster.iteration(i))
        await asyncio.wait_for(old.drained(), 10)
        late = [old_cluster.iteration(i) for i in range(3, 6)]  # the old replica's last call, still in flight
        new = StatsChannel(handle, retry_s=(0.0, 0.0))
        first = await new.register(new_cluster.layouts) + 1
        assert first == 3 and new.session == old.session + 1
        handle.bodies.append(handle.make())  # the aggregator restarting in between changes nothing
        with pytest.raises(StaleSession, match="replaced"):
            await handle.bodies[-1].ingest(late, old.session)
        with pytest.raises(StaleSession):
            await handle.bodies[-1].register(old_cluster.layouts, old.session)
        for i in range(first, first + 3):
            new.put(new_cluster.iteration(i))
        await asyncio.wait_for(new.drained(), 10)
        old.put(old_cluster.iteration(6))  # a zombie engine's channel stops at the refusal, losing nothing of ours
        await asyncio.wait_for(old.drained(), 10)
        assert not old.unacked and old._task.done()
        await new.close()

    asyncio.run(run())
    body = handle.bodies[-1]
    records = body.buffer.since(-1)
    assert [r["iter"] for r in records] == list(range(6))
    new_incarnation = new_cluster.layouts[0].incarnation
    assert all(body.details[r["iter"]][0].incarnation == new_incarnation for r in records[3:])
    assert body.asm.counts["rejected"] == 0 and body.asm.counts["duplicates"] == 0


def test_kv_cache_stats_report_the_capacity_from_the_registered_layouts_before_any_iteration():
    cluster = FakeCluster(2, 2)
    body = StatsAggregatorImpl("e", 4, 2, checkpoint=MemoryCheckpoint())
    asyncio.run(body.register(cluster.layouts))
    stats = asyncio.run(body.kv_cache_stats())
    assert stats["maxNumBlocks"] == 200 and stats["freeNumBlocks"] == 200 and stats["usedNumBlocks"] == 0
    assert stats["tokensPerBlock"] == 16 and stats["allocTotalBlocks"] == 0 and stats["cacheHitRate"] == 0.0


def test_iterations_that_come_faster_than_the_send_cadence_ride_one_call():
    """One ingest call per `send_every_s` at most: the first iteration goes at once, the ten that follow within
    the cadence go together in the next call, and nothing is lost."""
    cluster = FakeCluster(1, 1, seed=3)
    handle = Handle(1, 1)
    calls: list[list[int]] = []
    ingest = handle._ingest

    async def counting(batch, session):
        calls.append([it.iteration for it in batch])
        return await ingest(batch, session)

    handle.ingest = types.SimpleNamespace(remote=counting)

    async def run():
        channel = StatsChannel(handle, retry_s=(0.0, 0.0), send_every_s=0.5)
        await channel.register(cluster.layouts)
        channel.put(cluster.iteration(0))
        await asyncio.sleep(0)  # the channel's task sends it
        for i in range(1, 11):  # a step loop's iterations, each after the loop yields
            channel.put(cluster.iteration(i))
            await asyncio.sleep(0)
        await asyncio.wait_for(channel.drained(), 10)
        await channel.close()

    asyncio.run(run())
    assert calls == [[0], list(range(1, 11))]
    assert [r["iter"] for r in handle.bodies[-1].buffer.since(-1)] == list(range(11))
