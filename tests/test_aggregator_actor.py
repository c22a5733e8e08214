"""The StatsAggregator's body run on a plain asyncio loop (no Ray): buffer, cursors, subscribers, rank
health, kv_cache_stats, Prometheus text (checked by promtool when installed), outbox folding."""

import asyncio
import shutil
import subprocess
import time

import pytest
from test_aggregator_support import ENGINE, SimRank, make_report, message

from aggregator import StatsAggregatorImpl
from aggregator.buffer import RecordBuffer
from aggregator.merge import WINDOW_VIEW
from aggregator.metrics import METRICS
from aggregator.outbox import RankOutbox


def run(coro):
    return asyncio.run(coro)


def test_record_buffer_ring_and_cursor():
    b = RecordBuffer(3)
    for i in (1, 2, 4, 7):
        b.append({"iter": i})
    assert [r["iter"] for r in b.since(-1)] == [2, 4, 7]
    assert [r["iter"] for r in b.since(2)] == [4, 7]
    assert [r["iter"] for r in b.since(3, limit=1)] == [4]
    assert b.since(7) == [] and b.since(-1, limit=0) == []
    with pytest.raises(ValueError):
        b.append({"iter": 7})


def test_query_subscribers_ranks_and_stats():
    async def body():
        agg = StatsAggregatorImpl(ENGINE, 2, 1, buffer_size=5, stats_timeout_s=0.2)
        ranks = [SimRank(0, 1), SimRank(1, 1)]
        await agg.ingest([ranks[0].step(0)])
        subs = [asyncio.ensure_future(agg.wait_records(-1, 5.0)) for _ in range(3)]
        await asyncio.sleep(0)
        assert agg.subscribers == 3
        await agg.ingest([ranks[1].step(0)])
        got = await asyncio.gather(*subs)
        assert all([r["iter"] for r in g] == [0] for g in got)  # every subscriber sees the record
        for it in range(1, 8):
            await agg.ingest([rk.step(it) for rk in ranks])
        assert [r["iter"] for r in await agg.query()] == [3, 4, 5, 6, 7]  # ring of 5
        assert [r["iter"] for r in await agg.query(since=4, limit=2)] == [5, 6]
        assert len(await agg.query()) == 5  # reading removed nothing
        withr = await agg.query(since=6, ranks=True)
        assert set(withr[0]["ranks"]) == {"0", "1"} and withr[0]["ranks"]["1"]["tpRank"] == 0
        assert "ranks" not in (await agg.query(since=6))[0]
        with pytest.raises(ValueError, match="limit"):
            await agg.query(limit=-1)
        t0 = time.monotonic()
        assert await agg.wait_records(7, 0.2) == []
        assert time.monotonic() - t0 >= 0.19
        # rank 1 stops: after the timeout the ticker emits iteration 8 incomplete, naming it
        await agg.ingest([ranks[0].step(8)])
        recs = await agg.wait_records(7, 2.0)
        assert recs and recs[0]["missingRanks"] == [1] and recs[0]["complete"] is False
        h = await agg.ranks()
        assert h["0"]["healthy"] and h["1"]["record"]["iter"] == 7
        agg.asm.last_seen[1] -= 10  # rank 1 silent for 10 s, behind the cluster
        assert not (await agg.ranks())["1"]["healthy"]
        stats = await agg.kv_cache_stats()
        assert stats["allocTotalBlocks"] == sum(r.cum["allocTotalBlocks"] for r in ranks)
        health = await agg.health()
        assert health["ok"] and health["last_iter"] == 8 and health["counts"]["incomplete"] == 1
        text = await agg.metrics_text()
        agg._ticker.cancel()
        return text

    text = run(body())
    assert 'kvfleet_kv_cache_window_blocks{state="max",tier="primary",window="512"}' in text
    assert 'kvfleet_rank_healthy{dp_rank="1",rank="1",tp_rank="0"} 0.0' in text
    assert "kvfleet_stats_incomplete_records_total 1.0" in text
    assert "kvfleet_kv_cache_onboard_bytes_total" in text
    series = [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert len(series) == len(set(series)), "every series (name + labels) appears once"
    for name, kind, _, _ in METRICS:
        assert f"# TYPE {name} {kind}" in text
        assert kind != "counter" or name.endswith("_total")
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed")
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_tokens_per_block_mismatch_reported_not_raised():
    async def body():
        agg = StatsAggregatorImpl(ENGINE, 2, 1, stats_timeout_s=1.0)
        a, b = SimRank(0, 1, tokens_per_block=16), SimRank(1, 1, tokens_per_block=32)
        await agg.ingest([a.step(0), b.step(0)])
        return (await agg.query())[0]

    rec = run(body())
    assert rec["complete"] and rec["errors"][0]["field"] == "tokensPerBlock"


def test_ingest_takes_a_pickled_batch_and_refuses_bad_bytes():
    import pickle

    from aggregator.layout import packed

    async def body():
        agg = StatsAggregatorImpl(ENGINE, 2, 1, stats_timeout_s=1.0)
        a, b = SimRank(0, 1), SimRank(1, 1)
        wire = [packed(a.step(0)), packed(b.step(0))]
        await agg.ingest(pickle.dumps(wire))
        with pytest.raises(ValueError, match="not a pickled list"):
            await agg.ingest(b"\x80\x05 not a pickle")
        reply = await agg.ingest(pickle.dumps([]), poll=[a.incarnation, b.incarnation])
        return reply, await agg.query(), agg.asm.counts, {a.incarnation, b.incarnation}

    reply, recs, counts, incs = run(body())
    assert [r["iter"] for r in recs] == [0] and recs[0]["complete"]
    assert sorted(map(tuple, reply["acked"])) == sorted((i, 0) for i in incs)  # emitted: acknowledged on the poll
    assert counts["messages"] == 2 and counts["rejected"] == 0


class _FakeHandle:
    """An aggregator handle whose ingest runs on a StatsAggregatorImpl in the test's own loop thread."""

    def __init__(self, agg, loop, gate):
        self.agg, self.loop, self.gate = agg, loop, gate
        self.ingest = self

    def remote(self, messages, **kw):
        self.gate.wait()
        return asyncio.run_coroutine_threadsafe(self.agg.ingest(messages, **kw), self.loop)


def test_outbox_folds_while_unreachable_and_loses_no_count(monkeypatch):
    import threading

    import ray

    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    agg = StatsAggregatorImpl(ENGINE, 1, 1, stats_timeout_s=0.2)
    gate = threading.Event()  # closed: the aggregator is unreachable
    monkeypatch.setattr(ray, "get", lambda fut, **_: fut.result(10))
    box = RankOutbox(ENGINE, max_pending=4, handle=_FakeHandle(agg, loop, gate), resend_after_s=0.05)
    rk = SimRank(0, 1)
    sent = [rk.step(i, report=make_report(counters={"iterAllocTotalBlocks": i + 1})) for i in range(20)]
    for m in sent:
        box.put(m)  # never blocks
    assert box.pending() <= 5 and box.folded >= 15  # one may be in flight, held back by the gate
    gate.set()
    assert box.flush(10.0)
    recs = asyncio.run_coroutine_threadsafe(agg.query(), loop).result(5)
    # iterations folded into a later message are records without counts; the counts sit at the span end
    total = sum(r[WINDOW_VIEW].get("512", {}).get("iterAllocTotalBlocks", 0) for r in recs)
    assert total == sum(range(1, 21))
    assert all(r["complete"] for r in recs)
    box.close()
    loop.call_soon_threadsafe(loop.stop)


def test_outbox_never_folds_what_an_aggregator_may_have_counted():
    from aggregator.outbox import DELIVERED, _Entry

    box = RankOutbox(ENGINE, max_pending=2, handle=object())
    box.close(1.0)  # no sender thread: the bookkeeping alone, step by step
    rk = SimRank(0, 1)
    old = [rk.step(i) for i in range(2)]
    for m in old:  # taken by the old aggregator, whose checkpoint may count them; no ack came back
        box._entries[(m["incarnation"], m["seq"])] = _Entry(m, state=DELIVERED, held=True)
    box._aggregator = ("old", 1)
    box._apply([], {"epoch": 2, "aggregator_id": "new", "acked": []})  # it restarted: everything goes again
    assert all(e.held for e in box._entries.values())
    for i in (2, 3):
        box.put(rk.step(i))  # over max_pending: only never-sent messages may be folded
    assert box.folded == 1 and all(box._entries[(m["incarnation"], m["seq"])].message is m for m in old)


def test_message_helper_engine_default():
    assert message(0, 0, 0)["engine_id"] == ENGINE
