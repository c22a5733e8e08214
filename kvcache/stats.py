"""Statistics records of one rank's KV cache, named and shaped like TensorRT-LLM's KV cache V2 stats.

Counters are kept as plain lists of ints indexed by the constants below (one list per life cycle), so the
hot path adds to a list slot and never builds an object; records are built only when someone asks.
"""

from dataclasses import dataclass, fields

# Per-life-cycle iteration counters, in the order of the spec's iteration delta fields (hit rate is derived).
(
    ALLOC_TOTAL,
    ALLOC_NEW,
    REUSED,
    FULL_REUSED,
    PARTIAL_REUSED,
    MISSED,
    GEN_ALLOC,
    ONBOARD,
    ONBOARD_BYTES,
    OFFLOAD,
    OFFLOAD_BYTES,
    COPY,
    COPY_BYTES,
    DROPPED,
    DROPPED_BYTES,
) = range(15)
NUM_COUNTERS = 15

COUNTER_KEYS = (
    "iterAllocTotalBlocks",
    "iterAllocNewBlocks",
    "iterReusedBlocks",
    "iterFullReusedBlocks",
    "iterPartialReusedBlocks",
    "iterMissedBlocks",
    "iterGenAllocBlocks",
    "iterOnboardBlocks",
    "iterOnboardBytes",
    "iterOffloadBlocks",
    "iterOffloadBytes",
    "iterIntraDeviceCopyBlocks",
    "iterIntraDeviceCopyBytes",
    "iterHostDroppedBlocks",
    "iterHostDroppedBytes",
)
# Counters that the pool-group view carries (no reuse fields).
POOL_GROUP_COUNTERS = (ALLOC_TOTAL, ALLOC_NEW, GEN_ALLOC, ONBOARD, ONBOARD_BYTES, OFFLOAD, OFFLOAD_BYTES, COPY,
                       COPY_BYTES, DROPPED, DROPPED_BYTES)
LIFE_CYCLE_COUNTERS = (REUSED, FULL_REUSED, PARTIAL_REUSED, MISSED)
GAUGE_NAMES = ("MaxNumBlocks", "FreeNumBlocks", "UsedNumBlocks", "EvictableNumBlocks", "PeakFreeNumBlocks",
               "PeakUsedNumBlocks", "PeakEvictableNumBlocks")
GAUGE_KEYS = tuple(f"{tier}{name}" for tier in ("primary", "secondary") for name in GAUGE_NAMES)


def hit_rate(reused: int, missed: int) -> float:
    """reused / (reused + missed); 0.0 when either reused or the sum is 0."""
    total = reused + missed
    return reused / total if reused and total else 0.0


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


class IdKeyDict(dict):
    """A dict keyed by JSON strings that also answers to int keys, so `d[0]` and `d["0"]` both work.

    Records cross JSON and actor boundaries, where int keys become strings; this keeps Python callers free to
    use the ids as the ints they are.
    """

    def __missing__(self, key):
        if isinstance(key, int):
            return dict.__getitem__(self, str(key))
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, str(key) if isinstance(key, int) else key)

    def get(self, key, default=None):
        return dict.get(self, str(key) if isinstance(key, int) else key, default)

    def __reduce__(self):
        """Pickles as a plain dict: a receiver (the aggregator) needs neither this class nor torch."""
        return (dict, (dict(self),))


@dataclass(eq=False, slots=True)
class KVCacheStatsDelta:
    """Cumulative-manager-total counters: a request's delta, or the manager's running totals.

    A dataclass that also reads as the tuple the spec prints, `(alloc_total, alloc_new, reused, missed)`:
    it iterates, unpacks and compares equal to that tuple. Treat it as immutable (it is not frozen only
    because a frozen dataclass's __init__ costs several times more on the stats path)."""

    alloc_total_blocks: int = 0
    alloc_new_blocks: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0

    def astuple(self) -> tuple[int, int, int, int]:
        return (self.alloc_total_blocks, self.alloc_new_blocks, self.reused_blocks, self.missed_blocks)

    def __iter__(self):
        return iter(self.astuple())

    def __len__(self) -> int:
        return 4

    def __eq__(self, other) -> bool:
        if isinstance(other, KVCacheStatsDelta | tuple):
            return self.astuple() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.astuple())

    def __add__(self, other: "KVCacheStatsDelta") -> "KVCacheStatsDelta":
        return KVCacheStatsDelta(*(a + b for a, b in zip(self, other, strict=True)))

    @property
    def empty(self) -> bool:
        return not any(self.astuple())

    def to_dict(self) -> dict[str, int]:
        return {camel(f.name): getattr(self, f.name) for f in fields(self)}


EMPTY_DELTA = KVCacheStatsDelta()


@dataclass(frozen=True)
class KvCacheStats:
    """Cumulative `kvCacheStats` (primary tier gauges summed over pool groups)."""

    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int
    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    missed_blocks: int

    @property
    def cache_hit_rate(self) -> float:
        return hit_rate(self.reused_blocks, self.missed_blocks)

    def to_dict(self) -> dict:
        out = {camel(f.name): getattr(self, f.name) for f in fields(self)}
        out["cacheHitRate"] = self.cache_hit_rate
        return out


# the 9 camelCase keys of `kvCacheStats`, in order (the fields above, then the derived hit rate)
KV_CACHE_STATS_KEYS = tuple(camel(f.name) for f in fields(KvCacheStats)) + ("cacheHitRate",)


@dataclass(frozen=True)
class KVCacheIterationStatsDelta:
    """One life cycle's (or one window's) iteration counters."""

    iter_alloc_total_blocks: int = 0
    iter_alloc_new_blocks: int = 0
    iter_reused_blocks: int = 0
    iter_full_reused_blocks: int = 0
    iter_partial_reused_blocks: int = 0
    iter_missed_blocks: int = 0
    iter_gen_alloc_blocks: int = 0
    iter_onboard_blocks: int = 0
    iter_onboard_bytes: int = 0
    iter_offload_blocks: int = 0
    iter_offload_bytes: int = 0
    iter_intra_device_copy_blocks: int = 0
    iter_intra_device_copy_bytes: int = 0
    iter_host_dropped_blocks: int = 0
    iter_host_dropped_bytes: int = 0

    @classmethod
    def from_counters(cls, counters: list[int]) -> "KVCacheIterationStatsDelta":
        return cls(*counters)

    @property
    def iter_cache_hit_rate(self) -> float:
        return hit_rate(self.iter_reused_blocks, self.iter_missed_blocks)

    def to_dict(self) -> dict:
        return counters_to_dict(list(self.__dict__.values()))


def counters_to_dict(c: list[int]) -> dict:
    """The 16 iteration fields of a bucket, from a counter list."""
    out = {key: c[i] for i, key in enumerate(COUNTER_KEYS[:6])}
    out["iterCacheHitRate"] = hit_rate(c[REUSED], c[MISSED])
    out.update({key: c[i + 6] for i, key in enumerate(COUNTER_KEYS[6:])})
    return out


@dataclass
class PoolGroupSnapshot:
    """Gauges of one pool group at a drain: [max, free, used, evictable, peak free, peak used, peak evictable]
    for the primary and the secondary tier."""

    id: int
    slot_bytes: int
    window_keys: list[int]
    primary: tuple[int, ...]
    secondary: tuple[int, ...]

    def gauges(self) -> dict[str, int]:
        return dict(zip(GAUGE_KEYS, self.primary + self.secondary, strict=True))


@dataclass
class KvCacheIterationReport:
    """What one drain of `get_iteration_stats()` saw: per-life-cycle counters and per-pool-group gauges."""

    life_cycles: list[dict]  # static, shared between reports: {"id", "pool_group", "window_key", "kind"}
    counters: list[list[int]]  # per life cycle, indexed by the constants at the top
    pool_groups: list[PoolGroupSnapshot]

    def to_dict(self) -> dict:
        windows: dict[str, list[int]] = {}
        for meta, counters in zip(self.life_cycles, self.counters, strict=True):
            acc = windows.setdefault(meta["window_key"], [0] * NUM_COUNTERS)
            for i, v in enumerate(counters):
                acc[i] += v
        buckets = IdKeyDict()
        for key, counters in windows.items():
            bucket = counters_to_dict(counters)
            gauges = [0] * len(GAUGE_KEYS)
            for group in self.pool_groups:
                if group.window_keys == [int(key)]:
                    gauges = [a + b for a, b in zip(gauges, group.primary + group.secondary, strict=True)]
            bucket.update(zip(GAUGE_KEYS, gauges, strict=True))
            buckets[key] = bucket
        by_pg = IdKeyDict()
        for group in self.pool_groups:
            acc = [0] * NUM_COUNTERS
            for meta, counters in zip(self.life_cycles, self.counters, strict=True):
                if meta["pool_group"] == group.id:
                    for i, v in enumerate(counters):
                        acc[i] += v
            entry = {"poolGroupId": group.id, "slotSize": group.slot_bytes, "windowSizes": list(group.window_keys)}
            entry.update(group.gauges())
            entry.update({COUNTER_KEYS[i]: acc[i] for i in POOL_GROUP_COUNTERS})
            by_pg[str(group.id)] = entry
        by_lc = IdKeyDict()
        for meta, c in zip(self.life_cycles, self.counters, strict=True):
            entry = {"lifeCycleId": meta["id"], "poolGroupId": meta["pool_group"],
                     "windowSize": int(meta["window_key"]), "kind": meta["kind"]}
            entry.update({COUNTER_KEYS[i]: c[i] for i in LIFE_CYCLE_COUNTERS})
            entry["iterCacheHitRate"] = hit_rate(c[REUSED], c[MISSED])
            by_lc[str(meta["id"])] = entry
        return {
            "kvCacheIterationStats": buckets,
            "kvCacheIterationStatsByPoolGroup": by_pg,
            "kvCacheIterationStatsByLifecycle": by_lc,
        }
