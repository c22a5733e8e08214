"""The statistics' field names (docs/stats.md: rank reports, cluster records) and which view carries which."""

from __future__ import annotations

from kvcache.stats import COUNTER_KEYS, KV_CACHE_STATS_KEYS, hit_rate  # noqa: F401  (hit_rate re-exported)

VIEWS = ("kvCacheIterationStats", "kvCacheIterationStatsByPoolGroup", "kvCacheIterationStatsByLifecycle")
WINDOW_VIEW, POOL_VIEW, LIFECYCLE_VIEW = VIEWS

# the iteration counters are kvcache's (one place for the spec's names); bytes are summed over every tp rank
BYTE_FIELDS = tuple(k for k in COUNTER_KEYS if k.endswith("Bytes"))
BLOCK_COUNTER_FIELDS = tuple(k for k in COUNTER_KEYS if not k.endswith("Bytes"))
COUNTER_FIELDS = BLOCK_COUNTER_FIELDS + BYTE_FIELDS
HIT_RATE_FIELD = "iterCacheHitRate"
TIERS = ("primary", "secondary")
GAUGE_FIELDS = tuple(f"{t}{s}NumBlocks" for t in TIERS for s in ("Max", "Free", "Used", "Evictable"))
PEAK_FIELDS = tuple(f"{t}Peak{s}NumBlocks" for t in TIERS for s in ("Free", "Used", "Evictable"))
# fields that are neither counted nor gauged: descriptive, taken from the first report that has the key
STATIC_FIELDS = {
    WINDOW_VIEW: (),
    POOL_VIEW: ("poolGroupId", "slotSize"),
    LIFECYCLE_VIEW: ("lifeCycleId", "poolGroupId", "windowSize", "kind"),
}
# which counters each view carries (docs/stats.md): the pool-group view has no reuse fields, the
# life-cycle view only reuse fields and no gauges
_REUSE = ("iterReusedBlocks", "iterFullReusedBlocks", "iterPartialReusedBlocks", "iterMissedBlocks")
VIEW_COUNTERS = {
    WINDOW_VIEW: COUNTER_FIELDS,
    POOL_VIEW: tuple(f for f in COUNTER_FIELDS if f not in _REUSE),
    LIFECYCLE_VIEW: _REUSE,
}
VIEW_HAS_GAUGES = {WINDOW_VIEW: True, POOL_VIEW: True, LIFECYCLE_VIEW: False}
VIEW_HAS_HIT_RATE = {WINDOW_VIEW: True, POOL_VIEW: False, LIFECYCLE_VIEW: True}
VIEW_KEY_NAME = {WINDOW_VIEW: "window", POOL_VIEW: "poolGroup", LIFECYCLE_VIEW: "lifeCycle"}

KV_STATS_COUNTERS = ("allocTotalBlocks", "allocNewBlocks", "reusedBlocks", "missedBlocks")
KV_STATS_GAUGES = ("maxNumBlocks", "freeNumBlocks", "usedNumBlocks")
assert set(KV_STATS_GAUGES + KV_STATS_COUNTERS) < set(KV_CACHE_STATS_KEYS)

# the counters of a record's `routing` field (engine/placement.py) that /metrics sums
ROUTING_COUNTERS = ("requests", "predictedReusedBlocks", "realizedReusedBlocks", "indexResyncs")
