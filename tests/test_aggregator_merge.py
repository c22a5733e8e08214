"""Pure merge rules of aggregator/merge.py (DESIGN.md 'Merging into a cluster record'), no Ray."""

import pytest
from test_aggregator_support import ENGINE, kv_stats, make_report, message

from aggregator.merge import (
    LIFECYCLE_VIEW,
    POOL_VIEW,
    WINDOW_VIEW,
    ClusterCumulative,
    fold_rank_messages,
    hit_rate,
    merge_iteration,
)


def test_hit_rate_rules():
    assert hit_rate(0, 0) == 0.0
    assert hit_rate(0, 5) == 0.0
    assert hit_rate(3, 1) == 0.75


def test_block_counters_from_tp0_bytes_from_all_gauges_summed_over_dp():
    # dp=2, tp=2: ranks 0,1 (dp 0) and 2,3 (dp 1)
    rep = lambda alloc, byts, free: make_report(
        counters={"iterAllocTotalBlocks": alloc, "iterOffloadBytes": byts, "iterReusedBlocks": 3,
                  "iterMissedBlocks": 1},
        gauges={"primaryFreeNumBlocks": free, "primaryPeakUsedNumBlocks": 10})
    msgs = [message(0, 5, 0, tp=2, report=rep(4, 100, 7)), message(1, 5, 0, tp=2, report=rep(4, 100, 7)),
            message(2, 5, 0, tp=2, report=rep(6, 50, 9)), message(3, 5, 0, tp=2, report=rep(6, 50, 9))]
    m = merge_iteration(msgs)
    b = m.views[WINDOW_VIEW]["512"]
    assert b["iterAllocTotalBlocks"] == 4 + 6  # tp rank 0 of each dp group only
    assert b["iterOffloadBytes"] == 100 * 2 + 50 * 2  # every rank moves its own shard
    assert b["primaryFreeNumBlocks"] == 7 + 9  # gauges: tp rank 0, summed over dp
    assert b["primaryPeakUsedNumBlocks"] == 20  # peaks summed: an upper bound
    assert b["iterReusedBlocks"] == 6 and b["iterMissedBlocks"] == 2
    assert b["iterCacheHitRate"] == pytest.approx(6 / 8)  # recomputed, not averaged
    assert m.views[LIFECYCLE_VIEW]["1"]["iterCacheHitRate"] == pytest.approx(0.75)
    assert m.views[POOL_VIEW]["0"]["iterOffloadBytes"] == 300
    assert "iterReusedBlocks" not in m.views[POOL_VIEW]["0"]
    assert m.tp_divergence == [] and m.errors == []


def test_tp_divergence_lists_each_differing_block_field():
    a = make_report(counters={"iterAllocTotalBlocks": 4}, gauges={"primaryUsedNumBlocks": 3})
    b = make_report(counters={"iterAllocTotalBlocks": 5, "iterOnboardBytes": 999}, gauges={"primaryUsedNumBlocks": 3})
    m = merge_iteration([message(0, 1, 0, tp=2, report=a), message(1, 1, 0, tp=2, report=b)])
    div = m.tp_divergence
    # bytes may differ (shards), block counts may not: 2 windows + 2 pool groups disagree on alloc
    assert {(d["view"], d.get("window") or d.get("poolGroup"), d["field"]) for d in div} == {
        (WINDOW_VIEW, "512", "iterAllocTotalBlocks"), (WINDOW_VIEW, "1024", "iterAllocTotalBlocks"),
        (POOL_VIEW, "0", "iterAllocTotalBlocks"), (POOL_VIEW, "1", "iterAllocTotalBlocks")}
    d = div[0]
    assert (d["dpRank"], d["tpRank"], d["expected"], d["got"]) == (0, 1, 4, 5)
    assert m.views[WINDOW_VIEW]["512"]["iterAllocTotalBlocks"] == 4


def test_keys_unioned_and_missing_tp0_substitutes_gauges_only():
    a = make_report(counters={"iterAllocTotalBlocks": 2}, gauges={"primaryMaxNumBlocks": 10})
    del a[WINDOW_VIEW]["1024"]
    b = make_report(counters={"iterAllocTotalBlocks": 3}, gauges={"primaryMaxNumBlocks": 20})
    b[WINDOW_VIEW]["4096"] = dict(b[WINDOW_VIEW].pop("512"))
    # dp 0 reports rank 0 (tp 0); dp 1 only its tp rank 1 (rank 3), tp rank 0 (rank 2) is missing
    m = merge_iteration([message(0, 1, 0, tp=2, report=a), message(3, 1, 0, tp=2, report=b)])
    assert set(m.views[WINDOW_VIEW]) == {"512", "1024", "4096"}
    assert list(m.views[WINDOW_VIEW]) == ["512", "1024", "4096"]  # numeric order
    assert m.views[WINDOW_VIEW]["1024"]["primaryMaxNumBlocks"] == 20  # from tp rank 1 of dp 1
    assert m.views[WINDOW_VIEW]["4096"]["iterAllocTotalBlocks"] == 0  # block counts: tp rank 0 only


def test_tokens_per_block_mismatch_is_an_error_in_the_record():
    m = merge_iteration([message(0, 1, 0, stats=kv_stats(tokens_per_block=16)),
                         message(1, 1, 0, stats=kv_stats(tokens_per_block=32))])
    assert m.errors and m.errors[0]["field"] == "tokensPerBlock"
    assert m.errors[0]["byRank"] == {"0": 16, "1": 32}


def test_fold_rank_messages_sums_counters_keeps_newer_gauges_max_peaks():
    a = message(0, 3, 7, report=make_report(counters={"iterAllocTotalBlocks": 2, "iterReusedBlocks": 1},
                                            gauges={"primaryFreeNumBlocks": 5, "primaryPeakUsedNumBlocks": 9}),
                stats=kv_stats({"allocTotalBlocks": 10}))
    b = message(0, 4, 8, report=make_report(counters={"iterAllocTotalBlocks": 3, "iterMissedBlocks": 3},
                                            gauges={"primaryFreeNumBlocks": 4, "primaryPeakUsedNumBlocks": 6}),
                stats=kv_stats({"allocTotalBlocks": 13}))
    f = fold_rank_messages(a, b)
    w = f["report"][WINDOW_VIEW]["512"]
    assert w["iterAllocTotalBlocks"] == 5 and w["primaryFreeNumBlocks"] == 4 and w["primaryPeakUsedNumBlocks"] == 9
    assert w["iterCacheHitRate"] == pytest.approx(1 / 4)
    assert (f["seq"], f["iteration"], f["iterations"], f["merged_seqs"]) == (8, 4, [3, 4], [7])
    assert f["kv_cache_stats"]["allocTotalBlocks"] == 13
    g = fold_rank_messages(f, message(0, 6, 9))
    assert g["iterations"] == [3, 6] and g["merged_seqs"] == [7, 8]
    with pytest.raises(ValueError):
        fold_rank_messages(a, message(1, 4, 8))


def _snap(rank, inc, seq, alloc, tp=1, ts=None, **gauges):
    m = message(rank, seq, seq, tp=tp, incarnation=inc, timestamp=ts if ts is not None else 1000 + seq,
                stats={**kv_stats({"allocTotalBlocks": alloc, "reusedBlocks": alloc, "missedBlocks": 1}), **gauges})
    return m


def test_cluster_cumulative_survives_rank_restart_and_dedupes_tp():
    c = ClusterCumulative()
    c.update(_snap(0, "a", 0, 5, tp=2))
    c.update(_snap(1, "b", 0, 5, tp=2))  # tp rank 1: not counted twice
    c.update(_snap(2, "c", 0, 7, tp=2))
    assert c.stats()["allocTotalBlocks"] == 12
    c.update(_snap(0, "a", 3, 9, tp=2))
    c.update(_snap(0, "a", 2, 8, tp=2))  # an older snapshot arriving late changes nothing
    assert c.stats()["allocTotalBlocks"] == 16
    c.update(_snap(0, "a2", 0, 1, tp=2, ts=5000))  # rank 0 restarted: counts from 0 again
    s = c.stats()
    assert s["allocTotalBlocks"] == 9 + 1 + 7
    assert s["cacheHitRate"] == pytest.approx(17 / 20)  # missed: 1 per counted snapshot
    assert s["tokensPerBlock"] == 16
    c.update(_snap(0, "a", 4, 10, tp=2, ts=1004))  # old incarnation's last message, reordered
    assert c.stats()["allocTotalBlocks"] == 10 + 1 + 7
    # state round trip (aggregator restart)
    d = ClusterCumulative.from_state(c.to_state())
    assert d.stats() == c.stats()


def test_cluster_cumulative_never_goes_backwards_and_banks_old_incarnations():
    c = ClusterCumulative()
    c.floor["allocTotalBlocks"] = 100  # restored after an aggregator restart, ranks not re-sent yet
    c.update(_snap(0, "x", 0, 40))
    assert c.stats()["allocTotalBlocks"] == 100
    for i in range(ClusterCumulative.max_incarnations + 3):
        c.update(_snap(0, f"inc{i}", 0, 30, ts=2000 + i))
    assert c.stats()["allocTotalBlocks"] == 40 + 30 * (ClusterCumulative.max_incarnations + 3)
    assert len(c.ranks[0].snapshots) == ClusterCumulative.max_incarnations
    assert c.stats()["freeNumBlocks"] == 32  # gauges from the current incarnation


def test_merge_accepts_engine_shaped_message():
    m = merge_iteration([message(0, 0, 0, engine_id=ENGINE)])
    assert set(m.views) == {WINDOW_VIEW, POOL_VIEW, LIFECYCLE_VIEW}


def test_cluster_gauges_come_from_each_groups_lowest_tp_rank_as_it_appears():
    c = ClusterCumulative()
    c.update(_snap(1, "b", 0, 0, tp=2, maxNumBlocks=10))  # dp 0: only tp rank 1 so far
    c.update(_snap(2, "c", 0, 0, tp=2, maxNumBlocks=100))  # dp 1: tp rank 0
    assert c.stats()["maxNumBlocks"] == 110
    c.update(_snap(0, "a", 0, 0, tp=2, maxNumBlocks=20))  # dp 0's tp rank 0 appears: it counts now
    assert c.stats()["maxNumBlocks"] == 120
    c.update(_snap(1, "b", 1, 0, tp=2, maxNumBlocks=99))  # tp rank 1 no longer counts
    c.update(_snap(2, "c", 1, 0, tp=2, maxNumBlocks=50))
    assert c.stats()["maxNumBlocks"] == 70
    d = ClusterCumulative.from_state(c.to_state())
    assert d.stats()["maxNumBlocks"] == 70
