"""Records from iterations: fields, duplicates, rejected deltas, missing ranks, cumulative totals."""

import pytest

from aggregator.assembler import Assembler
from aggregator.delta import Iteration, RankDelta
from tests.support.aggregator_support import FakeCluster

TRT_FIELDS = {"iterLatencyMS", "numActiveRequests", "numQueuedRequests", "numCompletedRequests",
              "numNewActiveRequests", "maxNumActiveRequests", "gpuMemUsage", "cpuMemUsage", "pinnedMemUsage",
              "inflightBatchingStats", "iterSuspendedRequests", "iterResumedRequests", "kvCacheLevelTiers",
              "iterCachedTokensByLevel"}

def assembler(cluster: FakeCluster) -> Assembler:
    asm = Assembler("e", cluster.dp * cluster.tp, cluster.tp)
    asm.register(cluster.layouts)
    return asm

def test_a_record_is_a_complete_iteration_stats_object():
    cluster = FakeCluster(2, 2)
    (rec,) = assembler(cluster).ingest([cluster.iteration(0)])
    assert TRT_FIELDS <= set(rec)
    assert rec["complete"] and rec["reportedRanks"] == [0, 1, 2, 3] and rec["missingRanks"] == []
    assert set(rec["inflightBatchingStats"]) == {"numScheduledRequests", "numContextRequests", "numGenRequests",
                                                 "numPausedRequests", "numCtxTokens", "avgNumDecodedTokensPerIter"}
    assert rec["numActiveRequests"] == 2 and rec["iterLatencyMS"] > 0
    assert rec["timestamp"].endswith("Z") and rec["aggregatorEpoch"] == 1

def test_ranks_the_engine_knows_are_down_are_named_at_once():
    cluster = FakeCluster(2, 1)
    (rec,) = assembler(cluster).ingest([cluster.iteration(0, missing={1})])
    assert rec["missingRanks"] == [1] and not rec["complete"] and rec["reportedRanks"] == [0]

def test_an_iteration_sent_twice_is_counted_once():
    cluster = FakeCluster(1, 2)
    asm = assembler(cluster)
    its = [cluster.iteration(i) for i in range(3)]
    assert [r["iter"] for r in asm.ingest(its[:2])] == [0, 1]
    assert [r["iter"] for r in asm.ingest(its)] == [2]
    assert asm.counts["duplicates"] == 4 and asm.counts["records"] == 3

def test_bad_deltas_are_rejected_with_a_reason_and_the_others_kept():
    cluster = FakeCluster(2, 1)
    asm = assembler(cluster)
    good = cluster.iteration(0).deltas
    bad = [RankDelta(1, "someone-else", good[1].row), RankDelta(0, good[0].incarnation, good[0].row[:3])]
    (rec,) = asm.ingest([Iteration(0, 0.0, [good[0], *bad])])
    assert rec["reportedRanks"] == [0] and len(rec["errors"]) == 2 and asm.counts["rejected"] == 2
    with pytest.raises(ValueError, match="Iteration"):
        asm.ingest([{"iteration": 1}])
    with pytest.raises(ValueError, match=r"a rank in \[0, 2\)"):
        asm.register([cluster.layouts[0].__class__(7, 0, 0, "x", (), ())])

def test_emitted_counters_add_up_to_the_cumulative_across_rank_restarts_and_never_go_backwards():
    cluster = FakeCluster(2, 2, seed=5)
    asm = assembler(cluster)
    records = []
    for i in range(30):
        if i in (10, 20):
            for r in cluster.ranks[:2]:  # dp group 0 restarts: new incarnations, counters from zero
                r.restart()
            asm.register(cluster.layouts[:2])
        records += asm.ingest([cluster.iteration(i)])
    final = records[-1]["kvCacheStats"]
    for field, key in (("iterAllocTotalBlocks", "allocTotalBlocks"), ("iterReusedBlocks", "reusedBlocks"),
                       ("iterMissedBlocks", "missedBlocks")):
        assert sum(b[field] for r in records for b in r["kvCacheIterationStats"].values()) == final[key]
        series = [r["kvCacheStats"][key] for r in records]
        assert series == sorted(series)

def test_checkpoint_round_trip_continues_the_totals():
    cluster = FakeCluster(1, 1)
    asm = assembler(cluster)
    asm.ingest([cluster.iteration(i) for i in range(3)])
    again = Assembler("e", 1, 1, epoch=2)
    again.restore(asm.checkpoint(), cluster.layouts)
    assert again.ingest([cluster.iteration(2)]) == []  # already counted
    (rec,) = again.ingest([cluster.iteration(3)])
    assert rec["aggregatorEpoch"] == 2 and rec["kvCacheStats"]["allocTotalBlocks"] >= \
        asm.cumulative.stats()["allocTotalBlocks"]

def _conserved(records, before):
    """Per record: the change of the cumulative counters minus the record's summed iteration counters (FakeRank
    keeps allocNewBlocks on the iterAllocTotalBlocks column, so allocNew is checked against it)."""
    fields = (("iterAllocTotalBlocks", "allocTotalBlocks"), ("iterAllocTotalBlocks", "allocNewBlocks"),
              ("iterReusedBlocks", "reusedBlocks"), ("iterMissedBlocks", "missedBlocks"))
    off = []
    for rec in records:
        cum = rec["kvCacheStats"]
        diff = {key: cum[key] - before[key] - sum(b[f] for b in rec["kvCacheIterationStats"].values())
                for f, key in fields}
        if any(diff.values()):
            off.append((rec["iter"], diff))
        before = cum
    return off

@pytest.mark.parametrize("register_first", [False, True])
def test_a_killed_tp_rank_0_whose_tp_peer_still_reports_loses_no_count(register_first):
    # the chaos soak's iteration 14655 (dp 2 x tp 2): rank 2 (dp 1's tp rank 0) is killed mid-step, rank 3 (tp 1)
    # finishes that step and its delta is the group's reference in the merge (the lowest tp rank present); the
    # cumulative must grow by rank 3's counters then, although rank 2's incarnation never reports again
    cluster = FakeCluster(2, 2, seed=11)
    asm = assembler(cluster)
    before = asm.cumulative.stats()
    records = asm.ingest([cluster.iteration(i) for i in range(5)])
    dying = cluster.iteration(5, missing={2})  # rank 3's delta only, for dp 1
    for r in cluster.ranks[2:]:  # dp 1 restarts: new incarnations, cumulative counters from zero
        r.restart()
    if register_first:  # the restarted group's registration may reach the aggregator before the dying iteration
        asm.register(cluster.layouts[2:])
        records += asm.ingest([dying])
    else:
        records += asm.ingest([dying])
        asm.register(cluster.layouts[2:])
    records += asm.ingest([cluster.iteration(6, missing={2, 3})])  # the group is down
    records += asm.ingest([cluster.iteration(i) for i in range(7, 12)])
    assert records[5]["missingRanks"] == [2] and records[5]["reportedRanks"] == [0, 1, 3]
    assert _conserved(records, before) == []
    series = [r["kvCacheStats"]["allocTotalBlocks"] for r in records]
    assert series == sorted(series)
    assert len(asm.cumulative.last) == 4  # one snapshot per rank: the dead incarnations are forgotten

def test_a_tp_peer_that_becomes_the_reference_is_counted_from_its_own_last_snapshot():
    # rank 3 gives no delta in iteration 3, then rank 2 is gone in iteration 4 and rank 3 stands for the group:
    # the cumulative grows by what rank 3 counted since its own last delta, not since rank 2's
    cluster = FakeCluster(2, 2, seed=3)
    asm = assembler(cluster)
    before = asm.cumulative.stats()
    its = [cluster.iteration(i) for i in range(3)]
    its.append(cluster.iteration(3, missing={3}))
    its.append(cluster.iteration(4, missing={2}))
    records = asm.ingest(its)
    assert _conserved(records, before) == []

def test_checkpoint_round_trip_keeps_every_tp_ranks_last_snapshot():
    cluster = FakeCluster(1, 2, seed=4)
    asm = assembler(cluster)
    before = asm.cumulative.stats()
    records = asm.ingest([cluster.iteration(i) for i in range(3)])
    again = Assembler("e", 2, 2, epoch=2)
    again.restore(asm.checkpoint(), cluster.layouts)
    records += again.ingest([cluster.iteration(3, missing={0})])
    assert _conserved(records, before) == []


def test_a_superseded_incarnations_layout_is_forgotten_once_no_kept_detail_names_it():
    # repro 07 at the assembler: a rank's incarnations registered before the one that reports never report again;
    # their layouts go once the rank details kept (here the last 3 iterations) no longer name them
    cluster = FakeCluster(2, 2, seed=2)
    asm = assembler(cluster)
    asm.ingest([cluster.iteration(0)])
    old = {(lay.rank, lay.incarnation) for lay in cluster.layouts[:2]}
    dying = cluster.iteration(1)  # the old incarnations' last deltas, emitted after the new ones registered
    for r in cluster.ranks[:2]:
        r.restart()
    never = (0, cluster.ranks[0].layout.incarnation)
    asm.register(cluster.layouts[:2])
    cluster.ranks[0].restart()  # rank 0 restarts again before it ever reported: `never` never will
    asm.register(cluster.layouts[:1])
    asm.ingest([dying])
    asm.forget_layouts(None)
    assert old <= set(asm.layouts) and len(asm.layouts) == 7  # the new ones have not reported yet: all kept
    for i in range(2, 6):
        asm.ingest([cluster.iteration(i)])
        asm.forget_layouts(i - 2)
        assert (old <= set(asm.layouts)) == (i < 4), i  # details of iteration 1 kept up to iteration 3
    assert never not in asm.layouts and set(asm.layouts) == {(lay.rank, lay.incarnation) for lay in cluster.layouts}
