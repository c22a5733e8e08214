"""One rank's V2 KV cache manager and its statistics (docs/stats.md). No Ray, no HTTP.

Modules, lowest first: `stats` (counter indices, the spec's field names, the records; no torch), `config`
(the manager's config and the life cycles / pool groups derived from the layers), `attention` (full and
sliding-window policies: half-open stale ranges, blocks needed), `pool` (slot pools per tier, LRU of
evictable pages, gauges and peaks), `tree` (the reuse tree of published blocks), `reuse` (the trees' roots
per salt, and how far a prompt matches), `events` (KV events of the tree and the block keys, off unless asked
for), `pending` (a request's pending statistics: segments, rollback, commit), `cache` (one request's
`KVCache`), `manager` (`KVCacheManager`: tiers, eviction, offload/onboard, the public verbs the caches call,
stats drains).

The statistics records import without torch, so the aggregator can share their field names without loading
torch; the manager and its configs load torch on first use.
"""

from kvcache.stats import (
    KvCacheIterationReport,
    KVCacheIterationStatsDelta,
    KvCacheStats,
    KVCacheStatsDelta,
    hit_rate,
)

_LAZY = {
    "AttentionLayerConfig": ".config",
    "KVCacheManagerConfig": ".config",
    "KVCache": ".cache",
    "KVCacheError": ".cache",
    "KVCacheManager": ".manager",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'kvcache' has no attribute {name!r}")


__all__ = [
    "AttentionLayerConfig",
    "KVCache",
    "KVCacheError",
    "KVCacheIterationStatsDelta",
    "KVCacheManager",
    "KVCacheManagerConfig",
    "KVCacheStatsDelta",
    "KvCacheIterationReport",
    "KvCacheStats",
    "hit_rate",
]
