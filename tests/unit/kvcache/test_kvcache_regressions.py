"""Regressions from the correctness review: each test failed on the code before its fix."""

from kvcache import KVCacheManager
from kvcache.events import STORED
from tests.support.kvcache_helpers import run_prompt, small_manager


def _longest_fit(mgr: KVCacheManager) -> int:
    n = mgr.config.max_seq_len
    while n and not mgr.fits(n):
        n -= 1
    return n


def _drained_counters(mgr: KVCacheManager) -> dict:
    (bucket,) = mgr.get_iteration_stats().to_dict()["kvCacheIterationStats"].values()
    return bucket


def test_a_request_that_fits_can_resume_alone_after_a_partial_match():
    """fits() counts the private copy of a partially reused block: its source page is held until the copy."""
    for partial in (True, False):
        mgr = small_manager(primary_slots=4, max_seq_len=16, enable_partial_reuse=partial)
        n = _longest_fit(mgr)
        prompt = list(range(1, n))
        run_prompt(mgr, "first", prompt, extra=1)  # the whole request: prompt + one generated token
        retry = mgr.create_kv_cache("retry", prompt)
        assert retry.num_reused_tokens > 0
        assert retry.resume() and retry.resize(n), f"a {n}-token request fit, yet its retry cannot resume"
        retry.close()
    assert _longest_fit(small_manager(primary_slots=4, max_seq_len=16)) == 12
    assert _longest_fit(small_manager(primary_slots=4, max_seq_len=16, enable_partial_reuse=False)) == 16


def test_a_block_published_under_a_pruned_parent_stays_reachable():
    """B computed block 0 itself while A published it; A's page is dropped; B's later blocks stay matchable."""
    mgr = small_manager(primary_slots=6)
    a = mgr.create_kv_cache("a", [1, 2, 3, 4])
    b = mgr.create_kv_cache("b", [1, 2, 3, 4, 5, 6, 7, 8])  # created before A published: no match
    assert b.num_reused_tokens == 0
    for kv in (a, b):
        assert kv.resume() and kv.resize(4)
        kv.commit([1, 2, 3, 4])  # both publish block 0: the node keeps A's page
    a.close()
    run_prompt(mgr, "filler", list(range(100, 120)))  # 5 blocks: evicts (drops) A's page, no host tier
    assert b.resize(8)
    b.commit([5, 6, 7, 8])
    b.close()
    assert mgr.create_kv_cache("c", [1, 2, 3, 4, 5, 6, 7, 8, 9]).num_reused_tokens == 8


def test_salts_that_compare_equal_do_not_share_blocks():
    mgr = small_manager()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run_prompt(mgr, "int", prompt, salt=1)
    assert mgr.create_kv_cache("bool", prompt, cache_salt=True).num_reused_tokens == 0
    assert mgr.create_kv_cache("float", prompt, cache_salt=1.0).num_reused_tokens == 0
    assert mgr.create_kv_cache("same", prompt, cache_salt=1).num_reused_tokens == 8


def test_partial_copy_from_the_host_tier_records_its_allocation_with_the_onboard():
    """Closed before its stats commit, a cache that onboarded a partial block leaves onboard = allocation."""
    mgr = small_manager(primary_slots=2, host_slots=4)
    run_prompt(mgr, "a", [1, 2, 3, 4, 5, 6])  # block 0 full, [5, 6] published on close
    run_prompt(mgr, "filler", [50, 51, 52, 53, 54, 55, 56, 57])  # offloads both of A's blocks
    _drained_counters(mgr)
    kv = mgr.create_kv_cache("c", [1, 2, 3, 4, 5, 99])
    assert kv.num_reused_tokens == 5
    assert kv.resume()  # onboards block 0, copies the partial block from the host tier
    kv.close()
    c = _drained_counters(mgr)
    assert c["iterOnboardBlocks"] == 2
    assert c["iterAllocTotalBlocks"] == c["iterAllocNewBlocks"] == 2
    assert mgr.get_kv_cache_stats().alloc_total_blocks == 2 + 2 + 2  # a, filler, and c's two onboards


def test_a_salt_whose_blocks_are_all_gone_leaves_no_root():
    """Each salt's root (keyed by the salt itself) went with its last block: memory is bounded by the blocks
    held, not by the salts ever seen. Every request here publishes two blocks; the cache holds four."""
    mgr = small_manager(primary_slots=4)
    salts = [f"tenant-{i}-" + "x" * 1000 for i in range(20)]
    for i, salt in enumerate(salts):
        run_prompt(mgr, f"r{i}", [1, 2, 3, 4, 5, 6], salt=salt)
    assert {salt for _, salt in mgr.reuse.roots} == set(salts[-2:])  # only the salts with a block cached
    again = mgr.create_kv_cache("again", [1, 2, 3, 4, 5, 6, 7], cache_salt=salts[-1])
    assert again.num_reused_tokens == 6
    again.close()
    run_prompt(mgr, "filler", list(range(100, 116)))  # four blocks without a salt: every salted one goes
    assert list(mgr.reuse.roots) == [(type(None), None)]
    mgr.set_kv_events(True)  # the snapshot walks the live roots only
    assert {e.salt for e in mgr.kv_events.drain() if e.kind == STORED} == {None}


def test_a_live_cache_keeps_its_salts_root():
    """A root without blocks stays while a cache of its salt lives: that cache publishes under it later, where
    the next request of the salt must find its blocks."""
    mgr = small_manager(primary_slots=4)
    kv = mgr.create_kv_cache("a", [1, 2, 3, 4, 5], cache_salt="t")
    mgr.create_kv_cache("b", [9], cache_salt="t").close()  # another cache of the salt leaves, none published
    run_prompt(mgr, "filler", list(range(100, 116)))
    assert kv.resume() and kv.resize(5)
    kv.commit([1, 2, 3, 4, 5])
    kv.close()
    assert mgr.create_kv_cache("c", [1, 2, 3, 4, 5, 6], cache_salt="t").num_reused_tokens == 5
    mgr.create_kv_cache("d", [1], cache_salt="once").close()
    assert (str, "once") not in mgr.reuse.roots


def test_residency_records_nothing_with_statistics_off():
    """Only the stats delta drains the residency lists, so with stats off they got a float per reuse hit and
    eviction, forever. Shared prefixes and a full cache: hits and evictions every request."""
    mgr = small_manager(primary_slots=8, enable_stats=False)
    for i in range(40):
        run_prompt(mgr, f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8, 100 + i, 101, 102, 103, 104])
    assert [len(s) for s in mgr.residency._seconds] == [0, 0, 0]
    on = small_manager(primary_slots=8)
    for i in range(40):
        run_prompt(on, f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8, 100 + i, 101, 102, 103, 104])
    drained = on.residency.drain()
    assert drained is not None and all(sum(c) for c in drained.counts)  # stats on: still every event
