"""Random operation sequences on one manager keep every structural invariant (the review's kvcache fuzzer).

After every operation: the primary and host slots are partitioned exactly into free, evictable and held;
page reference counts equal their holders; the suspended set is exactly the held pages no active cache holds;
every live cache's last tree node is still attached to its root. At the end: no block is left used, and the
drained iteration counters add up to the cumulative ones.
"""

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache import AttentionLayerConfig as L
from kvcache import KVCacheError, KVCacheManager, KVCacheManagerConfig
from kvcache.stats import ALLOC_TOTAL, MISSED, NUM_COUNTERS, REUSED
from tests.support.kvcache_helpers import random_cache_op, track

F = torch.float32
LAYOUTS = {
    "full+swa_sink_shared": [L(0, 1, 4, F, None), L(1, 1, 4, F, 5, 3)],  # one pool group, two life cycles
    "swa_w1": [L(0, 1, 4, F, None), L(1, 2, 4, F, 1, 0)],
    "two_swa_sinks": [L(0, 1, 4, F, 6, 2), L(1, 1, 4, F, 3, 5), L(2, 2, 4, F, None)],
    "full": [L(0, 1, 4, F, None)],
}
# (tokens per block, host slots, partial reuse, reuse)
CONFIGS = [(4, 0, True, True), (4, 3, True, True), (2, 8, True, True), (1, 2, False, True), (4, 4, True, False),
           (3, 1, True, True)]
OPS = ["create", "create", "resume", "suspend", "resize", "resize", "commit", "commit", "stats", "close", "drain"]
PREFIXES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [2] * 9, [], [5, 6]]
MAX_LEN = 32


def check(mgr: KVCacheManager, caches: list) -> None:
    held = {}
    for kv in caches:
        if kv.is_closed:
            continue
        for pages in kv._pages:
            for p in pages:
                if p is not None:
                    h = held.setdefault(id(p), [p, 0, 0])
                    h[1] += 1
                    h[2] += kv.is_active
        if kv._nodes:
            node = kv._nodes[-1]
            while node.parent is not None:
                assert node.parent.children.get(node.tokens) is node, "a live cache's tail was detached"
                node = node.parent
            assert node is kv._root
    for p, ref, active in held.values():
        assert (p.ref, p.active_ref) == (ref, active) and p.tier in (0, 1)
    for pg in range(len(mgr.pool_groups)):
        for tier, pool in ((0, mgr._primary[pg]), (1, mgr._secondary[pg])):
            if pool is None:
                continue
            evictable = [p for lru in pool.evictable.values() for p in lru]
            assert len(evictable) == pool.num_evictable
            assert all(p.ref == 0 and p.node is not None and p.tier == tier for p in evictable)
            mine = [p.slot for p, _, _ in held.values() if p.tier == tier and mgr.pool_group_of[p.lc] == pg]
            assert sorted(list(pool.free) + [p.slot for p in evictable] + mine) == list(range(pool.num_slots))
            if tier == 0:
                want = {id(p) for p, _, active in held.values()
                        if p.tier == 0 and active == 0 and mgr.pool_group_of[p.lc] == pg}
                assert want == {id(p) for p in pool.suspended}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(sorted(LAYOUTS)), config=st.sampled_from(CONFIGS), slots=st.integers(3, 9),
       ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2**32)), min_size=1, max_size=150))
def test_random_operations_keep_every_invariant(layout, config, slots, ops):
    B, host_slots, partial, reuse = config
    layers = LAYOUTS[layout]
    probe = KVCacheManager(KVCacheManagerConfig(B, MAX_LEN, layers, 1 << 20, 0))  # its slot size only
    unit = sum(len(pg.life_cycles) * pg.slot_bytes for pg in probe.pool_groups)
    mgr = KVCacheManager(KVCacheManagerConfig(B, MAX_LEN, layers, unit * slots, unit * host_slots,
                                              enable_block_reuse=reuse, enable_partial_reuse=partial))
    caches, prompts = [], {}
    drained = [0] * NUM_COUNTERS

    def drain() -> None:
        for counters in mgr.get_iteration_stats().counters:
            for i, v in enumerate(counters):
                drained[i] += v

    for n, (op, seed) in enumerate(ops):
        rng = random.Random(seed)
        live = [kv for kv in caches if not kv.is_closed]
        if op == "create" or not live:
            prompt = (rng.choice(PREFIXES) + [rng.randint(0, 3) for _ in range(rng.randint(0, 10))])[:MAX_LEN - 4]
            kv = mgr.create_kv_cache(n, prompt or [0], cache_salt=rng.choice([None, None, "s"]),
                                     exclude_from_stats=rng.random() < 0.1)
            track(kv, prompt or [0], prompts, caches, rng)
        else:
            kv = rng.choice(live)
            if op == "stats":
                kv.commit_pending_stats()
            elif op == "close":
                if rng.random() < 0.5:
                    kv.commit_pending_stats()
                kv.close()
            elif op == "drain":
                drain()
            else:
                random_cache_op(op, kv, rng, prompts[id(kv)], MAX_LEN)
        check(mgr, caches)
    for kv in caches:
        if not kv.is_closed:
            kv.commit_pending_stats()
            kv.close()
    check(mgr, caches)
    drain()
    totals = mgr.get_kv_cache_stats()
    assert totals.used_num_blocks == 0
    assert all(p is None or p.gauges()[2] == 0 for p in mgr._secondary)
    assert (drained[ALLOC_TOTAL], drained[REUSED], drained[MISSED]) == (
        totals.alloc_total_blocks, totals.reused_blocks, totals.missed_blocks)
    try:
        caches[0].commit([1])
    except KVCacheError:
        pass  # use after close is refused, not silently accepted
    else:
        raise AssertionError("commit after close was accepted")
