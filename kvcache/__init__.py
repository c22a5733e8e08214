"""One rank's V2 KV cache manager and its statistics (contract: SPEC-kv-stats.md). No Ray, no HTTP."""

from .cache import KVCache, KVCacheError
from .config import AttentionLayerConfig, KVCacheManagerConfig
from .manager import KVCacheManager
from .stats import (
    KvCacheIterationReport,
    KVCacheIterationStatsDelta,
    KvCacheStats,
    KVCacheStatsDelta,
    hit_rate,
)

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
