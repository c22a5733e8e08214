"""KV events: the index built from a manager's events is exactly the set of blocks its reuse tree holds."""

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv_index import KVIndex
from kvcache import AttentionLayerConfig as L
from kvcache import KVCacheManager, KVCacheManagerConfig
from kvcache.events import CLEARED, MOVED, REMOVED, STORED, block_key, prompt_keys, reuse_table, root_key
from tests.support.kvcache_helpers import random_cache_op, small_manager, track, tree_blocks

F = torch.float32
LAYOUTS = {
    "full": [L(0, 1, 4, F, None)],
    "full+swa": [L(0, 1, 4, F, None), L(1, 1, 4, F, 5, 0)],
    "swa_first": [L(0, 1, 4, F, 6, 2), L(1, 2, 4, F, None)],
}
OPS = ["create", "create", "resume", "suspend", "resize", "resize", "commit", "commit", "close", "close",
       "toggle", "resync"]
PREFIXES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [2] * 9, [], [5, 6]]
MAX_LEN = 32


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=st.sampled_from(sorted(LAYOUTS)), B=st.sampled_from([2, 4]), host=st.sampled_from([0, 3, 8]),
       slots=st.integers(4, 9), ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2**32)),
                                             min_size=1, max_size=120))
def test_the_index_equals_the_tree_after_random_workloads(layout, B, host, slots, ops):
    layers = LAYOUTS[layout]
    probe = KVCacheManager(KVCacheManagerConfig(B, MAX_LEN, layers, 1 << 20, 0))  # its slot size only
    unit = sum(len(pg.life_cycles) * pg.slot_bytes for pg in probe.pool_groups)
    mgr = KVCacheManager(KVCacheManagerConfig(B, MAX_LEN, layers, unit * slots, unit * host))
    mgr.set_kv_events(True)
    index = KVIndex(1, slots + host)
    caches, prompts = [], {}
    for n, (op, seed) in enumerate(ops):
        rng = random.Random(seed)
        live = [kv for kv in caches if not kv.is_closed]
        if op == "toggle":  # events off and on again: the snapshot on re-enabling catches the index up
            mgr.set_kv_events(mgr.kv_events is None)
        elif op == "resync":
            mgr.set_kv_events(True, resync=True)
        elif op == "create" or not live:
            prompt = (rng.choice(PREFIXES) + [rng.randint(0, 3) for _ in range(rng.randint(0, 10))])[:MAX_LEN - 4]
            prompt = prompt or [0]
            salt = rng.choice([None, None, "s"])
            keys = prompt_keys(prompt, B, salt) if rng.random() < 0.5 else None  # precomputed, or hashed by the rank
            track(mgr.create_kv_cache(n, prompt, cache_salt=salt, block_keys=keys), prompt, prompts, caches, rng)
        else:
            kv = rng.choice(live)
            if op == "close":
                kv.close()
            else:
                random_cache_op(op, kv, rng, prompts[id(kv)], MAX_LEN)
        if mgr.kv_events is not None:
            assert index.apply(0, mgr.kv_events.drain()), "an event did not fit the index"
            assert index.blocks[0] == tree_blocks(mgr)
    for kv in caches:
        kv.close()
    mgr.set_kv_events(True)
    assert index.apply(0, mgr.kv_events.drain())
    assert index.blocks[0] == tree_blocks(mgr)
    assert index.errors == 0


def test_precomputed_keys_are_the_keys_the_manager_computes():
    for salt in (None, "tenant-a", 7):
        mgr = small_manager(primary_slots=16)
        mgr.set_kv_events(True)
        prompt = list(range(1, 15))
        kv = mgr.create_kv_cache("a", prompt, cache_salt=salt)
        assert kv.resize(len(prompt))
        kv.commit(prompt)
        stored = [ev for ev in mgr.kv_events.drain() if ev.kind == STORED]
        assert [ev.key for ev in stored] == prompt_keys(prompt, 4, salt)  # 3 full blocks, hashed by the rank
        assert [ev.parent for ev in stored] == [None] + prompt_keys(prompt, 4, salt)[:-1]
        assert all(ev.salt == salt and ev.tier == 0 and len(ev.tokens) == 4 for ev in stored)
        kv.close()  # the trailing partial block is published with its own key
        (tail,) = mgr.kv_events.drain()
        assert tail.key == block_key(stored[-1].key, [13, 14]) and tail.tokens == (13, 14)


def test_salts_never_share_a_key():
    p = list(range(8))
    assert prompt_keys(p, 4, None) != prompt_keys(p, 4, "a") != prompt_keys(p, 4, "b")
    assert root_key(1) != root_key("1") and root_key(None) == 0
    mgr = small_manager(primary_slots=16)
    mgr.set_kv_events(True)
    kv = mgr.create_kv_cache("a", p, cache_salt="a")
    kv.resize(8)
    kv.commit(p)
    kv.close()
    index = KVIndex(1, 100)
    index.apply(0, mgr.kv_events.drain())
    index.resync[0] = False
    assert index.prefix(0, prompt_keys(p, 4, "a")) == (2, 0)
    assert index.prefix(0, prompt_keys(p, 4, "b")) == (0, 0)
    assert index.prefix(0, prompt_keys(p, 4, None)) == (0, 0)


def test_offload_onboard_and_drop_are_moved_and_removed_events():
    mgr = small_manager(primary_slots=2, host_slots=1)
    mgr.set_kv_events(True)
    mgr.kv_events.drain()
    a = mgr.create_kv_cache("a", [1, 2, 3, 4, 9])
    a.resize(4)
    a.commit([1, 2, 3, 4])
    a.close()  # block [1,2,3,4] evictable on primary
    (stored,) = mgr.kv_events.drain()
    b = mgr.create_kv_cache("b", [5, 6, 7, 8, 5, 6, 7, 8])
    assert b.resize(8)  # takes both primary slots: a's block is offloaded to the host tier
    assert [(ev.kind, ev.key, ev.tier) for ev in mgr.kv_events.drain()] == [(MOVED, stored.key, 1)]
    b.commit([5, 6, 7, 8, 5, 6, 7, 8])
    b.close()
    mgr.kv_events.drain()
    c = mgr.create_kv_cache("c", [7, 7, 7, 7, 7, 7, 7, 7])
    assert c.resize(8)  # b's blocks evicted: one goes to the host tier, dropping a's block there
    kinds = [(ev.kind, ev.tier) for ev in mgr.kv_events.drain()]
    assert (REMOVED, 1) in kinds and (MOVED, 1) in kinds


def test_events_off_record_nothing_and_compute_no_key():
    mgr = small_manager(primary_slots=8)
    assert mgr.kv_events is None
    kv = mgr.create_kv_cache("a", list(range(9)))
    kv.resize(9)
    kv.commit(list(range(9)))
    node = kv._nodes[-1]
    assert node.key is None  # nothing hashed while events are off
    mgr.set_kv_events(True)  # switching on starts with a snapshot of what is there
    evs = mgr.kv_events.drain()
    assert evs[0].kind == CLEARED and [ev.key for ev in evs[1:] if ev.kind == STORED][-1] == \
        prompt_keys(list(range(9)), 4)[-1]


def test_the_reuse_table_counts_what_a_stats_commit_counts():
    mgr = small_manager(windows=(None, 5), primary_slots=32, max_seq_len=64)
    table = reuse_table(mgr)
    prompt = list(range(1, 30))
    a = mgr.create_kv_cache("a", prompt)
    a.resize(len(prompt))
    a.commit(prompt)
    a.commit_pending_stats()
    a.close()
    b = mgr.create_kv_cache("b", prompt[:24] + [99, 98, 97])
    got = b.commit_pending_stats().reused_blocks
    assert b.num_reused_tokens == 24 and got == table[6] and table[6] < 2 * 6  # stale window blocks left out
