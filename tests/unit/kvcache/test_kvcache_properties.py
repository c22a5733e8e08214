"""Property tests: random operation sequences on a manager with two windows and a host tier.

Invariants: every counter drained over the run adds up to the cumulative total; free + used = max at every
drain; no leak once every cache is closed; KV written into a block reads back bit-identical after offload,
onboard, partial copy and reuse by another request.
"""

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import AttentionLayerConfig, KVCacheManager, KVCacheManagerConfig

B = 4
MAX_LEN = 32
PREFIXES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9], [2, 2, 2, 2, 2, 2, 2, 2, 2], []]


def kv_value(tokens: list[int], layer: int) -> float:
    """What a deterministic model would store for the last token of `tokens`: a function of the prefix."""
    return float(hash((layer, tuple(tokens))) % (1 << 20))


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        layers = [AttentionLayerConfig(0, 1, 4, torch.float32, None),
                  AttentionLayerConfig(1, 2, 4, torch.float32, 8)]  # different slot sizes: two pool groups
        slot0, slot1 = 2 * B * 16, 2 * B * 32
        self.mgr = KVCacheManager(KVCacheManagerConfig(
            tokens_per_block=B, max_seq_len=MAX_LEN, layers=layers,
            gpu_cache_bytes=6 * (slot0 + slot1), host_cache_bytes=8 * (slot0 + slot1)))
        self.reqs: dict[int, dict] = {}
        self.next_id = 0
        self.drained = {"alloc": 0, "reused": 0, "missed": 0, "onboard": 0, "offload": 0}

    # ---- helpers ----
    def _write(self, r, start, tokens):
        mgr, kv = self.mgr, r["kv"]
        full = r["tokens"] + tokens
        for layer in (0, 1):
            k, v = mgr.layer_kv(layer)
            ids = kv.block_ids(mgr.life_cycle_of_layer(layer))
            for i in range(len(tokens)):
                p = start + i
                val = kv_value(full[: p + 1], layer)
                k[ids[p // B], p % B] = val
                v[ids[p // B], p % B] = -val

    def _drain(self):
        report = self.mgr.get_iteration_stats().to_dict()
        for b in report["kvCacheIterationStats"].values():
            self.drained["alloc"] += b["iterAllocTotalBlocks"]
            self.drained["reused"] += b["iterReusedBlocks"]
            self.drained["missed"] += b["iterMissedBlocks"]
            self.drained["onboard"] += b["iterOnboardBlocks"]
            self.drained["offload"] += b["iterOffloadBlocks"]
            assert b["iterAllocNewBlocks"] == b["iterAllocTotalBlocks"]
        for pg in report["kvCacheIterationStatsByPoolGroup"].values():
            for tier in ("primary", "secondary"):
                assert pg[f"{tier}FreeNumBlocks"] + pg[f"{tier}UsedNumBlocks"] == pg[f"{tier}MaxNumBlocks"]
                assert pg[f"{tier}PeakUsedNumBlocks"] >= pg[f"{tier}UsedNumBlocks"]
                assert 0 <= pg[f"{tier}EvictableNumBlocks"] <= pg[f"{tier}FreeNumBlocks"]

    # ---- rules ----
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=8),
          salt=st.sampled_from([None, None, "s"]), excluded=st.sampled_from([False] * 5 + [True]))
    def create(self, prefix, suffix, salt, excluded):
        prompt = (prefix + suffix)[:MAX_LEN - 4] or [0]
        kv = self.mgr.create_kv_cache(self.next_id, prompt, cache_salt=salt, exclude_from_stats=excluded)
        assert 0 <= kv.num_reused_tokens < len(prompt) or len(prompt) == 1 and kv.num_reused_tokens == 0
        self.reqs[self.next_id] = {"kv": kv, "prompt": prompt, "tokens": prompt[: kv.num_reused_tokens]}
        self.next_id += 1
        kv.resume()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def resume(self, data):
        r = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        r["kv"].resume()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def suspend(self, data):
        r = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        r["kv"].suspend()

    @precondition(lambda self: any(r["kv"].is_active for r in self.reqs.values()))
    @rule(data=st.data(), grow=st.integers(-6, 9))
    def resize(self, data, grow):
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if r["kv"].is_active)))
        kv = self.reqs[rid]["kv"]
        target = min(MAX_LEN, max(kv.history_length, kv.capacity + grow))
        before = (kv.capacity, self.mgr.get_kv_cache_stats())
        if not kv.resize(target):
            assert (kv.capacity, self.mgr.get_kv_cache_stats()) == before, "a failed resize changes nothing"

    @precondition(lambda self: any(r["kv"].is_active and r["kv"].capacity > r["kv"].history_length
                                   for r in self.reqs.values()))
    @rule(data=st.data(), gen=st.lists(st.integers(0, 3), min_size=8, max_size=8))
    def commit(self, data, gen):
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items()
                                               if r["kv"].is_active and r["kv"].capacity > r["kv"].history_length)))
        r = self.reqs[rid]
        kv = r["kv"]
        n = data.draw(st.integers(1, kv.capacity - kv.history_length))
        h = kv.history_length
        tokens = (r["prompt"][h:] + gen * 5)[:n]
        self._write(r, h, tokens)
        kv.commit(tokens)
        r["tokens"] += tokens

    @precondition(lambda self: any(r["kv"].is_active for r in self.reqs.values()))
    @rule(data=st.data(), gen=st.integers(0, 3), decode=st.integers(0, 6))
    def prefill_and_decode(self, data, gen, decode):
        """What the engine does: the whole remaining prompt, then a few one-token steps."""
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if r["kv"].is_active)))
        r = self.reqs[rid]
        kv = r["kv"]
        h = kv.history_length
        rest = r["prompt"][h:] if h < len(r["prompt"]) else []
        for step in range(1 + decode):
            tokens = rest if step == 0 else [gen]
            h = kv.history_length
            if not tokens or h + len(tokens) > MAX_LEN:
                continue
            if kv.capacity < h + len(tokens) and not kv.resize(h + len(tokens)):
                return
            self._write(r, h, tokens)
            kv.commit(tokens)
            r["tokens"] += tokens
            kv.commit_pending_stats()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def commit_stats(self, data):
        self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]["kv"].commit_pending_stats()

    @rule()
    def drain(self):
        self._drain()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), commit_first=st.booleans())
    def close(self, data, commit_first):
        r = self.reqs.pop(data.draw(st.sampled_from(sorted(self.reqs))))
        if commit_first:
            r["kv"].commit_pending_stats()
        r["kv"].close()

    @invariant()
    def active_caches_read_back_what_was_written(self):
        mgr = self.mgr
        for r in self.reqs.values():
            kv = r["kv"]
            if not kv.is_active:
                continue
            assert r["tokens"] == r["prompt"][: len(r["tokens"])] or len(r["tokens"]) > len(r["prompt"])
            for layer in (0, 1):
                k, v = mgr.layer_kv(layer)
                ids = kv.block_ids(mgr.life_cycle_of_layer(layer))
                for p in range(kv.history_length):
                    if ids[p // B] < 0:
                        assert layer == 1, "only the sliding-window layer has stale blocks"
                        continue
                    if layer == 1 and p < kv.history_length + 1 - 8 - B:
                        continue  # outside the window: kept only until its block is released
                    want = kv_value(r["tokens"][: p + 1], layer)
                    assert float(k[ids[p // B], p % B, 0, 0]) == want
                    assert float(v[ids[p // B], p % B, 0, 0]) == -want

    def teardown(self):
        for r in self.reqs.values():
            r["kv"].commit_pending_stats()
            r["kv"].close()
        self._drain()
        stats = self.mgr.get_kv_cache_stats()
        assert stats.used_num_blocks == 0, "no block leaks once every cache is closed"
        for pool in self.mgr._secondary:
            assert pool is None or pool.gauges()[2] == 0
        assert self.drained["alloc"] == stats.alloc_total_blocks
        assert self.drained["reused"] == stats.reused_blocks
        assert self.drained["missed"] == stats.missed_blocks
        d = {k: min(v, 3) for k, v in self.drained.items()}
        event(f"onboard {d['onboard']} offload {d['offload']} reused {d['reused']}")


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
