"""One rank's V2 KV cache manager and its statistics (contract: SPEC-kv-stats.md). No Ray, no HTTP.

The statistics records (`kvcache.stats`) import without torch, so the aggregator can share their field
names without loading torch; the manager and its configs load torch on first use.
"""

from .stats import (
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
