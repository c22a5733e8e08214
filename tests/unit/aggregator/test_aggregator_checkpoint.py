"""The aggregator's checkpoint under a crash after every single write of an ingest (no Ray).

A fake key-value store dies after k writes; the aggregator restarts from what was written, the engine re-sends
what was not acknowledged, and the restarted aggregator must hold the newest TAIL_RECORDS records its checkpoint
covers (the checkpoint covering everything acknowledged), with every iteration counted exactly once. A write
that fails once, the actor living on, must leave the engine's retry new iterations, not duplicates. And the
layouts kept (and checkpointed) stay bounded over any number of rank restarts.
"""

import asyncio
import pickle
import types

import pytest

from aggregator import actor
from aggregator.actor import StatsAggregatorImpl
from engine.stats_channel import StatsChannel
from tests.support.aggregator_support import FakeCluster

TAIL = 8  # TAIL_RECORDS for these tests, so that a batch above it stays small
CHUNK = 3  # TAIL_CHUNK: slots that do not line up with the batches or the tail
PRIOR = 12  # iterations acknowledged (in calls of 5) before the batch that crashes


class Crash(Exception):
    pass


class CrashingStore:
    """The GCS key-value store as the aggregator sees it; it dies at write number `limit` (None: never)."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.writes = 0
        self.limit: int | None = None

    def load(self, part: str):
        raw = self.kv.get(part)
        return pickle.loads(raw) if raw else None

    def save(self, part: str, value) -> None:
        if self.limit is not None and self.writes >= self.limit:
            raise Crash(f"died at write {self.writes}")
        self.kv[part] = pickle.dumps(value)
        self.writes += 1


async def _scenario(cluster: FakeCluster, its: list, crash_after: int | None):
    """PRIOR iterations acknowledged, then the rest in one call that dies after `crash_after` of its writes;
    Ray restarts the actor and the engine re-sends everything not acknowledged.
    (final body, iterations the restart restored, writes the batch made)"""
    store = CrashingStore()
    body = StatsAggregatorImpl("e", 2, 1, checkpoint=store)
    await body.register(cluster.layouts)
    acked = -1
    for start in range(0, PRIOR, 5):
        acked = (await body.ingest(its[start:min(start + 5, PRIOR)])).acked
    assert acked == PRIOR - 1
    before = store.writes
    store.limit = None if crash_after is None else before + crash_after
    restored = None
    try:
        acked = (await body.ingest(its[PRIOR:])).acked
    except Crash:
        store.limit = None
        body = StatsAggregatorImpl("e", 2, 1, checkpoint=store)
        restored = [r["iter"] for r in body.buffer.since(-1)]
        await body.ingest([it for it in its if it.iteration > acked])
    return body, restored, store.writes - before


@pytest.mark.parametrize("batch", [5, 20])  # below and above the tail size
def test_a_crash_after_any_write_loses_no_acknowledged_record_and_counts_none_twice(monkeypatch, batch):
    monkeypatch.setattr(actor, "TAIL_RECORDS", TAIL)
    monkeypatch.setattr(actor, "TAIL_CHUNK", CHUNK)
    cluster = FakeCluster(2, 1, seed=3)
    its = [cluster.iteration(i) for i in range(PRIOR + batch)]
    end = PRIOR + batch
    reference, _, writes = asyncio.run(_scenario(cluster, its, None))
    assert [r["iter"] for r in reference.buffer.since(-1)] == list(range(end))
    assert writes >= -(-batch // CHUNK) + 1  # a slot per chunk of records and at least one state
    for k in range(writes):
        body, restored, _ = asyncio.run(_scenario(cluster, its, k))
        where = f"crashed after {k} of {writes} writes"
        top = restored[-1]
        assert top >= PRIOR - 1, f"{where}: the checkpoint does not cover what was acknowledged"
        assert restored == list(range(restored[0], top + 1)), f"{where}: a gap in the restored tail {restored}"
        assert restored[0] <= max(0, top - TAIL + 1), f"{where}: the newest {TAIL} records not restored"
        final = [r["iter"] for r in body.buffer.since(-1)]
        assert final == list(range(final[0], end)), f"{where}: a gap or a record twice: {final}"
        assert body.totals == reference.totals, f"{where}: a count lost or doubled"
        assert body.completed == reference.completed
        assert body.asm.cumulative.stats() == reference.asm.cumulative.stats()


def test_a_large_batch_dying_before_its_state_keeps_the_acknowledged_tail():
    """repro 08 with the real sizes: 100 acknowledged, then 300 in one call, dead at the first state save."""
    cluster = FakeCluster(2, 1)
    store = CrashingStore()

    async def run():
        body = StatsAggregatorImpl("e", 2, 1, checkpoint=store)
        await body.register(cluster.layouts)
        assert (await body.ingest([cluster.iteration(i) for i in range(100)])).acked == 99
        first = range(100, 100 + actor.TAIL_RECORDS)  # the first TAIL_RECORDS of the call: every slot, not the state
        store.limit = store.writes + len({i // actor.TAIL_CHUNK for i in first})
        with pytest.raises(Crash):
            await body.ingest([cluster.iteration(i) for i in range(100, 400)])
        store.limit = None
        return StatsAggregatorImpl("e", 2, 1, checkpoint=store)

    again = asyncio.run(run())
    assert again.asm.last_emitted == 99
    assert [r["iter"] for r in again.buffer.since(-1)] == list(range(100))


async def _failing_once(cluster: FakeCluster, its: list, fail_at: int):
    """PRIOR iterations acknowledged, then write `fail_at` of the next batch fails once (the GCS briefly
    unreachable) and the same actor takes the engine's retry of the batch. (body, store, the retry's acked)"""
    store = CrashingStore()
    body = StatsAggregatorImpl("e", 2, 1, checkpoint=store)
    await body.register(cluster.layouts)
    for start in range(0, PRIOR, 5):
        await body.ingest(its[start:min(start + 5, PRIOR)])
    store.limit = store.writes + fail_at
    with pytest.raises(Crash):
        await body.ingest(its[PRIOR:])
    store.limit = None
    return body, store, (await body.ingest(its[PRIOR:])).acked


@pytest.mark.parametrize("batch", [5, 20])  # one chunk, and chunks of TAIL
def test_a_failed_write_acknowledges_nothing_unsaved_and_the_retry_loses_no_record(monkeypatch, batch):
    monkeypatch.setattr(actor, "TAIL_RECORDS", TAIL)
    monkeypatch.setattr(actor, "TAIL_CHUNK", CHUNK)
    cluster = FakeCluster(2, 1, seed=3)
    its = [cluster.iteration(i) for i in range(PRIOR + batch)]
    reference, _, writes = asyncio.run(_scenario(cluster, its, None))
    for k in range(writes):
        body, store, acked = asyncio.run(_failing_once(cluster, its, k))
        where = f"write {k} of {writes} failed"
        assert acked == PRIOR + batch - 1
        assert store.load("state")["last_emitted"] == acked, f"{where}: acked beyond the checkpoint"
        assert body.buffer.since(-1) == reference.buffer.since(-1), f"{where}: a record lost or changed"
        assert body.totals == reference.totals and body.completed == reference.completed, where
        assert body.asm.cumulative.stats() == reference.asm.cumulative.stats(), where
        assert body.vllm.to_state() == reference.vllm.to_state(), where
        assert body.asm.counts["records"] == reference.asm.counts["records"], where
        restarted = StatsAggregatorImpl("e", 2, 1, checkpoint=store)  # the tail's slots, rewritten by the retry
        tail = [r["iter"] for r in restarted.buffer.since(-1)]
        assert tail == list(range(tail[0], acked + 1)) and tail[0] <= acked - TAIL + 1, f"{where}: tail {tail}"


class _FlakyStore(CrashingStore):
    """CrashingStore whose failing write fails once, the actor living on (repro 09)."""

    def save(self, part: str, value) -> None:
        try:
            super().save(part, value)
        except Crash:
            self.limit = None
            raise


def test_the_engines_retry_after_a_failed_write_finds_every_iteration_recorded_and_conserved():
    """repro 09: the real StatsChannel; the write of iteration 5's tail slot fails once."""
    store = _FlakyStore()
    cluster = FakeCluster(2, 1, seed=3)

    async def run():
        agg = StatsAggregatorImpl("e", 2, 1, checkpoint=store)
        handle = types.SimpleNamespace(ingest=types.SimpleNamespace(remote=agg.ingest),
                                       register=types.SimpleNamespace(remote=agg.register))
        channel = StatsChannel(handle, retry_s=(0.001, 0.002))
        await channel.register(cluster.layouts)
        for i in range(10):
            if i == 5:
                store.limit = store.writes
            channel.put(cluster.iteration(i))
            await channel.drained()
        return channel.acked, await agg.query(-1, None, False)

    acked, records = asyncio.run(run())
    assert acked == 9 and [r["iter"] for r in records] == list(range(10))
    summed = sum(b["iterAllocTotalBlocks"] for r in records for b in r["kvCacheIterationStats"].values())
    assert summed == records[-1]["kvCacheStats"]["allocTotalBlocks"]
    assert store.load("state")["last_emitted"] == 9


def test_layouts_of_dead_incarnations_are_forgotten_and_not_checkpointed_again():
    """repro 07: dp group 0 restarts every 2 iterations; the layouts kept and the checkpointed ones stay bounded
    by the live ranks plus what the rank-detail window still names, and that window keeps its ranks."""
    store = CrashingStore()
    cluster = FakeCluster(2, 2, seed=1)
    window = 8

    async def run():
        agg = StatsAggregatorImpl("e", 4, 2, checkpoint=store, rank_detail_records=window)
        await agg.register(cluster.layouts)
        it, sizes = 0, []
        for _ in range(60):
            for rank in cluster.ranks[0:2]:
                rank.restart()
            await agg.register([r.layout for r in cluster.ranks[0:2]], agg.session)
            for _ in range(2):
                await agg.ingest([cluster.iteration(it)], agg.session)
                it += 1
            sizes.append((len(agg.asm.layouts), len(store.load("layouts"))))
        return agg, sizes

    agg, sizes = asyncio.run(run())
    bound = 4 + 2 * (window // 2 + 1)  # live ranks, the restarted ranks' incarnations the window names
    assert max(max(s) for s in sizes) <= bound, sizes
    assert sizes[-1] == sizes[20]
    with_ranks = asyncio.run(agg.query(-1, None, True))
    assert all(len(r["ranks"]) == 4 for r in with_ranks[-window:])  # what the window names is still readable
