"""What a rank hands over each iteration: one int64 row, read through the rank's static layout.

A rank registers its `RankLayout` once per incarnation (life cycles, pool groups, its place in the cluster);
every iteration it returns a `RankDelta` with its step result: the drained counters per life cycle, the gauges
per pool group, its cumulative `kvCacheStats` and its scheduler figures, packed into one int64 array so a
delta pickles as one small buffer. The layout's `dtype` names the parts (`ROW_PARTS`): the row read through
it is one record of `counters`, `gauges`, `kv_stats` and `sched`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cache
from operator import attrgetter

import numpy as np

from aggregator.request_stats import RequestFigures
from kvcache.residency import BlockStats
from kvcache.stats import COUNTER_KEYS, KV_CACHE_STATS_KEYS, NUM_COUNTERS, camel

NUM_GAUGES = 14  # primary then secondary: max, free, used, evictable, peak free, peak used, peak evictable
# cumulative kvCacheStats as ints (the hit rate is derived)
KV_STATS = tuple(k for k in KV_CACHE_STATS_KEYS if k != "cacheHitRate")


@dataclass(slots=True)
class SchedulerStats:
    """A rank's own scheduler stats for one iteration (vLLM's word), named in records as TensorRT-LLM's
    iteration stats where one exists (`SCHED`: the camelCase names, in row order)."""

    step_us: int = 0
    num_scheduled_requests: int = 0
    num_context_requests: int = 0
    num_gen_requests: int = 0
    num_paused_requests: int = 0
    num_ctx_tokens: int = 0
    num_gen_tokens: int = 0
    iter_suspended_requests: int = 0
    iter_resumed_requests: int = 0
    iter_cached_tokens_level0: int = 0  # prompt tokens new requests found cached on the primary tier
    iter_cached_tokens_level1: int = 0  # ... on the host tier
    gpu_mem_usage: int = 0
    cpu_mem_usage: int = 0
    pinned_mem_usage: int = 0


SCHED = tuple(camel(f.name) for f in fields(SchedulerStats))
KV_STATS_INDEX = {k: i for i, k in enumerate(KV_STATS)}
SCHED_INDEX = {k: i for i, k in enumerate(SCHED)}
assert len(COUNTER_KEYS) == NUM_COUNTERS
ROW_PARTS = ("counters", "gauges", "kv_stats", "sched")  # a row's parts, in row order


@cache
def row_dtype(num_life_cycles: int, num_pool_groups: int) -> np.dtype:
    """The packed row's parts by name: counters [lc, 15], gauges [pg, 14], kv stats [8], sched [14], all int64."""
    shapes = ((num_life_cycles, NUM_COUNTERS), (num_pool_groups, NUM_GAUGES), (len(KV_STATS),), (len(SCHED),))
    return np.dtype([(name, np.int64, shape) for name, shape in zip(ROW_PARTS, shapes, strict=True)])


@dataclass(frozen=True)
class RankLayout:
    """A rank's static stats layout. `life_cycles`: (id, pool group, window key, kind) each; `pool_groups`:
    (id, slot bytes, window keys) each. Ranks with equal `shape` merge as one block of rows. `max_num_blocks`
    and `tokens_per_block`: the primary tier's capacity (kvCacheStats before the first iteration). `node_id`,
    `node_ip`: where this incarnation runs (a restarted group may be on another node)."""

    rank: int
    dp_rank: int
    tp_rank: int
    incarnation: str
    life_cycles: tuple[tuple[int, int, str, str], ...]
    pool_groups: tuple[tuple[int, int, tuple[int, ...]], ...]
    max_num_blocks: int = 0
    tokens_per_block: int = 0
    node_id: str = ""  # the Ray node the rank runs on, and its address (/stats/ranks names them)
    node_ip: str = ""
    shape: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", (self.life_cycles, self.pool_groups))

    @property
    def dtype(self) -> np.dtype:
        """The row's named parts (`row_dtype`, one per shape: a layout pickles, and checkpoints, without it)."""
        return row_dtype(len(self.life_cycles), len(self.pool_groups))

    @property
    def num_counters(self) -> int:
        return len(self.life_cycles) * NUM_COUNTERS

    @property
    def row_size(self) -> int:
        return self.dtype.itemsize // 8

    def parts(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(counters [.., lc, 15], gauges [.., pg, 14], kv stats [.., 8], sched [.., 14]) views of row(s): the
        int64 rows read through `dtype`, so writing a part writes the row."""
        r = rows.view(self.dtype)[..., 0]
        return r["counters"], r["gauges"], r["kv_stats"], r["sched"]


@dataclass(frozen=True, slots=True)
class RankDelta:
    """One rank's iteration: who sent it, its packed row (see RankLayout.parts) and its block residency and
    tier-copy times (None when it had none)."""

    rank: int
    incarnation: str
    row: np.ndarray
    blocks: BlockStats | None = None


@cache
def _getter(cls: type) -> attrgetter:
    return attrgetter(*(f.name for f in fields(cls)))


def values(obj: object) -> tuple:
    """A flat dataclass's field values in order: `dataclasses.astuple` without its recursive deep copy (a
    quarter of a rank's stats cost per step)."""
    return _getter(type(obj))(obj)


def pack(layout: RankLayout, counters, gauges, kv_stats, sched) -> np.ndarray:
    """The row of one iteration from its parts (lists or arrays of ints), in `ROW_PARTS` order."""
    row = np.concatenate([np.asarray(counters, dtype=np.int64).ravel(), np.asarray(gauges, dtype=np.int64).ravel(),
                          np.asarray(kv_stats, dtype=np.int64), np.asarray(sched, dtype=np.int64)])
    if row.shape != (layout.row_size,):
        raise ValueError(f"rank {layout.rank}: a row of {row.size} values does not fit its layout "
                         f"({layout.row_size})")
    return row


@dataclass(frozen=True)
class Iteration:
    """What the engine forwards for one iteration: the deltas of every rank that stepped and answered, the
    ranks it knows are missing (down groups, failed steps), and its own request figures."""

    iteration: int
    timestamp: float
    deltas: list[RankDelta]
    missing: tuple[int, ...] = ()
    engine: dict[str, int] = field(default_factory=dict)  # ENGINE_FIGURES
    routing: dict | None = None  # the placement figures of the iteration (engine/placement.py), if any
    requests: RequestFigures | None = None  # per dp group: request times and token counts (vLLM's metrics)


# the engine's figures for an iteration (TensorRT-LLM names), ints but the queue latency
ENGINE_FIGURES = ("numActiveRequests", "numQueuedRequests", "numCompletedRequests", "numNewActiveRequests",
                  "maxNumActiveRequests", "maxBatchSizeStatic", "maxBatchSizeRuntime", "maxNumTokensStatic",
                  "maxNumTokensRuntime", "newActiveRequestsQueueLatencyMS")
FLOAT_FIGURES = ("newActiveRequestsQueueLatencyMS",)
