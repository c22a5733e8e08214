"""The whole stats channel without Ray: the engine's StatsChannel into the aggregator's body, with faults.

Nothing is lost or counted twice across lost replies, aggregator restarts (a new body restored from the
checkpoint, the call in flight retried on it, as Ray's max_task_retries does) and rank restarts.
"""

import asyncio
import pickle
import types

from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.actor import TAIL_RECORDS, StatsAggregatorImpl
from tests.aggregator_support import FakeCluster
from workers.stats_channel import StatsChannel


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
        self.register = types.SimpleNamespace(remote=lambda layouts: self.bodies[-1].register(layouts))

    async def _ingest(self, batch):
        fault = self.faults.pop(0) if self.faults else None
        if fault == "restart":  # dies while the call is in flight: Ray restarts it and retries the call
            self.bodies.append(self.make())
        reply = await self.bodies[-1].ingest(list(batch))
        if fault == "restart_after":  # dies after taking the call, before replying: retried as well
            self.bodies.append(self.make())
            reply = await self.bodies[-1].ingest(list(batch))
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
