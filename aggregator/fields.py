"""The field names of SPEC section 4 (rank reports, cluster records) and which view carries which."""

from __future__ import annotations

VIEWS = ("kvCacheIterationStats", "kvCacheIterationStatsByPoolGroup", "kvCacheIterationStatsByLifecycle")
WINDOW_VIEW, POOL_VIEW, LIFECYCLE_VIEW = VIEWS

BYTE_FIELDS = ("iterOnboardBytes", "iterOffloadBytes", "iterIntraDeviceCopyBytes", "iterHostDroppedBytes")
BLOCK_COUNTER_FIELDS = (
    "iterAllocTotalBlocks",
    "iterAllocNewBlocks",
    "iterReusedBlocks",
    "iterFullReusedBlocks",
    "iterPartialReusedBlocks",
    "iterMissedBlocks",
    "iterGenAllocBlocks",
    "iterOnboardBlocks",
    "iterOffloadBlocks",
    "iterIntraDeviceCopyBlocks",
    "iterHostDroppedBlocks",
)
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
# which counters each view carries (SPEC section 4): the pool-group view has no reuse fields, the
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
KV_STATS_KEYS = KV_STATS_GAUGES + ("tokensPerBlock",) + KV_STATS_COUNTERS + ("cacheHitRate",)


def hit_rate(reused: int | float, missed: int | float) -> float:
    """reused / (reused + missed); 0.0 when either is 0 (SPEC section 3)."""
    if not reused or not reused + missed:
        return 0.0
    return reused / (reused + missed)
