"""Turning the engine's iterations into cluster records (pure, no Ray): dedupe, cumulative totals, fields.

The engine sends iterations in order, each with the deltas of every rank it stepped, so an iteration is
complete on arrival and is emitted at once. Ingest is idempotent: an iteration at or below the last emitted
one was already counted (a retried call, or a re-send after a lost reply) and is dropped as a duplicate, so
nothing is counted twice. A restarted aggregator restores `checkpoint()`: it continues after the last
iteration its predecessor checkpointed, and the engine re-sends everything after that. No delta can arrive
after its iteration was emitted, so `lateDeltas` is always 0 here; the field stays for readers' schemas.

Cluster cumulative `kvCacheStats`: each record adds, per dp group, how far the cumulative counters of the
group's reference rank grew since that rank incarnation's own previous delta (from zero for a new incarnation:
a restarted rank starts at zero, and what its earlier incarnations counted stays in the total), floored so they
never go backwards; the gauges are the reference ranks' latest. The reference rank is the one whose block
counters the merge takes (aggregator/merge.py): the lowest tp rank present, tp rank 0 on a healthy cluster. It
must be the same rank: when tp rank 0 is killed mid-step and its tp peer still answers, the record's block
counters are the peer's, and a cumulative that followed tp rank 0 alone would never count them (the dead
incarnation reports no more, the new one starts at zero), so the cluster cumulative would grow less than the
record's counters. Every rank's last snapshot is kept for that.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from datetime import UTC, datetime
from typing import Any

import numpy as np

from aggregator.delta import ENGINE_FIGURES, FLOAT_FIGURES, KV_STATS, SCHED, Iteration, RankDelta, RankLayout
from aggregator.fields import KV_STATS_COUNTERS, KV_STATS_GAUGES
from aggregator.merge import merge, views_of
from kvcache.stats import hit_rate

_COUNTERS = [KV_STATS.index(k) for k in KV_STATS_COUNTERS]
_GAUGES = [KV_STATS.index(k) for k in KV_STATS_GAUGES]
_TPB = KV_STATS.index("tokensPerBlock")
# TensorRT-LLM's tier names per cache level (kv_cache_stats.py's cache_level_tiers: "gpu", "host", "disk");
# level 0 is the primary tier, on CPU ranks too
CACHE_LEVEL_TIERS = ("gpu", "host")
# what TensorRT-LLM reports without a batch-size tuner, and the static-batching stats of an inflight-batching
# engine (its iteration-stats report builder writes these zeros)
NO_TUNER = {"maxBatchSizeTunerRecommended": 0, "maxNumTokensTunerRecommended": 0}
STATIC_BATCHING_STATS = {"numScheduledRequests": 0, "numContextRequests": 0, "numCtxTokens": 0, "numGenTokens": 0,
                         "emptyGenSlots": 0}
COUNT_KEYS = ("iterations", "records", "incomplete", "deltas", "duplicates", "rejected", "tp_divergences",
              "late_deltas")


def iso_timestamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Cumulative:
    """The cluster's cumulative kvCacheStats: the growth of every dp group's reference rank, summed."""

    def __init__(self) -> None:
        # (rank, incarnation) -> the counters of its latest delta, every tp rank's (any may become a reference)
        self.last: dict[tuple[int, str], list[int]] = {}
        self.total = [0] * len(_COUNTERS)
        self.gauges: dict[int, list[int]] = {}  # a dp group's tp rank 0 -> the group's latest gauges
        self.floor = [0] * len(_COUNTERS)
        self.tokens_per_block = 0

    def seed(self, layout: RankLayout) -> None:
        """A new incarnation's empty cache, from its registered capacity: known before its first delta."""
        if layout.tp_rank != 0 or (layout.rank, layout.incarnation) in self.last:
            return
        self.gauges[layout.rank] = [layout.max_num_blocks, layout.max_num_blocks, 0]  # KV_STATS_GAUGES order
        self.tokens_per_block = self.tokens_per_block or layout.tokens_per_block

    def update(self, layout: RankLayout, kv_stats: np.ndarray, reference: bool) -> None:
        """A rank's delta; `reference`: its block counters stand for its dp group in this record."""
        key = (layout.rank, layout.incarnation)
        counters = kv_stats[_COUNTERS].tolist()
        if key not in self.last:  # a new incarnation: the rank's earlier ones never report again
            for old in [k for k in self.last if k[0] == layout.rank]:
                del self.last[old]
        if reference:
            before = self.last.get(key) or [0] * len(_COUNTERS)
            self.total = [t + c - b for t, c, b in zip(self.total, counters, before, strict=True)]
            self.gauges[layout.rank - layout.tp_rank] = kv_stats[_GAUGES].tolist()
            self.tokens_per_block = int(kv_stats[_TPB]) or self.tokens_per_block
        self.last[key] = counters

    def snapshot(self) -> Cumulative:
        """A copy to roll back to: O(ranks), since `update` replaces the lists it keeps, never changes them."""
        other = copy.copy(self)
        other.last, other.gauges = dict(self.last), dict(self.gauges)
        return other

    def stats(self) -> dict[str, Any]:
        self.floor = [max(a, b) for a, b in zip(self.floor, self.total, strict=True)]
        gauges = [sum(g[i] for g in self.gauges.values()) for i in range(len(_GAUGES))]
        out: dict[str, Any] = dict(zip(KV_STATS_GAUGES, gauges, strict=True))
        out["tokensPerBlock"] = self.tokens_per_block
        out.update(zip(KV_STATS_COUNTERS, self.floor, strict=True))
        out["cacheHitRate"] = hit_rate(out["reusedBlocks"], out["missedBlocks"])
        return out

    def to_state(self) -> dict[str, Any]:
        return {"last": self.last, "total": self.total, "gauges": self.gauges, "floor": self.floor,
                "tpb": self.tokens_per_block}

    def restore(self, state: dict[str, Any]) -> None:
        # a checkpoint written before `last`/`total` banked tp rank 0's latest snapshots, whose sum the floor holds
        self.last = dict(state["last"] if "last" in state else state["banked"])
        self.total = list(state.get("total", state["floor"]))
        self.gauges, self.floor, self.tokens_per_block = dict(state["gauges"]), list(state["floor"]), state["tpb"]


class Assembler:
    """Registered layouts, the last emitted iteration, counts, and the record builder.

    A rank's incarnations registered before the one that reports never report again: their layouts are
    superseded then, and forgotten once no kept rank detail names them (`forget_layouts`), so the layouts (and
    their checkpoint) stay bounded by the live ranks plus the detail window, whatever the number of restarts.
    """

    def __init__(self, engine_id: str, world_size: int, tp: int, epoch: int = 1) -> None:
        self.engine_id, self.world_size, self.tp, self.epoch = engine_id, world_size, tp, epoch
        # by (rank, incarnation): a restarted rank's last deltas may still arrive after its new layout
        self.layouts: dict[tuple[int, str], RankLayout] = {}
        self.last_emitted: int | None = None
        self.cumulative = Cumulative()
        self.counts = dict.fromkeys(COUNT_KEYS, 0)
        self.latest: dict[int, tuple[RankDelta, int, float]] = {}  # rank -> (delta, iteration, wall time)
        self.missing: tuple[int, ...] = ()  # of the newest record
        # (iteration, keys): layouts superseded when that iteration was emitted, oldest first
        self.superseded: deque[tuple[int, list[tuple[int, str]]]] = deque()

    def register(self, layouts: list[RankLayout]) -> None:
        """A rank's layout, once per incarnation (a new incarnation replaces the old one)."""
        for lay in layouts:
            if not isinstance(lay, RankLayout) or not 0 <= lay.rank < self.world_size:
                raise ValueError(f"register: not a layout of a rank in [0, {self.world_size}): {lay!r}")
            if (lay.dp_rank, lay.tp_rank) != divmod(lay.rank, self.tp):
                raise ValueError(f"register: rank {lay.rank} is not dp {lay.dp_rank} tp {lay.tp_rank} at tp {self.tp}")
            self.layouts[(lay.rank, lay.incarnation)] = lay
            self.cumulative.seed(lay)

    @staticmethod
    def check(iterations: list[Iteration]) -> None:
        """Raise ValueError for a batch that is not a list of Iteration objects."""
        if not isinstance(iterations, list):
            raise ValueError(f"ingest takes a list of Iteration objects, got {type(iterations).__name__}")
        for it in iterations:
            if not isinstance(it, Iteration):
                raise ValueError(f"ingest takes Iteration objects, got {type(it).__name__}")

    def ingest(self, iterations: list[Iteration]) -> list[dict[str, Any]]:
        """Records for the iterations not seen before, in order (a bad batch changes nothing)."""
        self.check(iterations)
        records = []
        for it in iterations:
            if self.last_emitted is not None and it.iteration <= self.last_emitted:
                self.counts["duplicates"] += len(it.deltas)
                continue
            records.append(self._record(it))
            self.last_emitted = it.iteration
        return records

    def _accepted(self, it: Iteration) -> tuple[list[tuple[RankLayout, RankDelta]], list[dict[str, Any]]]:
        ok, errors = [], []
        for d in it.deltas:
            lay = self.layouts.get((getattr(d, "rank", None), getattr(d, "incarnation", None)))
            if lay is None:
                errors.append({"rank": getattr(d, "rank", None), "error": "no registered layout for this incarnation"})
            elif not isinstance(d.row, np.ndarray) or d.row.dtype != np.int64 or d.row.shape != (lay.row_size,):
                errors.append({"rank": d.rank, "error": f"row must be int64[{lay.row_size}]"})
            else:
                ok.append((lay, d))
        self.counts["rejected"] += len(errors)
        return ok, errors

    def _record(self, it: Iteration) -> dict[str, Any]:
        accepted, errors = self._accepted(it)
        merged = merge([(lay, d.row) for lay, d in accepted])
        now = time.time()
        refs: dict[int, RankLayout] = {}  # dp group -> its lowest tp rank present, as merge() takes it
        for lay, _ in accepted:
            if lay.dp_rank not in refs or lay.tp_rank < refs[lay.dp_rank].tp_rank:
                refs[lay.dp_rank] = lay
        for lay, d in accepted:
            self.cumulative.update(lay, lay.parts(d.row)[2], refs[lay.dp_rank] is lay)
            held = self.latest.get(d.rank)
            if held is None or held[0].incarnation != d.incarnation:
                self._supersede(lay, it.iteration)
            self.latest[d.rank] = (d, it.iteration, now)
        reported = sorted(d.rank for _, d in accepted)
        missing = sorted(set(range(self.world_size)) - set(reported))
        self.missing = tuple(missing)
        c = self.counts
        c["iterations"] += 1
        c["records"] += 1
        c["deltas"] += len(accepted)
        c["incomplete"] += bool(missing)
        c["tp_divergences"] += len(merged.tp_divergence)
        s = merged.sched
        eng = {k: (float if k in FLOAT_FIGURES else int)(it.engine.get(k, 0)) for k in ENGINE_FIGURES}
        gen = s["numGenRequests"]
        tiers = CACHE_LEVEL_TIERS[:1 + any(b.get("secondaryMaxNumBlocks")
                                           for b in merged.views["kvCacheIterationStatsByPoolGroup"].values())]
        routing = {} if it.routing is None else {"routing": it.routing}
        return {
            "iter": it.iteration, "timestamp": iso_timestamp(it.timestamp), "engineId": self.engine_id,
            "aggregatorEpoch": self.epoch, "numRanks": self.world_size, "reportedRanks": reported,
            "missingRanks": missing, "complete": not missing, "lateDeltas": 0,
            "tpDivergence": merged.tp_divergence, "errors": merged.errors + errors,
            "kvCacheStats": self.cumulative.stats(), **merged.views,
            "iterLatencyMS": s["stepUs"] / 1000, **eng, **NO_TUNER,
            "gpuMemUsage": s["gpuMemUsage"], "cpuMemUsage": s["cpuMemUsage"], "pinnedMemUsage": s["pinnedMemUsage"],
            "inflightBatchingStats": {
                "numScheduledRequests": s["numScheduledRequests"], "numContextRequests": s["numContextRequests"],
                "numGenRequests": gen, "numPausedRequests": s["numPausedRequests"], "numCtxTokens": s["numCtxTokens"],
                "avgNumDecodedTokensPerIter": s["numGenTokens"] / gen if gen else 0.0},
            "staticBatchingStats": dict(STATIC_BATCHING_STATS),
            "iterSuspendedRequests": s["iterSuspendedRequests"], "iterResumedRequests": s["iterResumedRequests"],
            "kvCacheLevelTiers": list(tiers),
            "iterCachedTokensByLevel": [s[f"iterCachedTokensLevel{level}"] for level in range(len(tiers))],
            **routing,
        }

    def _supersede(self, lay: RankLayout, iteration: int) -> None:
        """`lay`'s incarnation reports first in `iteration`: the rank's ones registered before it are dead (rare:
        once per rank restart, so the scan of the bounded layouts is fine)."""
        keys = list(self.layouts)
        older = [k for k in keys[:keys.index((lay.rank, lay.incarnation))] if k[0] == lay.rank]
        if older:
            self.superseded.append((iteration, older))

    def forget_layouts(self, oldest_kept: int | None) -> None:
        """Drop the superseded layouts that no kept rank detail can name: those superseded at or before
        `oldest_kept`, the oldest iteration whose deltas are kept (None: none kept). Only once the emission is
        saved: `snapshot` does not cover the layouts."""
        while self.superseded and (oldest_kept is None or self.superseded[0][0] <= oldest_kept):
            for key in self.superseded.popleft()[1]:
                held = self.latest.get(key[0])
                if held is None or held[0].incarnation != key[1]:
                    self.layouts.pop(key, None)

    def snapshot(self) -> dict[str, Any]:
        """What `ingest` changes, to undo an emission whose checkpoint write failed: O(ranks), no records."""
        return {"last_emitted": self.last_emitted, "counts": dict(self.counts), "latest": dict(self.latest),
                "missing": self.missing, "cumulative": self.cumulative.snapshot(),
                "superseded": len(self.superseded)}

    def rollback(self, snap: dict[str, Any]) -> None:
        """Back to `snap`, as if the emissions after it never happened."""
        while len(self.superseded) > snap["superseded"]:
            self.superseded.pop()
        self.last_emitted, self.counts, self.latest = snap["last_emitted"], snap["counts"], snap["latest"]
        self.missing, self.cumulative = snap["missing"], snap["cumulative"]

    def rank_record(self, d: RankDelta, iteration: int) -> dict[str, Any]:
        """A rank's own record (a cluster record's `ranks` entries, /stats/ranks)."""
        lay = self.layouts[(d.rank, d.incarnation)]
        _, _, kv, sched = lay.parts(d.row)
        stats = dict(zip(KV_STATS, kv.tolist(), strict=True))
        stats["cacheHitRate"] = hit_rate(stats["reusedBlocks"], stats["missedBlocks"])
        scheduler = dict(zip(SCHED, sched.tolist(), strict=True))
        return {"iter": iteration, "rank": d.rank, "dpRank": lay.dp_rank, "tpRank": lay.tp_rank,
                "incarnation": d.incarnation, "kvCacheStats": stats, **views_of(lay, d.row),
                "iterLatencyMS": scheduler.pop("stepUs") / 1000, **scheduler}

    def checkpoint(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "last_emitted": self.last_emitted, "counts": dict(self.counts),
                "cumulative": self.cumulative.to_state()}

    def restore(self, state: dict[str, Any], layouts: list[RankLayout]) -> None:
        self.register(layouts)  # first: the restored totals, not the layouts' capacity, are the gauges
        self.last_emitted = state["last_emitted"]
        self.counts.update(state["counts"])
        self.cumulative.restore(state["cumulative"])
