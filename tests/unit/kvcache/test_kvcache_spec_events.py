"""Spec review of `kvcache/`, second half: section 3's events, gauges, peaks and hit rate, close(), and
section 4's JSON shapes (see test_kvcache_spec_review.py for how these tests are written)."""


import pytest

from tests.support.kvcache_helpers import run_prompt, spec_manager
from tests.support.spec_review_support import (
    GAUGES,
    ITER_FIELDS,
    LIFE_CYCLE_KEYS,
    POOL_GROUP_KEYS,
    bucket,
    delta_tuple,
    nz,
    prefilled,
    report,
    tiny_mgr,
)


# ---- section 3: events ------------------------------------------------------------------------------------
def test_two_life_cycles_count_twice():
    mgr = tiny_mgr([(None, 0, 1), (8, 0, 1)], primary_slots=8)  # equal slot size: one pool group
    kv = prefilled(mgr, "a", 8, 8)
    assert delta_tuple(kv.commit_pending_stats()) == (4, 4, 0, 4)
    d = report(mgr)
    assert d["kvCacheIterationStats"]["64"]["iterMissedBlocks"] == 2
    assert d["kvCacheIterationStats"]["8"]["iterMissedBlocks"] == 2
    assert d["kvCacheIterationStatsByPoolGroup"]["0"]["iterAllocTotalBlocks"] == 4
    assert mgr.get_kv_cache_stats().to_dict()["missedBlocks"] == 4


def test_two_life_cycles_copy_the_partial_block_twice():
    mgr = tiny_mgr([(None, 0, 1), (None, 0, 2)], primary_slots=8)  # one life cycle: shapes are equal
    assert len(report(mgr)["kvCacheIterationStatsByLifecycle"]) == 1
    mgr = tiny_mgr([(None, 0, 1), (32, 0, 2)], primary_slots=8)  # two life cycles, two pool groups
    slot0, slot1 = 2 * 4 * 16, 2 * 4 * 32
    prompt = list(range(12))
    run_prompt(mgr, "a", prompt)
    mgr.get_iteration_stats()
    kv = mgr.create_kv_cache("b", prompt[:10])
    assert kv.num_reused_tokens == 9 and kv.resume()
    assert delta_tuple(kv.commit_pending_stats()) == (2, 2, 6, 0)
    d = report(mgr)
    pgs = d["kvCacheIterationStatsByPoolGroup"]
    assert (pgs["0"]["iterIntraDeviceCopyBlocks"], pgs["0"]["iterIntraDeviceCopyBytes"]) == (1, slot0)
    assert (pgs["1"]["iterIntraDeviceCopyBlocks"], pgs["1"]["iterIntraDeviceCopyBytes"]) == (1, slot1)
    lcs = d["kvCacheIterationStatsByLifecycle"]
    assert [lcs[i]["iterPartialReusedBlocks"] for i in ("0", "1")] == [1, 1]


def test_stale_range_with_sink_tokens_at_every_history_length():
    B, w, sinks = 4, 8, 5
    mgr = tiny_mgr([(w, sinks, 1)], primary_slots=16)
    kv = mgr.create_kv_cache("a", list(range(40)))
    assert kv.resize(40)
    sink_blocks = -(-sinks // B)
    for h in range(1, 41):
        kv.commit([h])
        nb = -(-h // B)
        start = min(nb, sink_blocks)
        stale = set(range(start, max(start, (h + 1 - w) // B)))
        ids = kv.block_ids(0)
        assert {o for o, i in enumerate(ids) if i < 0} == stale, h
    kv.close()


def test_sliding_window_reuse_counts_only_non_stale_blocks_and_sinks():
    w, sinks = 8, 4
    mgr = tiny_mgr([(w, sinks, 1)], primary_slots=16)
    prompt = list(range(32))
    run_prompt(mgr, "a", prompt)
    mgr.get_iteration_stats()
    kv = mgr.create_kv_cache("b", prompt + [99])
    assert kv.num_reused_tokens == 32
    # at h=32: stale [1, (33-8)//4) = [1, 6): the sink block 0 and blocks 6, 7 are reused
    assert delta_tuple(kv.commit_pending_stats()) == (0, 0, 3, 0)
    assert kv.resume()
    assert [i < 0 for i in kv.block_ids(0)] == [False] + [True] * 5 + [False] * 2


def test_offload_onboard_and_host_drop_records():
    mgr = tiny_mgr([(None, 0, 1)], primary_slots=2, host_slots=4)
    slot = 2 * 4 * 16
    kv = prefilled(mgr, "a", 8, 8)
    kv.commit_pending_stats()
    kv.suspend()
    mgr.get_iteration_stats()
    other = mgr.create_kv_cache("b", list(range(50, 58)))
    assert other.resize(8)
    assert delta_tuple(other.commit_pending_stats()) == (2, 2, 0, 2)
    b = bucket(mgr, "64")
    assert (b["iterOffloadBlocks"], b["iterOffloadBytes"]) == (2, 2 * slot)
    assert (b["secondaryUsedNumBlocks"], b["secondaryMaxNumBlocks"]) == (2, 4)
    other.close()
    assert kv.resume()
    # onboard: alloc_total/new += 1 each, not a miss, straight into the totals (not the request delta)
    assert delta_tuple(kv.commit_pending_stats()) == (0, 0, 0, 0)
    b = bucket(mgr, "64")
    assert nz(b) == {"iterOnboardBlocks": 2, "iterOnboardBytes": 2 * slot, "iterAllocTotalBlocks": 2,
                     "iterAllocNewBlocks": 2}, nz(b)
    s = mgr.get_kv_cache_stats()
    assert (s.alloc_total_blocks, s.alloc_new_blocks, s.missed_blocks) == (6, 6, 4)
    kv.close()
    # each new request evicts the previous one's 2 published blocks to the 4-slot host tier; the third
    # eviction finds the host tier full of evictable blocks and drops its 2 LRU ones (a's)
    for i, rid in enumerate("cde"):
        run_prompt(mgr, rid, list(range(60 + 10 * i, 68 + 10 * i)))
    b = bucket(mgr, "64")
    assert (b["iterOffloadBlocks"], b["iterOffloadBytes"]) == (6, 6 * slot)
    assert (b["iterHostDroppedBlocks"], b["iterHostDroppedBytes"]) == (2, 2 * slot)
    assert mgr.create_kv_cache("probe", list(range(8)) + [1]).num_reused_tokens == 0, "a's blocks are gone"


def test_alloc_new_equals_alloc_total_everywhere():
    mgr = tiny_mgr([(None, 0, 1)], primary_slots=2, host_slots=2)
    for i in range(4):
        run_prompt(mgr, f"r{i}", [i * 10 + j for j in range(8)])
    kv = mgr.create_kv_cache("x", list(range(8)) + [5])
    kv.resume()
    kv.commit_pending_stats()
    d = report(mgr)
    for b in d["kvCacheIterationStats"].values():
        assert b["iterAllocNewBlocks"] == b["iterAllocTotalBlocks"]
    s = mgr.get_kv_cache_stats()
    assert s.alloc_new_blocks == s.alloc_total_blocks


# ---- section 3: gauges, peaks, hit rate ---------------------------------------------------------------------
def test_gauges_free_includes_evictable():
    mgr = spec_manager()
    kv = prefilled(mgr, "a", 8, 8)
    b = bucket(mgr)
    assert (b["primaryMaxNumBlocks"], b["primaryFreeNumBlocks"], b["primaryUsedNumBlocks"],
            b["primaryEvictableNumBlocks"]) == (4, 2, 2, 0)
    kv.close()
    b = bucket(mgr)
    assert (b["primaryFreeNumBlocks"], b["primaryUsedNumBlocks"], b["primaryEvictableNumBlocks"]) == (4, 0, 2)
    s = mgr.get_kv_cache_stats().to_dict()
    assert (s["freeNumBlocks"], s["usedNumBlocks"]) == (4, 0)
    assert b["secondaryMaxNumBlocks"] == 0


def test_peak_used_is_sampled_when_a_reuse_match_takes_evictable_blocks():
    mgr = spec_manager()
    run_prompt(mgr, "a", list(range(8)))  # 2 evictable blocks, 0 used
    mgr.get_iteration_stats()
    mgr.get_iteration_stats()  # peaks re-seeded: used 0
    kv = mgr.create_kv_cache("b", list(range(8)) + [9])  # holds both blocks: used 2
    assert kv.num_reused_tokens == 8
    assert mgr.get_kv_cache_stats().used_num_blocks == 2
    kv.commit_pending_stats()  # a stats commit samples the peaks
    kv.close()
    b = bucket(mgr)
    assert b["primaryUsedNumBlocks"] == 0
    assert b["primaryPeakUsedNumBlocks"] == 2


def test_peaks_sampled_at_commit_and_reseeded_at_drain():
    mgr = spec_manager()
    kv = prefilled(mgr, "a", 12, 12)
    kv.commit_pending_stats()
    kv.close()
    b = bucket(mgr)
    assert (b["primaryUsedNumBlocks"], b["primaryPeakUsedNumBlocks"]) == (0, 3)
    assert b["primaryPeakEvictableNumBlocks"] == 3 and b["primaryPeakFreeNumBlocks"] == 4
    b = bucket(mgr)
    assert (b["primaryPeakUsedNumBlocks"], b["primaryPeakEvictableNumBlocks"]) == (0, 3), "re-seeded from now"


def test_hit_rate_rule():
    mgr = spec_manager()
    run_prompt(mgr, "a", list(range(8)))
    kv = mgr.create_kv_cache("b", list(range(8)) + [1, 2, 3, 4, 5])
    assert kv.num_reused_tokens == 8 and kv.resize(13)
    kv.commit([1, 2, 3, 4, 5])
    kv.commit_pending_stats()
    b = bucket(mgr)  # drained over a (2 missed) and b (2 reused + 2 missed)
    assert (b["iterReusedBlocks"], b["iterMissedBlocks"]) == (2, 4)
    assert b["iterCacheHitRate"] == pytest.approx(2 / 6)
    assert mgr.get_kv_cache_stats().to_dict()["cacheHitRate"] == pytest.approx(2 / 6)
    b = bucket(mgr)
    assert b["iterCacheHitRate"] == 0.0 and isinstance(b["iterCacheHitRate"], float)


# ---- close() ----------------------------------------------------------------------------------------------
def test_close_discards_pending_and_releases_everything():
    mgr = spec_manager()
    kv = prefilled(mgr, "a", 8, 8)
    kv.close()  # never committed stats
    s = mgr.get_kv_cache_stats()
    assert (s.alloc_total_blocks, s.missed_blocks, s.used_num_blocks, s.free_num_blocks) == (0, 0, 0, 4)
    assert nz(bucket(mgr)) == {}


# ---- section 4: JSON shapes -------------------------------------------------------------------------------
def test_window_bucket_has_exactly_16_iteration_fields_and_14_gauges():
    mgr = spec_manager()
    d = report(mgr)
    assert set(d) == {"kvCacheIterationStats", "kvCacheIterationStatsByPoolGroup",
                      "kvCacheIterationStatsByLifecycle"}
    assert list(d["kvCacheIterationStats"]) == ["16"]
    b = d["kvCacheIterationStats"]["16"]
    assert set(b) == ITER_FIELDS | GAUGES and len(b) == 30
    assert all(isinstance(v, int) for k, v in b.items() if k != "iterCacheHitRate")


def test_window_key_is_max_seq_len_for_full_attention_and_big_windows():
    mgr = tiny_mgr([(None, 0, 1), (64, 0, 1), (100, 0, 1), (8, 0, 1)], primary_slots=4)
    d = report(mgr)
    assert set(d["kvCacheIterationStats"]) == {"64", "8"}
    lcs = d["kvCacheIterationStatsByLifecycle"]
    assert {k: (v["windowSize"], v["kind"]) for k, v in lcs.items()} == {
        "0": (64, "attention"), "1": (8, "attention")}


def test_pool_group_and_life_cycle_views():
    mgr = tiny_mgr([(8, 0, 1), (None, 0, 2), (16, 0, 1)], primary_slots=4)
    d = report(mgr)
    lcs = d["kvCacheIterationStatsByLifecycle"]
    assert list(lcs) == ["0", "1", "2"], "dense ids from 0 in layer order, as JSON strings"
    for key, lc in lcs.items():
        assert set(lc) == LIFE_CYCLE_KEYS
        assert lc["lifeCycleId"] == int(key)
    assert [lcs[i]["windowSize"] for i in ("0", "1", "2")] == [8, 64, 16]
    pgs = d["kvCacheIterationStatsByPoolGroup"]
    assert len(pgs) == 2
    for key, pg in pgs.items():
        assert set(pg) == POOL_GROUP_KEYS, set(pg) ^ POOL_GROUP_KEYS
        assert pg["poolGroupId"] == int(key)
    shared = next(pg for pg in pgs.values() if len(pg["windowSizes"]) == 2)
    assert shared["windowSizes"] == [8, 16] and shared["slotSize"] == 2 * 4 * 16
    alone = next(pg for pg in pgs.values() if len(pg["windowSizes"]) == 1)
    assert alone["windowSizes"] == [64] and alone["slotSize"] == 2 * 4 * 32
    assert lcs["1"]["poolGroupId"] == alone["poolGroupId"]
    buckets = d["kvCacheIterationStats"]
    assert buckets["64"]["primaryMaxNumBlocks"] == alone["primaryMaxNumBlocks"] > 0
    assert buckets["8"]["primaryMaxNumBlocks"] == 0 and buckets["16"]["primaryMaxNumBlocks"] == 0


def test_report_ids_answer_to_int_keys_before_serialisation():
    mgr = spec_manager()
    d = mgr.get_iteration_stats().to_dict()
    assert d["kvCacheIterationStats"]["16"] == d["kvCacheIterationStats"][16]
    assert d["kvCacheIterationStatsByPoolGroup"]["0"] is d["kvCacheIterationStatsByPoolGroup"][0]
    assert d["kvCacheIterationStatsByLifecycle"]["0"]["kind"]


def test_drain_resets_the_deltas():
    mgr = spec_manager()
    run_prompt(mgr, "a", list(range(8)))
    assert nz(bucket(mgr))
    assert nz(bucket(mgr)) == {}


def test_life_cycle_kind_is_the_trtllm_value():
    """The spec does not define `kind`; TensorRT-LLM's V2 report writes "attention" for every attention life
    cycle (sliding or not; "ssm" is its other kind), and the spec says to do what its users expect."""
    mgr = tiny_mgr([(None, 0, 1), (8, 0, 1)], primary_slots=4)
    lcs = report(mgr)["kvCacheIterationStatsByLifecycle"]
    assert [lcs[i]["kind"] for i in ("0", "1")] == ["attention", "attention"]
