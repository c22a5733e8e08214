"""The StatsAggregator's rate-limited checkpoint (no Ray: an in-memory store stands in for the GCS one):
bursts share one checkpoint, no record is visible and no message acknowledged before a checkpoint counts it,
a restart from the last checkpoint counts every message once; the rank detail ring; managed gen-2 GC."""

import asyncio
import pickle
import time

from test_aggregator_support import ENGINE, SimRank

from aggregator import StatsAggregatorImpl
from aggregator.merge import WINDOW_VIEW


class MemoryStore:
    """Stands in for actor._Checkpoint; notes what each save covered and what readers could see then."""

    def __init__(self, saved: dict | None = None) -> None:
        self.key, self.actor_id = "stats-checkpoint/test", "actor-test"
        self.saved, self.saves = saved, []

    def load(self):
        return pickle.loads(pickle.dumps(self.saved)) if self.saved else None

    def save(self, state) -> None:
        self.saved = pickle.loads(pickle.dumps(state))  # serialised at once, as the GCS store does
        self.saves.append(state["last_iter"])


def make(interval: float, saved: dict | None = None, world: int = 2):
    agg = StatsAggregatorImpl(ENGINE, world, 1, stats_timeout_s=5.0, checkpoint_interval_s=interval)
    agg._ckpt = MemoryStore(saved)
    if saved:  # what __init__ does with a store that has a checkpoint (restart path)
        agg.asm.epoch = saved["epoch"] + 1
        agg.asm.restore(agg._ckpt.load())
    visible: list[tuple[int, int]] = []  # (record iter, newest checkpointed last_iter when it became visible)
    append = agg.buffer.append

    def watched(rec):
        visible.append((rec["iter"], agg._ckpt.saves[-1] if agg._ckpt.saves else -1))
        append(rec)

    agg.buffer.append = watched
    return agg, visible


async def wait_through(agg, it: int, timeout_s: float = 5.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    recs: list[dict] = []
    while time.monotonic() < deadline:
        recs = await agg.query()
        if recs and recs[-1]["iter"] >= it:
            return recs
        await agg.wait_records(recs[-1]["iter"] if recs else -1, deadline - time.monotonic())
    raise AssertionError(f"no record {it} in {timeout_s} s: {[r['iter'] for r in recs]}")


def test_burst_shares_checkpoints_and_nothing_visible_or_acked_before_it():
    async def body():
        agg, visible = make(interval=0.3)
        ranks = [SimRank(0, 1), SimRank(1, 1)]
        sent = []
        acked: list[tuple[str, int]] = []
        for it in range(12):
            msgs = [rk.step(it) for rk in ranks]
            sent += msgs
            reply = await agg.ingest(msgs)
            acked += [tuple(a) for a in reply["acked"]]
            # an acknowledged message is in a checkpoint: its iteration is at most the last saved one
            by_key = {(m["incarnation"], m["seq"]): m["iteration"] for m in sent}
            assert all(by_key[a] <= agg._ckpt.saves[-1] for a in acked)
        t0 = time.monotonic()
        recs = await wait_through(agg, 11)
        waited = time.monotonic() - t0
        assert [r["iter"] for r in recs] == list(range(12)) and all(r["complete"] for r in recs)
        # the first record went out at once, the other 11 waited for the interval and left together
        assert len(agg._ckpt.saves) == 2 and agg._ckpt.saves == [0, 11]
        assert waited < 1.0
        assert all(it <= covered for it, covered in visible)
        # counts: every message once
        total = sum(b["iterAllocTotalBlocks"] for r in recs for b in r[WINDOW_VIEW].values())
        assert total == sum(rk.cum["allocTotalBlocks"] for rk in ranks)
        assert (await agg.kv_cache_stats())["allocTotalBlocks"] == total
        return agg

    run_and_cancel(body)


def test_no_interval_checkpoints_every_publication():
    async def body():
        agg, visible = make(interval=0.0)
        ranks = [SimRank(0, 1), SimRank(1, 1)]
        for it in range(5):
            await agg.ingest([rk.step(it) for rk in ranks])
        assert agg._ckpt.saves == [0, 1, 2, 3, 4] and [v[0] for v in visible] == [0, 1, 2, 3, 4]
        return agg

    run_and_cancel(body)


def test_restart_from_rate_limited_checkpoint_counts_every_message_once():
    async def body():
        agg, _ = make(interval=10.0)  # everything after the first record waits
        ranks = [SimRank(0, 1), SimRank(1, 1)]
        sent = [[rk.step(it) for rk in ranks] for it in range(4)]
        unacked = {(m["incarnation"], m["seq"]): m for it in sent for m in it}
        for msgs in sent:
            for a in (await agg.ingest(msgs))["acked"]:
                unacked.pop(tuple(a), None)
        first = await agg.query()
        assert [r["iter"] for r in first] == [0] and agg.asm.pending  # 1..3 wait for the interval
        agg._ticker.cancel()
        agg._deferred.cancel()
        # the actor dies; its successor starts from the checkpoint, the ranks re-send what is not acked
        new, _ = make(interval=0.0, saved=agg._ckpt.saved)
        for it in sent:
            await new.ingest([m for m in it if (m["incarnation"], m["seq"]) in unacked])
        recs = await new.query()
        assert [r["iter"] for r in recs] == [1, 2, 3] and recs[0]["aggregatorEpoch"] == 2
        total = sum(b["iterAllocTotalBlocks"] for r in first + recs for b in r[WINDOW_VIEW].values())
        assert total == sum(rk.cum["allocTotalBlocks"] for rk in ranks)  # none lost, none twice
        return new

    run_and_cancel(body)


def test_rank_details_round_trip():
    async def body():
        agg, _ = make(interval=0.0)
        ranks = [SimRank(0, 1), SimRank(1, 1)]
        msgs = [rk.step(0) for rk in ranks]
        await agg.ingest(msgs)
        [rec] = await agg.query(ranks=True)
        assert rec["ranks"]["1"][WINDOW_VIEW] == msgs[1]["report"][WINDOW_VIEW]
        assert rec["ranks"]["0"]["kvCacheStats"] == msgs[0]["kv_cache_stats"]
        return agg

    run_and_cancel(body)


def test_managed_gc_turns_off_automatic_full_passes_and_runs_them_after_publication(monkeypatch):
    import gc

    import aggregator.actor as actor_mod

    before = gc.get_threshold()
    try:
        async def body():
            agg, _ = make(interval=0.0)
            assert not agg.manage_gc  # not in a Ray actor: the process's GC is left alone
            agg = StatsAggregatorImpl(ENGINE, 2, 1, manage_gc=True)
            assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] >= 10**9
            monkeypatch.setattr(actor_mod, "FULL_GC_INTERVAL_S", 0.0)
            full = gc.get_stats()[2]["collections"]
            ranks = [SimRank(0, 1), SimRank(1, 1)]
            await agg.ingest([rk.step(0) for rk in ranks])
            await asyncio.sleep(0)  # the pass runs once the woken readers had their turn
            await asyncio.sleep(0)
            assert agg.full_gcs == 1 and gc.get_stats()[2]["collections"] > full
            return agg

        run_and_cancel(body)
    finally:
        gc.set_threshold(*before)


def run_and_cancel(body) -> None:
    async def wrapped():
        agg = await body()
        if agg._ticker:
            agg._ticker.cancel()
        if agg._deferred:
            agg._deferred.cancel()

    asyncio.run(wrapped())
