"""The per-node stats relay (aggregator/relay.py) on a plain asyncio loop, in front of a real
StatsAggregatorImpl: a node's ranks reach the aggregator in one call per flush, acks and rejections find
their way back, an unreachable aggregator loses nothing, a full queue refuses, and a restarted relay looks
new to the ranks."""

import asyncio
import pickle

import pytest
from test_aggregator_support import ENGINE, SimRank

from aggregator import StatsAggregatorImpl, StatsRelayImpl
from aggregator.layout import packed
from aggregator.merge import WINDOW_VIEW
from aggregator.relay import RelayBusy


class _Ingest:
    """`handle.ingest.remote(...)` for an aggregator body on the same loop; notes each call's batch size."""

    def __init__(self, agg: StatsAggregatorImpl, fail_first: int = 0) -> None:
        self.agg, self.fail_left, self.sizes = agg, fail_first, []

    def remote(self, blob, poll=None, expect=None):
        async def call():
            if self.fail_left:
                self.fail_left -= 1
                raise ConnectionError("aggregator unreachable")
            self.sizes.append(len(pickle.loads(blob)))
            return await self.agg.ingest(blob, poll=poll, expect=expect)

        return call()


class FakeHandle:
    def __init__(self, agg: StatsAggregatorImpl, fail_first: int = 0) -> None:
        self.ingest = _Ingest(agg, fail_first)


async def _until(pred, timeout_s: float = 5.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _acks(relay: StatsRelayImpl, ranks: list[SimRank], want: int) -> set:
    """Poll through the relay (as idle outboxes do) until `want` acks came back."""
    got: set = set()
    for _ in range(200):
        reply = await relay.ingest([], poll=[r.incarnation for r in ranks])
        got |= {tuple(a) for a in reply["acked"]}
        if len(got) >= want:
            return got
        await asyncio.sleep(0.02)
    raise AssertionError(f"only {len(got)} of {want} acks came back")


def test_a_nodes_ranks_reach_the_aggregator_in_one_call_per_flush():
    async def body():
        agg = StatsAggregatorImpl(ENGINE, 8, 1, stats_timeout_s=5.0)
        handle = FakeHandle(agg)
        relay = StatsRelayImpl(ENGINE, flush_interval_s=0.01, aggregator=handle)
        ranks = [SimRank(r, 1, seed=4) for r in range(8)]
        sent = 0
        for it in range(5):
            msgs = [rk.step(it) for rk in ranks]
            sent += sum(b["iterAllocTotalBlocks"] for m in msgs for b in m["report"][WINDOW_VIEW].values())
            # each rank's outbox calls on its own; the relay forwards them together
            await asyncio.gather(*(relay.ingest(pickle.dumps([packed(m)])) for m in msgs))
        await _until(lambda: agg.asm.last_emitted == 4)
        acks = await _acks(relay, ranks, 40)
        return agg, handle, sent, acks, ranks

    agg, handle, sent, acks, ranks = asyncio.run(body())
    calls = [n for n in handle.ingest.sizes if n]
    assert len(calls) <= 5 and min(calls) >= 8  # 40 rank calls, at most one aggregator call per iteration
    assert sum(handle.ingest.sizes) == 40 and agg.asm.counts["messages"] == 40 and agg.asm.counts["duplicates"] == 0
    recs = agg.buffer.since(-1)
    assert [r["iter"] for r in recs] == [0, 1, 2, 3, 4] and all(r["complete"] for r in recs)
    assert sum(b["iterAllocTotalBlocks"] for r in recs for b in r[WINDOW_VIEW].values()) == sent
    assert acks == {(rk.incarnation, s) for rk in ranks for s in range(5)}


def test_unreachable_aggregator_loses_nothing_and_a_full_queue_refuses():
    async def body():
        agg = StatsAggregatorImpl(ENGINE, 2, 1, stats_timeout_s=5.0)
        relay = StatsRelayImpl(ENGINE, flush_interval_s=0.005, max_queue=6, retry_backoff_s=0.01,
                               aggregator=FakeHandle(agg))
        ranks = [SimRank(r, 1) for r in range(2)]
        first = await relay.ingest([], poll=[])  # first contact made
        relay._aggregator = handle = FakeHandle(agg, fail_first=5)  # now it fails five times
        for it in range(3):
            await relay.ingest(pickle.dumps([packed(rk.step(it)) for rk in ranks]))
        with pytest.raises(RelayBusy):  # 6 queued: past max_queue the relay refuses, the outbox keeps them
            await relay.ingest(pickle.dumps([packed(ranks[0].step(3))]))
        await _until(lambda: agg.asm.last_emitted == 2)
        # a failed call may have run with its acks lost: the relay took a new identity, so ranks re-send
        stale = await relay.ingest([], expect=[first["aggregator_id"], first["epoch"]])
        return agg, handle, relay, stale

    agg, handle, relay, stale = asyncio.run(body())
    assert stale["stale"]
    assert handle.ingest.fail_left == 0 and sum(handle.ingest.sizes) == 6 and not relay.queue
    assert agg.asm.counts["messages"] == 6 and all(r["complete"] for r in agg.buffer.since(-1))


def test_rejections_come_back_by_incarnation_and_seq():
    async def body():
        agg = StatsAggregatorImpl(ENGINE, 1, 1, stats_timeout_s=5.0)
        relay = StatsRelayImpl(ENGINE, flush_interval_s=0.005, aggregator=FakeHandle(agg))
        rk = SimRank(0, 1)
        bad = packed(rk.step(0))
        bad["counters"] = bad["counters"][:-8]
        reply = await relay.ingest(pickle.dumps([bad]))
        for _ in range(100):
            if reply.get("rejected"):
                return reply, rk
            await asyncio.sleep(0.01)
            reply = await relay.ingest([], poll=[rk.incarnation])
        raise AssertionError("no rejection came back")

    reply, rk = asyncio.run(body())
    [rej] = reply["rejected"]
    assert (rej["incarnation"], rej["seq"]) == (rk.incarnation, 0) and "counters" in rej["error"]


def test_a_restarted_relay_has_a_new_identity():
    async def body():
        agg = StatsAggregatorImpl(ENGINE, 1, 1, stats_timeout_s=5.0)
        a, b = (StatsRelayImpl(ENGINE, aggregator=FakeHandle(agg)) for _ in range(2))
        ra, ra2, rb = await a.ingest([]), await a.ingest([]), await b.ingest([])
        return ra, ra2, rb

    ra, ra2, rb = asyncio.run(body())
    assert ra["aggregator_id"] == ra2["aggregator_id"] != rb["aggregator_id"]  # a rank re-sends on a change
    assert ra["epoch"] == rb["epoch"] == 1


def test_a_call_expecting_a_predecessor_is_refused_whole():
    async def body():
        agg = StatsAggregatorImpl(ENGINE, 1, 1, stats_timeout_s=5.0)
        relay = StatsRelayImpl(ENGINE, flush_interval_s=0.005, aggregator=FakeHandle(agg))
        rk = SimRank(0, 1)
        first = await relay.ingest(pickle.dumps([packed(rk.step(0))]))
        me = [first["aggregator_id"], first["epoch"]]
        stale = await relay.ingest(pickle.dumps([packed(rk.step(1))]), expect=["old-relay/x", 1])
        direct = await agg.ingest(pickle.dumps([packed(rk.step(2))]), expect=["old-aggregator", 1])
        fine = await relay.ingest([], poll=[rk.incarnation], expect=me)
        await _until(lambda: agg.asm.counts["messages"] == 1 and not relay.queue)
        return stale, direct, fine, relay, agg

    stale, direct, fine, relay, agg = asyncio.run(body())
    assert stale["stale"] and direct["stale"] and "stale" not in fine
    assert stale["acked"] == [] and direct["acked"] == []
    assert relay.forwarded == 1 and agg.asm.counts["messages"] == 1  # neither refused message was taken


def test_bad_calls_get_clear_errors_and_change_nothing():
    async def body():
        agg = StatsAggregatorImpl(ENGINE, 1, 1, stats_timeout_s=5.0)
        relay = StatsRelayImpl(ENGINE, flush_interval_s=0.005, aggregator=FakeHandle(agg))
        await relay.ingest([])
        with pytest.raises(ValueError, match="not a pickled list"):
            await relay.ingest(b"\x80\x05 not a pickle")
        with pytest.raises(TypeError, match="list of message dicts"):
            await relay.ingest(pickle.dumps(["x"]))
        return relay

    relay = asyncio.run(body())
    assert relay.queue == [] and relay.forwarded == 0
