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
    KVCacheManagerConfig,
    KvCacheStats,
    KVCacheStatsDelta,
)
from tests.support.kvcache_helpers import run_prompt, spec_manager
from tests.support.spec_review_support import (
    ITER_FIELDS,
    KV_CACHE_STATS_KEYS,
    SLOT,
    bucket,
    delta_tuple,
    nz,
    prefilled,
    tiny_mgr,
)


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
