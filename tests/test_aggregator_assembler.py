"""Records from iterations: fields, duplicates, rejected deltas, missing ranks, cumulative totals."""

import pytest

from aggregator.assembler import Assembler
from aggregator.delta import Iteration, RankDelta
from tests.aggregator_support import FakeCluster

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
