"""Merging one iteration's rank deltas into the statistics of one cluster record (pure, no Ray).

The cluster merge rules (docs/stats.md), on packed rows (aggregator/delta.py):
- Within a dp group the reference rank is its lowest tp rank present (tp rank 0 on a healthy cluster). Its
  block counters and gauges stand for the group: tp ranks make identical block decisions, so adding them
  would multiply by tp. Byte counters (`iter*Bytes`) are summed over every rank (each moves its own shard).
  Any other tp rank's block counters and gauges that differ from the reference are listed in `tpDivergence`.
- Across dp groups counters, gauges and peaks are summed (peaks: an upper bound of the peak of the sum).
  The reference rows of ranks with the same layout are summed as arrays, then turned into the spec's three
  views once; layouts that differ (rare) are merged view by view.
- Hit rates are recomputed from merged reused/missed counts; `tokensPerBlock` must agree (else an `errors`
  entry, never an exception).
- Scheduler figures: group figures (requests, tokens) come from each group's reference rank and are summed
  over groups; memory is summed over every rank; the iteration latency is the slowest rank's step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aggregator.delta import KV_STATS_INDEX, SCHED, SCHED_INDEX, RankLayout
from aggregator.fields import HIT_RATE_FIELD, LIFECYCLE_VIEW, POOL_VIEW, STATIC_FIELDS, VIEW_KEY_NAME, VIEWS
from kvcache.stats import COUNTER_KEYS, GAUGE_KEYS, KvCacheIterationReport, PoolGroupSnapshot, hit_rate

_BYTES = np.array([k.endswith("Bytes") for k in COUNTER_KEYS])
_MEMORY = [SCHED_INDEX[k] for k in ("gpuMemUsage", "cpuMemUsage", "pinnedMemUsage")]
_STEP = SCHED_INDEX["stepUs"]


@dataclass
class Merged:
    """The statistics of one cluster record, before the record's own fields are added."""

    views: dict[str, dict[str, dict[str, Any]]]
    sched: dict[str, int]  # SCHED figures summed as described above
    tokens_per_block: int | None = None
    tp_divergence: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)


def views_of(layout: RankLayout, row: np.ndarray) -> dict[str, dict[str, dict[str, Any]]]:
    """The spec's three views (kvcache's own builder) of one row, or of a sum of rows of this layout."""
    counters, gauges, _, _ = layout.parts(row)
    lcs = [{"id": i, "pool_group": pg, "window_key": key, "kind": kind} for i, pg, key, kind in layout.life_cycles]
    pgs = [PoolGroupSnapshot(i, slot, list(keys), tuple(g[:7].tolist()), tuple(g[7:].tolist()))
           for (i, slot, keys), g in zip(layout.pool_groups, gauges, strict=True)]
    views = KvCacheIterationReport(lcs, counters.tolist(), pgs).to_dict()
    for bucket in views[POOL_VIEW].values():  # TensorRT-LLM's V2 serializer: one slot size per pool of the group
        bucket["slotSize"] = [bucket["slotSize"]]
    return views


def merge(rows: list[tuple[RankLayout, np.ndarray]]) -> Merged:
    """Merge one iteration: each rank's row with the layout its incarnation registered."""
    if rows and _uniform(rows):
        return _merge_uniform(rows)
    return _merge_general(rows)


def _uniform(rows: list[tuple[RankLayout, np.ndarray]]) -> bool:
    """The usual iteration: one layout, every dp group present with all its tp ranks 0..tp-1 in rank order."""
    shape, tp = rows[0][0].shape, 1 + max(lay.tp_rank for lay, _ in rows)
    if len(rows) % tp:
        return False
    for i, (lay, _) in enumerate(rows):
        if lay.shape != shape or lay.tp_rank != i % tp or lay.dp_rank != rows[i - lay.tp_rank][0].dp_rank:
            return False
    return True


def _merge_uniform(rows: list[tuple[RankLayout, np.ndarray]]) -> Merged:
    """The same rules as `_merge_general`, as whole-array operations on the [dp, tp, row] stack: the per-rank
    loop was most of the aggregator's time at 256 ranks (bench/aggregator_bench.py; figures in bench/README.md)."""
    lay = rows[0][0]
    tp = 1 + max(la.tp_rank for la, _ in rows)
    stack = np.stack([r for _, r in rows]).reshape(len(rows) // tp, tp, -1)
    counters, gauges, kv, sched = lay.parts(stack)  # [dp, tp, ...] views
    if tp > 1 and ((counters[:, 1:, :, ~_BYTES] != counters[:, :1, :, ~_BYTES]).any()
                   or (gauges[:, 1:] != gauges[:, :1]).any()):
        return _merge_general(rows)  # a tp divergence: let the general path name every field
    total = stack[:, 0].sum(axis=0)
    total_counters = lay.parts(total)[0]
    total_counters[:, _BYTES] = counters[..., _BYTES].sum(axis=(0, 1))
    out = lay.parts(total)[3]
    out[_MEMORY] = sched[..., _MEMORY].sum(axis=(0, 1))
    out[_STEP] = sched[..., _STEP].max()
    merged = Merged(views_of(lay, total), dict(zip(SCHED, out.tolist(), strict=True)))
    tpbs = np.unique(kv[..., KV_STATS_INDEX["tokensPerBlock"]]).tolist()
    _check_tokens_per_block(merged, set(tpbs))
    return merged


def _check_tokens_per_block(merged: Merged, tpbs: set[int]) -> None:
    if len(tpbs) > 1:
        merged.errors.append({"field": "tokensPerBlock", "error": "ranks disagree on tokensPerBlock",
                              "values": sorted(tpbs)})
    merged.tokens_per_block = min(tpbs) if tpbs else None


def _merge_general(rows: list[tuple[RankLayout, np.ndarray]]) -> Merged:
    groups: dict[int, list[tuple[RankLayout, np.ndarray]]] = {}
    for lay, row in rows:
        groups.setdefault(lay.dp_rank, []).append((lay, row))
    sums: dict[tuple, tuple[RankLayout, np.ndarray]] = {}  # layout shape -> (layout, summed reference rows)
    sched = np.zeros(len(SCHED), dtype=np.int64)
    memory = np.zeros(len(_MEMORY), dtype=np.int64)
    step = 0
    divergence: list[dict[str, Any]] = []
    tpbs = set()
    for dp in sorted(groups):
        members = sorted(groups[dp], key=lambda m: m[0].tp_rank)
        ref, row = members[0]
        if len(members) > 1:
            row = row.copy()
            for lay, other in members[1:]:
                divergence += _divergence(ref, row, lay, other)
                if lay.shape == ref.shape:
                    c, oc = ref.parts(row)[0], lay.parts(other)[0]
                    c[:, _BYTES] += oc[:, _BYTES]
        for lay, r in members:
            s = lay.parts(r)[3]
            memory += s[_MEMORY]
            step = max(step, int(s[_STEP]))
            tpbs.add(int(lay.parts(r)[2][KV_STATS_INDEX["tokensPerBlock"]]))
        sched += ref.parts(row)[3]
        have = sums.get(ref.shape)
        sums[ref.shape] = (ref, row.copy() if have is None else have[1] + row)
    sched[_MEMORY] = memory
    sched[_STEP] = step
    views: dict[str, dict[str, dict[str, Any]]] = {v: {} for v in VIEWS}
    for lay, row in sums.values():
        _add_views(views, views_of(lay, row))
    merged = Merged(views, dict(zip(SCHED, sched.tolist(), strict=True)), tp_divergence=divergence)
    _check_tokens_per_block(merged, tpbs)
    return merged


def _add_views(into: dict[str, dict], views: dict[str, dict]) -> None:
    """Add one layout's views into the merged ones (keys unioned, numbers summed, hit rates recomputed)."""
    for view in VIEWS:
        acc = into[view]
        for key, bucket in views[view].items():
            have = acc.get(key)
            if have is None:
                acc[key] = dict(bucket)
                continue
            for f, v in bucket.items():
                if f in STATIC_FIELDS[view] or f == HIT_RATE_FIELD:
                    continue
                have[f] = sorted(set(have[f]) | set(v)) if f == "windowSizes" else have[f] + v
            if HIT_RATE_FIELD in have:
                have[HIT_RATE_FIELD] = hit_rate(have["iterReusedBlocks"], have["iterMissedBlocks"])


def _divergence(ref: RankLayout, ref_row: np.ndarray, lay: RankLayout, row: np.ndarray) -> list[dict[str, Any]]:
    """Block counters and gauges of a tp rank that differ from its group's reference rank."""
    where = {"dpRank": lay.dp_rank, "tpRank": lay.tp_rank, "referenceTpRank": ref.tp_rank}
    if lay.shape != ref.shape:
        return [{**where, "field": "layout", "expected": repr(ref.shape), "got": repr(lay.shape)}]
    (c0, g0, _, _), (c1, g1, _, _) = ref.parts(ref_row), lay.parts(row)
    out = []
    for lc, i in zip(*np.nonzero((c0 != c1) & ~_BYTES), strict=True):
        out.append({**where, "view": LIFECYCLE_VIEW, VIEW_KEY_NAME[LIFECYCLE_VIEW]: str(ref.life_cycles[lc][0]),
                    "field": COUNTER_KEYS[i], "expected": int(c0[lc, i]), "got": int(c1[lc, i])})
    for pg, i in zip(*np.nonzero(g0 != g1), strict=True):
        out.append({**where, "view": POOL_VIEW, VIEW_KEY_NAME[POOL_VIEW]: str(ref.pool_groups[pg][0]),
                    "field": GAUGE_KEYS[i], "expected": int(g0[pg, i]), "got": int(g1[pg, i])})
    return out
