"""Builders and field lists shared by the two halves of the kvcache spec review."""

import json

import torch

from kvcache import (
    AttentionLayerConfig,
    KvCacheIterationReport,
    KVCacheManager,
    KVCacheManagerConfig,
)

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
