"""The merge rules of one iteration: fast (arrays) equals the reference (bucket by bucket); tp and dp rules."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.delta import KV_STATS, SCHED
from aggregator.merge import merge
from tests.support.aggregator_support import FakeCluster, reference_merge, rows_of


@settings(max_examples=60, deadline=None)
@given(dp=st.integers(1, 4), tp=st.integers(1, 3), seed=st.integers(0, 2**32), data=st.data())
def test_fast_merge_equals_the_reference(dp, tp, seed, data):
    shapes = data.draw(st.lists(st.integers(0, 2), min_size=dp, max_size=dp))
    cluster = FakeCluster(dp, tp, seed, shapes)
    missing = set(data.draw(st.lists(st.integers(0, dp * tp - 1), max_size=dp * tp - 1, unique=True)))
    it = cluster.iteration(0, missing)
    merged = merge(rows_of(cluster, it))
    assert merged.views == reference_merge(rows_of(cluster, it))
    assert merged.tp_divergence == []  # fake tp ranks agree on every block field
    assert merged.errors == []


def test_block_counters_from_tp_rank_0_bytes_from_all_and_dp_groups_summed():
    cluster = FakeCluster(2, 2, seed=1)
    it = cluster.iteration(0)
    layouts = {lay.rank: lay for lay in cluster.layouts}
    bucket = merge(rows_of(cluster, it)).views["kvCacheIterationStats"]["4096"]
    rows = {d.rank: layouts[d.rank].parts(d.row)[0][0] for d in it.deltas}  # life cycle 0's counters
    assert bucket["iterAllocTotalBlocks"] == rows[0][0] + rows[2][0]
    assert bucket["iterOnboardBytes"] == sum(r[8] for r in rows.values())


def test_a_tp_rank_that_disagrees_is_listed_and_does_not_count():
    cluster = FakeCluster(1, 2, seed=2)
    it = cluster.iteration(0)
    layouts = {lay.rank: lay for lay in cluster.layouts}
    other = it.deltas[1].row.copy()
    other[0] += 1  # tp rank 1's iterAllocTotalBlocks of life cycle 0
    merged = merge([(layouts[0], it.deltas[0].row), (layouts[1], other)])
    (div,) = merged.tp_divergence
    assert div["tpRank"] == 1 and div["field"] == "iterAllocTotalBlocks" and div["got"] == div["expected"] + 1
    assert merged.views == merge(rows_of(cluster, it)).views


def test_tokens_per_block_must_agree():
    cluster = FakeCluster(2, 1, seed=3)
    cluster.ranks[1].tpb = 32
    cluster.ranks[1].restart()
    merged = merge(rows_of(cluster, cluster.iteration(0)))
    assert merged.errors[0]["values"] == [16, 32]


def test_scheduler_figures_latency_is_the_slowest_rank_memory_every_rank_groups_summed():
    cluster = FakeCluster(2, 2, seed=4)
    it = cluster.iteration(0)
    layouts = {lay.rank: lay for lay in cluster.layouts}
    sched = {d.rank: dict(zip(SCHED, layouts[d.rank].parts(d.row)[3].tolist(), strict=True)) for d in it.deltas}
    merged = merge(rows_of(cluster, it)).sched
    assert merged["stepUs"] == max(s["stepUs"] for s in sched.values())
    assert merged["cpuMemUsage"] == sum(s["cpuMemUsage"] for s in sched.values())
    assert merged["numCtxTokens"] == sched[0]["numCtxTokens"] + sched[2]["numCtxTokens"]


def test_rows_are_one_int64_buffer():
    d = FakeCluster(1, 1).iteration(0).deltas[0]
    assert d.row.dtype == np.int64 and d.row.shape == (FakeCluster(1, 1).layouts[0].row_size,)
    assert len(d.row) > len(KV_STATS) + len(SCHED)


@settings(max_examples=30, deadline=None)
@given(dp=st.integers(1, 4), tp=st.integers(1, 3), shape=st.integers(0, 2), seed=st.integers(0, 2**32))
def test_the_array_path_equals_the_general_path(dp, tp, shape, seed):
    from aggregator.merge import _merge_general, _merge_uniform, _uniform

    cluster = FakeCluster(dp, tp, seed, [shape] * dp)
    rows = rows_of(cluster, cluster.iteration(0))
    assert _uniform(rows)
    assert _merge_uniform(rows) == _merge_general(rows)
