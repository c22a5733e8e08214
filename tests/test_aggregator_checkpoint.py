"""The aggregator's checkpoint under a crash after every single write of an ingest (no Ray).

A fake key-value store dies after k writes; the aggregator restarts from what was written, the engine re-sends
what was not acknowledged, and the restarted aggregator must hold the newest TAIL_RECORDS records its checkpoint
covers (the checkpoint covering everything acknowledged), with every iteration counted exactly once.
"""

import asyncio
import pickle

import pytest

from aggregator import actor
from aggregator.actor import StatsAggregatorImpl
from tests.aggregator_support import FakeCluster

TAIL = 8  # TAIL_RECORDS for these tests, so that a batch above it stays small
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
        acked = (await body.ingest(its[start:min(start + 5, PRIOR)]))["acked"]
    assert acked == PRIOR - 1
    before = store.writes
    store.limit = None if crash_after is None else before + crash_after
    restored = None
    try:
        acked = (await body.ingest(its[PRIOR:]))["acked"]
    except Crash:
        store.limit = None
        body = StatsAggregatorImpl("e", 2, 1, checkpoint=store)
        restored = [r["iter"] for r in body.buffer.since(-1)]
        await body.ingest([it for it in its if it.iteration > acked])
    return body, restored, store.writes - before


@pytest.mark.parametrize("batch", [5, 20])  # below and above the tail size
def test_a_crash_after_any_write_loses_no_acknowledged_record_and_counts_none_twice(monkeypatch, batch):
    monkeypatch.setattr(actor, "TAIL_RECORDS", TAIL)
    monkeypatch.setattr(actor, "TAIL_SLOTS", 2 * TAIL, raising=False)
    cluster = FakeCluster(2, 1, seed=3)
    its = [cluster.iteration(i) for i in range(PRIOR + batch)]
    end = PRIOR + batch
    reference, _, writes = asyncio.run(_scenario(cluster, its, None))
    assert [r["iter"] for r in reference.buffer.since(-1)] == list(range(end))
    assert writes >= batch + 1  # a slot per record and at least one state
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
        assert (await body.ingest([cluster.iteration(i) for i in range(100)]))["acked"] == 99
        store.limit = store.writes + actor.TAIL_RECORDS  # every slot of the first chunk, not its state
        with pytest.raises(Crash):
            await body.ingest([cluster.iteration(i) for i in range(100, 400)])
        store.limit = None
        return StatsAggregatorImpl("e", 2, 1, checkpoint=store)

    again = asyncio.run(run())
    assert again.asm.last_emitted == 99
    assert [r["iter"] for r in again.buffer.since(-1)] == list(range(100))
