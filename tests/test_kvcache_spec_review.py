"""Spec review of `kvcache/`: SPEC-kv-stats.md read sentence by sentence, written as the acceptance tests a
careful reader of the spec would write. They use only the spec's API (no private attributes), follow the worked
examples literally (no `resume()` where the example has none) and read JSON after a `json` round trip, as a
dashboard would.
"""

import dataclasses
import json

import pytest
import torch

from kvcache import (
    AttentionLayerConfig,
    KvCacheIterationReport,
    KVCacheManager,
    KVCacheManagerConfig,
    KvCacheStats,
    KVCacheStatsDelta,
)
from tests.kvcache_helpers import run_prompt, spec_manager

SLOT = 2 << 20  # the worked examples' slot: 2 * 4 tokens * 128 heads * 1024 dims * 2 bytes

ITER_FIELDS = {
    "iterAllocTotalBlocks", "iterAllocNewBlocks", "iterReusedBlocks", "iterFullReusedBlocks",
    "iterPartialReusedBlocks", "iterMissedBlocks", "iterCacheHitRate", "iterGenAllocBlocks",
    "iterOnboardBlocks", "iterOnboardBytes", "iterOffloadBlocks", "iterOffloadBytes",
    "iterIntraDeviceCopyBlocks", "iterIntraDeviceCopyBytes", "iterHostDroppedBlocks", "iterHostDroppedBytes",
}
GAUGES = {f"{tier}{name}" for tier in ("primary", "secondary") for name in (
    "MaxNumBlocks", "FreeNumBlocks", "UsedNumBlocks", "EvictableNumBlocks", "PeakFreeNumBlocks",
    "PeakUsedNumBlocks", "PeakEvictableNumBlocks")}
POOL_GROUP_KEYS = {"poolGroupId", "slotSize", "windowSizes"} | GAUGES | {
    "iterAllocTotalBlocks", "iterAllocNewBlocks", "iterGenAllocBlocks", "iterOnboardBlocks", "iterOnboardBytes",
    "iterOffloadBlocks", "iterOffloadBytes", "iterIntraDeviceCopyBlocks", "iterIntraDeviceCopyBytes",
    "iterHostDroppedBlocks", "iterHostDroppedBytes"}
LIFE_CYCLE_KEYS = {"lifeCycleId", "poolGroupId", "windowSize", "kind", "iterReusedBlocks", "iterFullReusedBlocks",
                   "iterPartialReusedBlocks", "iterMissedBlocks", "iterCacheHitRate"}
KV_CACHE_STATS_KEYS = ["maxNumBlocks", "freeNumBlocks", "usedNumBlocks", "tokensPerBlock", "allocTotalBlocks",
                       "allocNewBlocks", "reusedBlocks", "missedBlocks", "cacheHitRate"]


# ---- builders -------------------------------------------------------------------------------------------
def tiny_mgr(layers, primary_slots, host_slots=0, B=4, max_seq_len=64, **kw) -> KVCacheManager:
    """Layers given as (window, sinks, heads); fp32 x 4 dims, so a slot is 2*B*heads*16 bytes a layer.
    Budgets are per life cycle (each life cycle gets `primary_slots` slots when the quota splits evenly)."""
    cfg_layers = [AttentionLayerConfig(layer_id=i, num_kv_heads=h, head_dim=4, dtype=torch.float32,
                                       window_size=w, num_sink_tokens=s) for i, (w, s, h) in enumerate(layers)]
    shapes = {}
    for w, s, h in layers:
        key = (None, 0) if w is None or w >= max_seq_len else (w, s)
        shapes[key] = shapes.get(key, 0) + 2 * B * h * 16
    per_unit = sum(shapes.values())
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=B, max_seq_len=max_seq_len, layers=cfg_layers,
        gpu_cache_bytes=primary_slots * per_unit, host_cache_bytes=host_slots * per_unit, **kw))


def report(mgr) -> dict:
    """The drained report as a dashboard sees it: after a JSON round trip."""
    rep = mgr.get_iteration_stats()
    assert isinstance(rep, KvCacheIterationReport)
    return json.loads(json.dumps(rep.to_dict()))


def bucket(mgr, key="16") -> dict:
    return report(mgr)["kvCacheIterationStats"][key]


def nz(d: dict) -> dict:
    return {k: v for k, v in d.items() if k.startswith("iter") and v}


def delta_tuple(d) -> tuple:
    return (d.alloc_total_blocks, d.alloc_new_blocks, d.reused_blocks, d.missed_blocks)


def prefilled(mgr, rid, prompt_len: int, done: int, **kw):
    """A request for prompt `range(prompt_len)` whose first `done` tokens are resized for and committed (no
    resume(): resize() resumes a fresh cache)."""
    kv = mgr.create_kv_cache(rid, list(range(prompt_len)), **kw)
    assert kv.resize(done)
    kv.commit(list(range(done)))
    return kv


# ---- section 2: API names, signatures, defaults, types -----------------------------------------------------
def test_config_defaults_and_keywords():
    cfg = KVCacheManagerConfig(tokens_per_block=4, max_seq_len=16,
                               layers=[AttentionLayerConfig(layer_id=0, num_kv_heads=1, head_dim=4)],
                               gpu_cache_bytes=1 << 20)
    assert (cfg.host_cache_bytes, cfg.enable_block_reuse, cfg.enable_partial_reuse, cfg.enable_stats,
            cfg.device) == (0, True, True, True, "cpu")
    layer = cfg.layers[0]
    assert (layer.dtype, layer.window_size, layer.num_sink_tokens) == (torch.float16, None, 0)


def test_create_kv_cache_positional_and_keyword_forms():
    mgr = spec_manager()
    a = mgr.create_kv_cache("a", list(range(8)), None, None, False)
    b = mgr.create_kv_cache(request_id="b", input_tokens=list(range(8)), expected_prompt_length=8,
                            cache_salt="s", exclude_from_stats=False)
    for kv in (a, b):
        assert (kv.num_reused_tokens, kv.history_length, kv.capacity) == (0, 0, 0)
        kv.close()


def test_kv_cache_stats_is_the_9_key_record():
    mgr = spec_manager()
    stats = mgr.get_kv_cache_stats()
    assert isinstance(stats, KvCacheStats)
    d = json.loads(json.dumps(stats.to_dict()))
    assert list(d) == KV_CACHE_STATS_KEYS
    assert d == {"maxNumBlocks": 4, "freeNumBlocks": 4, "usedNumBlocks": 0, "tokensPerBlock": 4,
                 "allocTotalBlocks": 0, "allocNewBlocks": 0, "reusedBlocks": 0, "missedBlocks": 0,
                 "cacheHitRate": 0.0}
    assert isinstance(d["cacheHitRate"], float)
    assert stats.cache_hit_rate == 0.0 and stats.max_num_blocks == 4 and stats.tokens_per_block == 4


def test_commit_pending_stats_returns_a_stats_delta_with_the_spec_fields():
    mgr = spec_manager()
    kv = prefilled(mgr, "r", 8, 8)
    delta = kv.commit_pending_stats()
    assert isinstance(delta, KVCacheStatsDelta)
    assert delta_tuple(delta) == (2, 2, 0, 2)
    assert dataclasses.astuple(delta) == (2, 2, 0, 2)
    assert delta == KVCacheStatsDelta(alloc_total_blocks=2, alloc_new_blocks=2, reused_blocks=0, missed_blocks=2)


def test_request_delta_reads_as_the_tuple_the_spec_prints():
    """Section 5 prints the request delta as a 4-tuple, `(alloc_total 2, alloc_new 2, reused 0, missed 2)`;
    a test may well unpack or compare it as one. TensorRT-LLM's delta also has `.empty`."""
    mgr = spec_manager()
    kv = prefilled(mgr, "r", 8, 8)
    delta = kv.commit_pending_stats()
    alloc_total, alloc_new, reused, missed = delta
    assert (alloc_total, alloc_new, reused, missed) == (2, 2, 0, 2)
    assert tuple(delta) == (2, 2, 0, 2)
    assert delta == (2, 2, 0, 2)
    assert kv.commit_pending_stats().empty and not delta.empty


# ---- section 5: the worked examples, literally (no resume() where the example has none) ------------------
@pytest.mark.parametrize("reuse", [True, False], ids=["example-1", "example-5-reuse-off"])
def test_example_1_literal(reuse):
    mgr = spec_manager(enable_block_reuse=reuse)
    kv = prefilled(mgr, "r", 8, 8)
    assert delta_tuple(kv.commit_pending_stats()) == (2, 2, 0, 2)
    assert nz(bucket(mgr)) == {"iterAllocTotalBlocks": 2, "iterAllocNewBlocks": 2, "iterMissedBlocks": 2}
    assert kv.resize(9)
    kv.commit([8])
    assert delta_tuple(kv.commit_pending_stats()) == (1, 1, 0, 0)
    assert nz(bucket(mgr)) == {"iterAllocTotalBlocks": 1, "iterAllocNewBlocks": 1, "iterGenAllocBlocks": 1}
    stats = mgr.get_kv_cache_stats().to_dict()
    assert (stats["allocTotalBlocks"], stats["allocNewBlocks"], stats["missedBlocks"]) == (3, 3, 2)
    assert (stats["usedNumBlocks"], stats["freeNumBlocks"]) == (3, 1)


def test_example_2_literal():
    mgr = spec_manager()
    kv = prefilled(mgr, "r", 8, 8)
    kv.commit_pending_stats()
    mgr.get_iteration_stats()
    assert kv.resize(9)
    assert kv.resize(8)
    assert delta_tuple(kv.commit_pending_stats()) == (0, 0, 0, 0)
    b = bucket(mgr)
    assert all(b[k] == 0 for k in ITER_FIELDS), nz(b)


# example 3 without resume() is test_kvcache_examples.py's test_example_3_chunked_context_with_revert[literal]


@pytest.mark.parametrize("partial,expected", [(True, 9), (False, 8)])
def test_example_4_literal(partial, expected):
    mgr = spec_manager(enable_partial_reuse=partial)
    prompt = list(range(12))
    kv = mgr.create_kv_cache("a", prompt)
    assert kv.resize(12)
    kv.commit(prompt)
    kv.commit_pending_stats()
    kv.close()
    kv2 = mgr.create_kv_cache("b", prompt[:10])
    assert kv2.num_reused_tokens == expected
    assert kv2.history_length == expected
    assert kv2.capacity >= expected


def partially_matched(mgr):
    """Example 4's second request: a 12-token request ran and closed, then one for its first 10 tokens (2 full
    blocks and 9 tokens matched); the first request's stats are drained."""
    prompt = list(range(12))
    run_prompt(mgr, "a", prompt, resume=False)
    mgr.get_iteration_stats()
    return mgr.create_kv_cache("b", prompt[:10])


def test_example_4_counts_then_first_resume_copies_the_partial_block():
    mgr = spec_manager()
    kv = partially_matched(mgr)
    assert kv.num_reused_tokens == 9
    assert nz(bucket(mgr)) == {}, "reuse is pending until commit_pending_stats()"
    assert kv.resume()
    assert delta_tuple(kv.commit_pending_stats()) == (1, 1, 3, 0)
    assert nz(bucket(mgr)) == {"iterAllocTotalBlocks": 1, "iterAllocNewBlocks": 1, "iterReusedBlocks": 3,
                               "iterFullReusedBlocks": 2, "iterPartialReusedBlocks": 1, "iterCacheHitRate": 1.0,
                               "iterIntraDeviceCopyBlocks": 1, "iterIntraDeviceCopyBytes": SLOT}
    kv.suspend()
    assert kv.resume()
    assert delta_tuple(kv.commit_pending_stats()) == (0, 0, 0, 0), "only the first resume copies"
    assert nz(bucket(mgr)) == {}


def test_partial_copy_made_by_an_implicit_resume_in_resize_counts_the_same():
    mgr = spec_manager()
    kv = partially_matched(mgr)
    assert kv.resize(10)
    kv.commit([9])
    assert delta_tuple(kv.commit_pending_stats()) == (1, 1, 3, 0)
    b = bucket(mgr)
    assert (b["iterIntraDeviceCopyBlocks"], b["iterIntraDeviceCopyBytes"]) == (1, SLOT)


# ---- section 2 rules ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("partial,expected", [(True, 7), (False, 4)])
def test_match_is_limited_to_all_but_the_last_prompt_token(partial, expected):
    mgr = spec_manager(enable_partial_reuse=partial)
    prompt = list(range(8))
    run_prompt(mgr, "a", prompt)
    kv = mgr.create_kv_cache("b", prompt)
    assert kv.num_reused_tokens == expected
    assert mgr.create_kv_cache("c", [0]).num_reused_tokens == 0


def test_trailing_partial_block_is_published_on_close():
    mgr = spec_manager()
    run_prompt(mgr, "a", list(range(6)))
    assert mgr.create_kv_cache("b", list(range(6)) + [99]).num_reused_tokens == 6
    off = spec_manager(enable_partial_reuse=False)
    run_prompt(off, "a", list(range(6)))
    assert off.create_kv_cache("b", list(range(6)) + [99]).num_reused_tokens == 4


def test_cache_salt_never_shares_blocks():
    mgr = spec_manager()
    prompt = list(range(8))
    run_prompt(mgr, "a", prompt, salt="x")
    assert mgr.create_kv_cache("b", prompt + [1], cache_salt="y").num_reused_tokens == 0
    assert mgr.create_kv_cache("c", prompt + [1]).num_reused_tokens == 0
    assert mgr.create_kv_cache("d", prompt + [1], cache_salt="x").num_reused_tokens == 8


def test_expected_prompt_length_decides_miss_or_generation():
    mgr = spec_manager()
    # longer than the known prompt (e.g. chunks not yet tokenized): still a miss up to 12 tokens
    kv = prefilled(mgr, "a", 4, 4, expected_prompt_length=12)
    assert kv.resize(8)
    kv.commit(list(range(4, 8)))
    assert delta_tuple(kv.commit_pending_stats()) == (2, 2, 0, 2)
    kv.close()
    mgr.get_iteration_stats()
    # 0: every allocation is a generation allocation
    kv = mgr.create_kv_cache("b", list(range(100, 104)), expected_prompt_length=0)
    assert kv.resize(4)
    assert delta_tuple(kv.commit_pending_stats()) == (1, 1, 0, 0)
    assert nz(bucket(mgr)) == {"iterAllocTotalBlocks": 1, "iterAllocNewBlocks": 1, "iterGenAllocBlocks": 1}


def test_a_resize_is_classified_by_history_at_its_start():
    mgr = spec_manager()
    kv = prefilled(mgr, "a", 8, 4)
    kv.commit_pending_stats()
    mgr.get_iteration_stats()
    assert kv.resize(12)  # history 4 < 8 at the start: both new blocks are misses, even the one past the prompt
    assert delta_tuple(kv.commit_pending_stats()) == (2, 2, 0, 2)
    assert bucket(mgr)["iterGenAllocBlocks"] == 0


def test_shrink_rolls_back_newest_segment_first():
    mgr = spec_manager()
    kv = prefilled(mgr, "a", 4, 4)  # history == expected: the next allocation is generation
    assert kv.resize(8)
    assert kv.resize(4)  # drops the generation block, keeps the pending miss
    assert delta_tuple(kv.commit_pending_stats()) == (1, 1, 0, 1)
    assert nz(bucket(mgr)) == {"iterAllocTotalBlocks": 1, "iterAllocNewBlocks": 1, "iterMissedBlocks": 1}


def test_excluded_request_touches_no_statistic_even_through_reuse_and_copies():
    mgr = spec_manager()
    prompt = list(range(12))
    run_prompt(mgr, "a", prompt)
    mgr.get_iteration_stats()
    before = mgr.get_kv_cache_stats().to_dict()
    kv = mgr.create_kv_cache("w", prompt[:10], exclude_from_stats=True)
    assert kv.num_reused_tokens == 9
    assert kv.resume() and kv.resize(12)
    kv.commit(prompt[9:12])
    assert delta_tuple(kv.commit_pending_stats()) == (0, 0, 0, 0)
    kv.close()
    after = mgr.get_kv_cache_stats().to_dict()
    for key in ("allocTotalBlocks", "allocNewBlocks", "reusedBlocks", "missedBlocks", "cacheHitRate"):
        assert after[key] == before[key]
    assert nz(bucket(mgr)) == {}


def test_stats_disabled():
    mgr = spec_manager(enable_stats=False)
    kv = prefilled(mgr, "a", 8, 8)
    assert delta_tuple(kv.commit_pending_stats()) == (0, 0, 0, 0)
    assert mgr.get_iteration_stats() is None
    d = mgr.get_kv_cache_stats().to_dict()
    assert (d["allocTotalBlocks"], d["missedBlocks"], d["usedNumBlocks"], d["maxNumBlocks"]) == (0, 0, 2, 4)


def test_failed_resize_on_a_fresh_cache_changes_nothing():
    mgr = spec_manager()
    hog = mgr.create_kv_cache("hog", list(range(100, 112)))
    assert hog.resize(12)
    kv = mgr.create_kv_cache("a", list(range(8)))
    before = mgr.get_kv_cache_stats()
    assert not kv.resize(8)
    assert kv.capacity == 0 and kv.history_length == 0
    assert delta_tuple(kv.commit_pending_stats()) == (0, 0, 0, 0)
    assert mgr.get_kv_cache_stats() == before
    hog.commit_pending_stats()
    assert nz(bucket(mgr)) == {"iterAllocTotalBlocks": 3, "iterAllocNewBlocks": 3, "iterMissedBlocks": 3}


def test_failed_resize_that_needs_an_onboard_changes_nothing():
    """A resize of a suspended/fresh cache must not do half its work: no onboard, no offload, no stat."""
    mgr = tiny_mgr([(None, 0, 1)], primary_slots=2, host_slots=4)
    a = list(range(8))
    run_prompt(mgr, "a", a)
    run_prompt(mgr, "c", list(range(50, 58)))  # a's two blocks go to the host tier
    mgr.get_iteration_stats()
    before = mgr.get_kv_cache_stats()
    kv = mgr.create_kv_cache("b", a + [9])
    assert kv.num_reused_tokens == 8
    assert not kv.resize(16), "4 primary blocks are needed, 2 exist"
    assert mgr.get_kv_cache_stats() == before
    assert delta_tuple(kv.commit_pending_stats()) == (0, 0, 2, 0)  # only the reuse of create_kv_cache
    b = bucket(mgr, "64")
    assert nz(b) == {"iterReusedBlocks": 2, "iterFullReusedBlocks": 2, "iterCacheHitRate": 1.0}, nz(b)


def test_failed_resume_changes_nothing():
    mgr = spec_manager()
    prompt = list(range(12))
    run_prompt(mgr, "a", prompt)
    hog = mgr.create_kv_cache("hog", list(range(100, 104)))
    assert hog.resize(4)  # the one free slot
    hog.commit_pending_stats()
    mgr.get_iteration_stats()
    kv = mgr.create_kv_cache("b", prompt[:10])
    assert kv.num_reused_tokens == 9
    before = mgr.get_kv_cache_stats()
    assert not kv.resume(), "the partial copy needs a slot and none is free or evictable"
    assert mgr.get_kv_cache_stats() == before
    assert nz(bucket(mgr)) == {}


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
