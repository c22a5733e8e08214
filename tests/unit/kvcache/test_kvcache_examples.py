"""The worked examples of SPEC-kv-stats.md section 5, verbatim."""

import pytest

from kvcache import KVCacheStatsDelta
from tests.support.kvcache_helpers import bucket, nonzero, spec_manager


def _context(mgr, rid="r"):
    kv = mgr.create_kv_cache(rid, list(range(8)))
    assert kv.resume()
    assert kv.resize(8)
    kv.commit(list(range(8)))
    return kv


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse-on", "reuse-off (example 5)"])
def test_example_1_context_then_generation(reuse):
    mgr = spec_manager(enable_block_reuse=reuse)
    kv = _context(mgr)
    assert kv.commit_pending_stats() == KVCacheStatsDelta(2, 2, 0, 2)
    assert nonzero(bucket(mgr)) == {"iterAllocTotalBlocks": 2, "iterAllocNewBlocks": 2, "iterMissedBlocks": 2}
    assert kv.resize(9)
    kv.commit([100])
    assert kv.commit_pending_stats() == KVCacheStatsDelta(1, 1, 0, 0)
    assert nonzero(bucket(mgr)) == {"iterAllocTotalBlocks": 1, "iterAllocNewBlocks": 1, "iterGenAllocBlocks": 1}


def test_example_2_reverted_generation():
    mgr = spec_manager()
    kv = _context(mgr)
    kv.commit_pending_stats()
    mgr.get_iteration_stats()
    assert kv.resize(9)
    assert kv.resize(8)
    assert kv.commit_pending_stats() == KVCacheStatsDelta()
    assert nonzero(bucket(mgr)) == {}


@pytest.mark.parametrize("resume", [True, False], ids=["resumed", "literal"])
def test_example_3_chunked_context_with_revert(resume):
    """`literal`: as the spec writes it, with no resume() (the first resize resumes the fresh cache)."""
    mgr = spec_manager()
    kv = mgr.create_kv_cache("r", list(range(8)))
    if resume:
        assert kv.resume()
    assert kv.resize(4)
    kv.commit(list(range(4)))
    assert kv.commit_pending_stats() == KVCacheStatsDelta(1, 1, 0, 1)
    assert nonzero(bucket(mgr)) == {"iterAllocTotalBlocks": 1, "iterAllocNewBlocks": 1, "iterMissedBlocks": 1}
    assert kv.resize(8)
    assert kv.resize(4)
    assert kv.commit_pending_stats() == KVCacheStatsDelta()
    assert nonzero(bucket(mgr)) == {}
    stats = mgr.get_kv_cache_stats()
    assert (stats.alloc_total_blocks, stats.alloc_new_blocks, stats.missed_blocks) == (1, 1, 1)
    assert kv.resize(8)
    kv.commit(list(range(4, 8)))
    assert kv.commit_pending_stats() == KVCacheStatsDelta(1, 1, 0, 1)
    assert nonzero(bucket(mgr)) == {"iterAllocTotalBlocks": 1, "iterAllocNewBlocks": 1, "iterMissedBlocks": 1}


@pytest.mark.parametrize("partial,expected", [(True, 9), (False, 8)])
def test_example_4_partial_reuse_switch(partial, expected):
    mgr = spec_manager(enable_partial_reuse=partial)
    prompt = list(range(12))
    kv = mgr.create_kv_cache("a", prompt)
    assert kv.resume() and kv.resize(13)
    kv.commit(prompt)
    kv.commit([77])
    kv.commit_pending_stats()
    kv.close()
    kv2 = mgr.create_kv_cache("b", prompt[:10])
    assert kv2.num_reused_tokens == expected
    assert kv2.history_length == expected


def test_example_4_counts_full_and_partial_reuse():
    mgr = spec_manager()
    prompt = list(range(12))
    kv = mgr.create_kv_cache("a", prompt)
    assert kv.resume() and kv.resize(12)
    kv.commit(prompt)
    kv.close()
    mgr.get_iteration_stats()
    kv2 = mgr.create_kv_cache("b", prompt[:10])
    assert kv2.resume()
    assert kv2.commit_pending_stats() == KVCacheStatsDelta(1, 1, 3, 0)
    b = bucket(mgr)
    assert nonzero(b) == {"iterAllocTotalBlocks": 1, "iterAllocNewBlocks": 1, "iterReusedBlocks": 3,
                          "iterFullReusedBlocks": 2, "iterPartialReusedBlocks": 1, "iterCacheHitRate": 1.0,
                          "iterIntraDeviceCopyBlocks": 1, "iterIntraDeviceCopyBytes": 2 << 20}
