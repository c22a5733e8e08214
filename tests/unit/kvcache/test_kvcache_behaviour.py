"""kvcache behaviour: eviction order, tiers, salts, sliding windows with sinks, exclusions, errors, integrity."""

import pytest
import torch

from kvcache import KVCacheError, KVCacheStatsDelta
from tests.support.kvcache_helpers import bucket, nonzero, run_prompt, small_manager, spec_manager


def write_kv(mgr, kv, layer_id, start, values):
    """Write one float per position (into K and -value into V) at history positions start.."""
    B = mgr.tokens_per_block
    k, v = mgr.layer_kv(layer_id)
    ids = kv.block_ids(mgr.life_cycle_of_layer(layer_id))
    for i, val in enumerate(values):
        p = start + i
        k[ids[p // B], p % B] = val
        v[ids[p // B], p % B] = -val


def read_kv(mgr, kv, layer_id, n):
    B = mgr.tokens_per_block
    k, v = mgr.layer_kv(layer_id)
    ids = kv.block_ids(mgr.life_cycle_of_layer(layer_id))
    out = []
    for p in range(n):
        if ids[p // B] < 0:
            out.append(None)
            continue
        kk, vv = k[ids[p // B], p % B], v[ids[p // B], p % B]
        assert torch.equal(kk, -vv)
        out.append(float(kk.flatten()[0]))
    return out


def test_layer_views_are_slices_of_one_pool():
    mgr = spec_manager()
    k, v = mgr.layer_kv(0)
    assert k.shape == (4, 4, 128, 1024) and v.shape == k.shape and k.dtype == torch.float16
    k[2, 1].fill_(1.5)
    assert float(k[2, 1, 0, 0]) == 1.5
    assert k.data_ptr() != v.data_ptr()


def test_lru_eviction_order_and_priority():
    mgr = small_manager(primary_slots=4)
    a, b, c = [100, 101, 102, 103], [200, 201, 202, 203], [300, 301, 302, 303]
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        run_prompt(mgr, rid, prompt)
    run_prompt(mgr, "d", list(range(8)))  # needs 2 slots: 1 free + evicts the LRU (a)
    reuse = {name: mgr.create_kv_cache("probe", p + [9]).num_reused_tokens for name, p in
             (("a", a), ("b", b), ("c", c))}
    assert reuse == {"a": 0, "b": 4, "c": 4}


def test_low_priority_is_evicted_before_older_blocks():
    mgr = small_manager(primary_slots=3)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    run_prompt(mgr, "a", a)
    kv = run_prompt(mgr, "b", b, close=False)
    kv.set_priority(0)
    kv.close()
    run_prompt(mgr, "c", list(range(20, 28)))  # 2 blocks: 1 free + 1 eviction
    assert mgr.create_kv_cache("p", a + [0]).num_reused_tokens == 4
    assert mgr.create_kv_cache("p", b + [0]).num_reused_tokens == 0


def test_salts_never_share_blocks():
    mgr = small_manager()
    prompt = list(range(9))
    run_prompt(mgr, "a", prompt, salt="tenant-a")
    assert mgr.create_kv_cache("x", prompt, cache_salt="tenant-b").num_reused_tokens == 0
    assert mgr.create_kv_cache("x", prompt).num_reused_tokens == 0
    assert mgr.create_kv_cache("x", prompt, cache_salt="tenant-a").num_reused_tokens == 8


def test_sliding_window_with_sinks_releases_stale_blocks():
    # window 8, 4 sink tokens, B=4: at history h the stale blocks are [1, (h+1-8)//4)
    mgr = small_manager(windows=(8,), sinks=4, primary_slots=16)
    kv = mgr.create_kv_cache("r", list(range(40)))
    assert kv.resume() and kv.resize(40)
    for t in range(40):
        kv.commit([t])
    ids = kv.block_ids(0)
    stale_end = (40 + 1 - 8) // 4
    assert ids[0] >= 0, "the sink block is kept"
    assert all(i == -1 for i in ids[1:stale_end])
    assert all(i >= 0 for i in ids[stale_end:])
    assert mgr.get_kv_cache_stats().used_num_blocks == 1 + len(ids) - stale_end
    kv.close()
    assert mgr.get_kv_cache_stats().used_num_blocks == 0


def test_sliding_window_stale_blocks_are_matched_but_not_counted():
    mgr = small_manager(windows=(8,), primary_slots=16)
    prompt = list(range(32))
    run_prompt(mgr, "a", prompt)
    mgr.get_iteration_stats()
    kv = mgr.create_kv_cache("b", prompt + [99])
    assert kv.num_reused_tokens == 32
    delta = kv.commit_pending_stats()
    # at history 32 with window 8: stale blocks [0, 6); blocks 6 and 7 are reused
    assert delta == KVCacheStatsDelta(0, 0, 2, 0)
    assert kv.resume()
    assert kv.block_ids(0)[:6] == [-1] * 6


def test_offload_and_onboard_preserve_data_and_count_bytes():
    mgr = small_manager(primary_slots=2, host_slots=4)
    slot = mgr.life_cycles[0].slot_bytes
    kv = mgr.create_kv_cache("a", list(range(8)))
    assert kv.resume() and kv.resize(8)
    write_kv(mgr, kv, 0, 0, [float(i + 1) for i in range(8)])
    kv.commit(list(range(8)))
    kv.commit_pending_stats()
    kv.suspend()
    mgr.get_iteration_stats()
    other = mgr.create_kv_cache("b", list(range(50, 58)))
    assert other.resume() and other.resize(8)  # both primary slots: a's pages go to the host tier
    other.commit_pending_stats()
    b = bucket(mgr, "64")
    assert b["iterOffloadBlocks"] == 2 and b["iterOffloadBytes"] == 2 * slot
    assert not kv.resume(), "no room while b holds both primary slots"
    other.close()
    assert kv.resume()
    b = bucket(mgr, "64")
    assert b["iterOnboardBlocks"] == 2 and b["iterOnboardBytes"] == 2 * slot
    assert b["iterAllocTotalBlocks"] == 2 and b["iterMissedBlocks"] == 0
    assert read_kv(mgr, kv, 0, 8) == [float(i + 1) for i in range(8)]
    kv.close()


def test_reused_blocks_read_back_identical_through_the_host_tier():
    mgr = small_manager(primary_slots=3, host_slots=8)
    prompt = list(range(12))
    kv = mgr.create_kv_cache("a", prompt)
    assert kv.resume() and kv.resize(12)
    write_kv(mgr, kv, 0, 0, [10.0 + i for i in range(12)])
    kv.commit(prompt)
    kv.close()
    run_prompt(mgr, "flush", list(range(100, 112)))  # pushes a's blocks to the host tier
    kv2 = mgr.create_kv_cache("b", prompt[:10] + [7])
    assert kv2.num_reused_tokens == 10
    assert kv2.resume()
    assert read_kv(mgr, kv2, 0, 10) == [10.0 + i for i in range(10)]


def test_host_tier_full_drops_the_lru_block():
    mgr = small_manager(primary_slots=1, host_slots=1)
    slot = mgr.life_cycles[0].slot_bytes
    for i in range(3):
        run_prompt(mgr, f"r{i}", [i * 10 + j for j in range(4)])
    b = bucket(mgr, "64")
    assert b["iterOffloadBlocks"] == 2
    assert b["iterHostDroppedBlocks"] == 1 and b["iterHostDroppedBytes"] == slot


def test_failed_resize_changes_nothing():
    mgr = small_manager(primary_slots=2)
    kv = mgr.create_kv_cache("a", list(range(8)))
    assert kv.resume() and kv.resize(8)
    other = mgr.create_kv_cache("b", list(range(20, 24)))
    assert other.resume()
    before = mgr.get_kv_cache_stats()
    assert not other.resize(4)
    assert other.capacity == 0
    assert other.commit_pending_stats() == KVCacheStatsDelta()
    assert mgr.get_kv_cache_stats() == before


def test_excluded_requests_touch_no_statistic():
    mgr = small_manager(primary_slots=3, host_slots=2)
    for i in range(4):
        prompt = [i * 100 + j for j in range(8)]
        kv = mgr.create_kv_cache(f"w{i}", prompt, exclude_from_stats=True)
        assert kv.resume() and kv.resize(9)
        kv.commit(prompt)
        assert kv.commit_pending_stats() == KVCacheStatsDelta()
        kv.close()
    stats = mgr.get_kv_cache_stats()
    assert (stats.alloc_total_blocks, stats.reused_blocks, stats.missed_blocks) == (0, 0, 0)
    assert nonzero(bucket(mgr, "64")) == {}


def test_stats_disabled():
    mgr = small_manager(enable_stats=False)
    kv = run_prompt(mgr, "a", list(range(8)), close=False)
    assert kv.commit_pending_stats() == KVCacheStatsDelta()
    assert mgr.get_iteration_stats() is None
    stats = mgr.get_kv_cache_stats()
    assert stats.alloc_total_blocks == 0 and stats.used_num_blocks == 2


def test_misuse_raises_and_leaves_the_manager_consistent():
    mgr = spec_manager()
    with pytest.raises(ValueError, match="longer than max_seq_len"):
        mgr.create_kv_cache("long", list(range(17)))
    kv = mgr.create_kv_cache("a", list(range(8)))
    with pytest.raises(KVCacheError, match="inactive"):
        kv.commit([])
    assert kv.resize(4), "resize() activates a fresh cache"
    assert kv.is_active
    with pytest.raises(KVCacheError, match="beyond capacity"):
        kv.commit(list(range(5)))
    assert kv.history_length == 0
    kv.commit(list(range(4)))
    with pytest.raises(KVCacheError, match="below history_length"):
        kv.resize(3)
    with pytest.raises(KVCacheError, match="beyond max_seq_len"):
        kv.resize(17)
    kv.close()
    with pytest.raises(KVCacheError, match="after close"):
        kv.resize(8)
    with pytest.raises(KVCacheError, match="after close"):
        kv.commit([1])
    assert mgr.get_kv_cache_stats().used_num_blocks == 0


def test_resize_past_max_seq_len_inside_the_last_block_is_refused():
    """max_seq_len 10 with 4-token blocks: the third block could hold 12 tokens, the cache may not."""
    kv = small_manager(max_seq_len=10).create_kv_cache("a", list(range(9)))
    assert kv.resize(9)
    with pytest.raises(KVCacheError, match="beyond max_seq_len"):
        kv.resize(11)
    assert kv.resize(10) and kv.capacity == 10
    with pytest.raises(KVCacheError, match="below history_length"):
        kv.commit(list(range(9)))
        kv.resize(8)


def test_too_small_a_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="holds no block"):
        spec_manager(gpu_cache_bytes=1 << 20)


def test_window_buckets_and_pool_groups():
    # full (4 heads) and sliding (4 heads): equal slot size -> one pool group shared by two windows
    mgr = small_manager(windows=(None, 8), primary_slots=8)
    assert len(mgr.pool_groups) == 1 and len(mgr.life_cycles) == 2
    run_prompt(mgr, "a", list(range(8)))
    d = mgr.get_iteration_stats().to_dict()
    assert set(d["kvCacheIterationStats"]) == {"64", "8"}
    assert d["kvCacheIterationStats"]["64"]["primaryMaxNumBlocks"] == 0, "a shared pool group adds no gauge"
    pg = d["kvCacheIterationStatsByPoolGroup"][0]
    assert pg["windowSizes"] == [8, 64] and pg["primaryMaxNumBlocks"] == 16
    assert pg["iterAllocTotalBlocks"] == 4, "two blocks per life cycle"
    lcs = d["kvCacheIterationStatsByLifecycle"]
    assert lcs["1"]["kind"] == "attention" and lcs[1]["windowSize"] == 8
    assert lcs[0]["iterMissedBlocks"] == 2


def test_peaks_are_reseeded_from_current_values_at_each_drain():
    mgr = small_manager(primary_slots=4)
    kv = run_prompt(mgr, "a", list(range(12)), close=False)
    b = bucket(mgr, "64")
    assert b["primaryPeakUsedNumBlocks"] == 3
    kv.close()
    run_prompt(mgr, "b", [50, 51, 52, 53]).close()
    b = bucket(mgr, "64")
    assert b["primaryUsedNumBlocks"] == 0
    assert b["primaryPeakUsedNumBlocks"] == 3, "seeded from the drain before, when 3 were used"
    b = bucket(mgr, "64")
    assert b["primaryPeakUsedNumBlocks"] == 0


@pytest.mark.gpu
def test_cuda_primary_tier_with_pinned_host_tier():
    mgr = small_manager(primary_slots=2, host_slots=4, device="cuda:0")
    assert mgr.layer_kv(0)[0].is_cuda and mgr._secondary[0].tensor.is_pinned()
    kv = mgr.create_kv_cache("a", list(range(8)))
    assert kv.resume() and kv.resize(8)
    write_kv(mgr, kv, 0, 0, [float(i + 1) for i in range(8)])
    kv.commit(list(range(8)))
    kv.suspend()
    other = mgr.create_kv_cache("b", list(range(50, 58)))
    assert other.resume() and other.resize(8)
    other.close()
    assert kv.resume()
    assert read_kv(mgr, kv, 0, 8) == [float(i + 1) for i in range(8)]


def test_reports_pickle_as_plain_dicts():
    """Rank reports cross to the aggregator, which must not have to import kvcache (and torch) to read them."""
    import pickle

    mgr = small_manager()
    run_prompt(mgr, "a", list(range(8)))
    d = pickle.loads(pickle.dumps(mgr.get_iteration_stats().to_dict()))
    assert type(d["kvCacheIterationStats"]) is dict and b"kvcache" not in pickle.dumps(d)
    assert d["kvCacheIterationStats"]["64"]["iterMissedBlocks"] == 2
