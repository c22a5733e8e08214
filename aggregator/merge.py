"""Pure merge rules (no Ray): rank reports of one iteration -> one cluster record's statistics.

DESIGN.md 'Merging into a cluster record', made concrete:
- Block counters (every non-byte `iter*` field) come from tp rank 0 of each dp group only; the tp ranks of
  a group make identical block decisions, so counting them all would multiply by tp. Byte counters
  (`iter*Bytes`) are summed over every rank: each tp rank moves its own shard of the KV heads.
- Block gauges (max/free/used/evictable) come from tp rank 0 of each dp group (or, when tp rank 0 is missing
  from an incomplete iteration, the lowest tp rank present: gauges are states, not counts, so this neither
  loses nor doubles anything) and are summed over dp groups.
- Peaks are summed over dp groups: an upper bound, since the peak of a sum is at most the sum of peaks.
- Every other tp rank's block fields are compared with its group's reference rank; differences are listed
  in `tpDivergence` (empty on a healthy cluster).
- Hit rates are recomputed from merged reused/missed counts (0.0 when either is 0), never averaged.
- Window, pool-group and life-cycle keys are unioned; `tokensPerBlock` must agree across ranks, and a
  mismatch is reported in the record's `errors`, never raised.
- Cluster cumulative `kvCacheStats` = sum over tp-rank-0 ranks of the latest snapshot of every incarnation
  each rank ever had (a restarted rank starts again at zero; its dead incarnations stay banked), floored so
  that the reported counters never go backwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from .fields import (  # noqa: F401  (re-exported: the merge rules' vocabulary)
    BLOCK_COUNTER_FIELDS,
    BYTE_FIELDS,
    COUNTER_FIELDS,
    GAUGE_FIELDS,
    HIT_RATE_FIELD,
    KV_STATS_COUNTERS,
    KV_STATS_GAUGES,
    KV_STATS_KEYS,
    LIFECYCLE_VIEW,
    PEAK_FIELDS,
    POOL_VIEW,
    STATIC_FIELDS,
    TIERS,
    VIEW_COUNTERS,
    VIEW_HAS_GAUGES,
    VIEW_HAS_HIT_RATE,
    VIEW_KEY_NAME,
    VIEWS,
    WINDOW_VIEW,
    hit_rate,
)
from .layout import KIND_VIEWS, Flat, Layout, flatten


def empty_bucket(view: str) -> dict[str, Any]:
    """A bucket of `view` with every counter (and gauge) at zero."""
    b: dict[str, Any] = dict.fromkeys(VIEW_COUNTERS[view], 0)
    if VIEW_HAS_GAUGES[view]:
        b.update(dict.fromkeys(GAUGE_FIELDS + PEAK_FIELDS, 0))
    if VIEW_HAS_HIT_RATE[view]:
        b[HIT_RATE_FIELD] = 0.0
    return b


def _new_bucket(view: str, src: dict[str, Any]) -> dict[str, Any]:
    b = empty_bucket(view)
    for f in STATIC_FIELDS[view]:
        if f in src:
            b[f] = src[f]
    if view == POOL_VIEW:
        b["windowSizes"] = sorted(src.get("windowSizes", ()))
    return b


def add_counters(views: dict[str, dict[str, dict]], report: dict[str, Any], tp_rank: int) -> None:
    """Add one rank's counters into `views` in place: block counters only when `tp_rank == 0`, bytes always.

    This is the whole 'counted once' rule, shared by the on-time merge and the folding of late deltas.
    """
    fields_for = COUNTER_FIELDS if tp_rank == 0 else BYTE_FIELDS
    for view in VIEWS:
        src_view = report.get(view)
        if not src_view:
            continue
        dst_view = views[view]
        allowed = VIEW_COUNTERS[view]
        for key, src in src_view.items():
            dst = dst_view.get(key)
            if dst is None:
                dst = dst_view[key] = _new_bucket(view, src)
            elif view == POOL_VIEW and src.get("windowSizes"):
                ws = dst["windowSizes"]
                for w in src["windowSizes"]:
                    if w not in ws:
                        ws.append(w)
                        ws.sort()
            for f in fields_for:
                v = src.get(f)
                if v and f in allowed:
                    dst[f] += v


def _add_gauges(views: dict[str, dict[str, dict]], report: dict[str, Any]) -> None:
    for view in (WINDOW_VIEW, POOL_VIEW):
        dst_view = views[view]
        for key, src in (report.get(view) or {}).items():
            dst = dst_view.get(key)
            if dst is None:
                dst = dst_view[key] = _new_bucket(view, src)
            for f in GAUGE_FIELDS:
                v = src.get(f)
                if v:
                    dst[f] += v
            for f in PEAK_FIELDS:
                v = src.get(f)
                if v:
                    dst[f] += v


def finish_hit_rates(views: dict[str, dict[str, dict]]) -> None:
    """Recompute every bucket's `iterCacheHitRate` from its merged reused/missed counts."""
    for view in (WINDOW_VIEW, LIFECYCLE_VIEW):
        for b in views[view].values():
            b[HIT_RATE_FIELD] = hit_rate(b["iterReusedBlocks"], b["iterMissedBlocks"])


def new_views() -> dict[str, dict[str, dict]]:
    return {view: {} for view in VIEWS}


def sort_views(views: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """Keys in numeric order (window sizes, pool group and life-cycle ids are decimal strings)."""
    return {
        view: dict(sorted(buckets.items(), key=lambda kv: (not kv[0].isdigit(), len(kv[0]), kv[0])))
        for view, buckets in views.items()
    }


_BLOCK_FIELDS_OF_VIEW = {
    view: tuple(f for f in VIEW_COUNTERS[view] if f not in BYTE_FIELDS)
    + ((GAUGE_FIELDS + PEAK_FIELDS) if VIEW_HAS_GAUGES[view] else ())
    for view in VIEWS
}


_DIV_GETTERS = {view: itemgetter(*fs) for view, fs in _BLOCK_FIELDS_OF_VIEW.items()}


def tp_divergence(reference: dict[str, Any], other: dict[str, Any]) -> list[dict[str, Any]]:
    """Block fields of `other` (a tp rank's report) that differ from its group's `reference` report."""
    ref_r, oth_r = reference["report"], other["report"]
    out: list[dict[str, Any]] = []
    for view in VIEWS:
        fields_ = _BLOCK_FIELDS_OF_VIEW[view]
        ref_v, oth_v = ref_r.get(view) or {}, oth_r.get(view) or {}
        get = _DIV_GETTERS[view]
        for key in sorted(set(ref_v) | set(oth_v)):
            a, b = ref_v.get(key), oth_v.get(key)
            if a is not None and b is not None:
                try:
                    if get(a) == get(b):
                        continue
                except KeyError:
                    pass
            for f in fields_:
                ea = a.get(f) if a is not None else None
                eb = b.get(f) if b is not None else None
                if ea != eb:
                    out.append({"dpRank": other["dp_rank"], "tpRank": other["tp_rank"],
                                "referenceTpRank": reference["tp_rank"], "view": view,
                                VIEW_KEY_NAME[view]: key, "field": f, "expected": ea, "got": eb})
    return out


@dataclass
class MergedIteration:
    """The statistics part of one cluster record."""

    views: dict[str, dict[str, dict]]
    tp_divergence: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)


def tokens_per_block_error(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """An error entry when the ranks disagree on `tokensPerBlock`, else None."""
    by_rank = {str(m["rank"]): (m.get("kv_cache_stats") or {}).get("tokensPerBlock") for m in messages}
    values = {v for v in by_rank.values() if v is not None}
    if len(values) > 1:
        return {"field": "tokensPerBlock", "error": "ranks disagree on tokensPerBlock", "byRank": by_rank}
    return None


_GAUGES_AND_PEAKS = GAUGE_FIELDS + PEAK_FIELDS
_TP0_FIELDS = {view: VIEW_COUNTERS[view] for view in VIEWS}
_TPN_FIELDS = {view: tuple(f for f in VIEW_COUNTERS[view] if f in BYTE_FIELDS) for view in VIEWS}
_GETTERS = {fs: itemgetter(*fs) for fs in (*_TP0_FIELDS.values(), *_TPN_FIELDS.values(), _GAUGES_AND_PEAKS) if fs}


def _collect(rows: dict, views: dict, view: str, report: dict, fields_: tuple[str, ...]) -> None:
    """Queue one report's `fields_` of every bucket of `view` for a C-speed column sum (see _sum_rows)."""
    if not fields_:
        return
    get = _GETTERS[fields_]
    dst_view = views[view]
    for key, src in (report.get(view) or {}).items():
        if key not in dst_view:
            dst_view[key] = _new_bucket(view, src)
        elif view == POOL_VIEW:
            ws, dst_ws = src.get("windowSizes"), dst_view[key]["windowSizes"]
            if ws and ws != dst_ws:
                dst_view[key]["windowSizes"] = sorted(set(dst_ws) | set(ws))
        try:
            row = get(src)
        except KeyError:  # a bucket without some field: counts as 0
            row = tuple(src.get(f, 0) for f in fields_)
        rows.setdefault((view, key, fields_), []).append(row if len(fields_) > 1 else (row,))


def _sum_rows(rows: dict, views: dict) -> None:
    for (view, key, fields_), rs in rows.items():
        b = views[view][key]
        for f, total in zip(fields_, map(sum, zip(*rs, strict=True)), strict=True):
            b[f] += total


def merge_iteration_reference(messages: list[dict[str, Any]]) -> MergedIteration:
    """`merge_iteration` bucket by bucket on the dicts: the plain statement of the rules, kept as the oracle
    the fast path is tested against (and the bench's baseline)."""
    views = new_views()
    rows: dict = {}
    by_group: dict[int, list[dict[str, Any]]] = {}
    for m in messages:
        report, tp0 = m["report"], m["tp_rank"] == 0
        for view in VIEWS:
            _collect(rows, views, view, report, _TP0_FIELDS[view] if tp0 else _TPN_FIELDS[view])
        by_group.setdefault(m["dp_rank"], []).append(m)
    divergence: list[dict[str, Any]] = []
    for dp in sorted(by_group):
        group = by_group[dp]
        if len(group) > 1:
            group = sorted(group, key=lambda m: (m["tp_rank"], m.get("seq", 0)))
        # the newest message of the lowest tp rank present gives the group's gauges
        ref_tp = group[0]["tp_rank"]
        ref = [m for m in group if m["tp_rank"] == ref_tp][-1]
        for view in (WINDOW_VIEW, POOL_VIEW):
            _collect(rows, views, view, ref["report"], _GAUGES_AND_PEAKS)
        seen_tp = {ref_tp}
        for m in reversed(group):
            if m["tp_rank"] not in seen_tp:
                seen_tp.add(m["tp_rank"])
                divergence.extend(tp_divergence(ref, m))
    _sum_rows(rows, views)
    finish_hit_rates(views)
    errors = []
    err = tokens_per_block_error(messages)
    if err:
        errors.append(err)
    return MergedIteration(sort_views(views), divergence, errors)


def _add_buckets(views: dict, lay: Layout, report: dict[str, Any], kind: str, done: set) -> None:
    """Create the buckets a `kind` row of `report` lands in (static fields from the first report that has
    the key) and union pool-group `windowSizes`; once per (layout, kind) per merge, the union every time."""
    first = (lay, kind) not in done
    for view in KIND_VIEWS[kind]:
        dst_view = views[view]
        if first:
            src_view = report.get(view) or {}
            for key in lay.keys[view]:
                if key not in dst_view:
                    dst_view[key] = _new_bucket(view, src_view[key])
                elif view == POOL_VIEW:
                    _union_window_sizes(dst_view[key], src_view[key])
        elif view == POOL_VIEW:
            src_view = report.get(view) or {}
            for key in lay.keys[view]:
                _union_window_sizes(dst_view[key], src_view[key])
    done.add((lay, kind))


def _union_window_sizes(dst: dict[str, Any], src: dict[str, Any]) -> None:
    ws, dst_ws = src.get("windowSizes"), dst["windowSizes"]
    if ws and ws != dst_ws:
        dst["windowSizes"] = sorted(set(dst_ws) | set(ws))


def merge_iteration(messages: list[dict[str, Any]], flats: list[Flat] | None = None) -> MergedIteration:
    """Merge the rank messages of one iteration (any subset of ranks; any rank may appear more than once
    when an outbox folded several messages) into the cluster statistics of that iteration.

    Each report is read as rows of numbers (layout.py; `flats` when the caller flattened them at ingest)
    and the rows of one layout are summed column-wise at C speed, then added into the record's buckets.
    """
    if flats is None:
        flats = [flatten(m["report"], m["tp_rank"], check=False) for m in messages]
    views = new_views()
    done: set = set()
    sums: dict[tuple[Layout, str], list[list]] = {}
    by_group: dict[int, list[int]] = {}
    for i, m in enumerate(messages):
        fl = flats[i]
        _add_buckets(views, fl.layout, m["report"], fl.kind, done)
        rows = sums.get((fl.layout, fl.kind))
        if rows is None:
            sums[(fl.layout, fl.kind)] = [fl.counters]
        else:
            rows.append(fl.counters)
        g = by_group.get(m["dp_rank"])
        if g is None:
            by_group[m["dp_rank"]] = [i]
        else:
            g.append(i)
    divergence: list[dict[str, Any]] = []
    for dp in sorted(by_group):
        group = by_group[dp]
        if len(group) > 1:
            group = sorted(group, key=lambda i: (messages[i]["tp_rank"], messages[i].get("seq", 0)))
            # the newest message of the lowest tp rank present gives the group's gauges
            ref_tp = messages[group[0]]["tp_rank"]
            ref_i = [i for i in group if messages[i]["tp_rank"] == ref_tp][-1]
        else:
            ref_i = group[0]
        ref, fl = messages[ref_i], flats[ref_i]
        _add_buckets(views, fl.layout, ref["report"], "gauges", done)
        sums.setdefault((fl.layout, "gauges"), []).append(fl.gauges)
        if len(group) > 1:
            seen_tp = {ref["tp_rank"]}
            for i in reversed(group):
                m = messages[i]
                if m["tp_rank"] not in seen_tp:
                    seen_tp.add(m["tp_rank"])
                    divergence.extend(tp_divergence(ref, m))
    for (lay, kind), rows in sums.items():
        totals = rows[0] if len(rows) == 1 else map(sum, zip(*rows, strict=True))
        for (view, key, f), total in zip(lay.slots[kind], totals, strict=True):
            views[view][key][f] += total
    finish_hit_rates(views)
    errors = []
    err = tokens_per_block_error(messages)
    if err:
        errors.append(err)
    return MergedIteration(sort_views(views), divergence, errors)


def fold_rank_messages(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """Fold two messages of the same rank incarnation into one (RankOutbox over its bound).

    Counters are summed, gauges come from the newer, peaks are the max of both, the cumulative snapshot is
    the newer's; `iterations` spans both and `merged_seqs` lists every seq folded in (the result keeps the
    newer `seq`), so the aggregator can attribute the counters to the last iteration exactly once.
    """
    if older["incarnation"] != newer["incarnation"] or older["rank"] != newer["rank"]:
        raise ValueError("only messages of one rank incarnation can be folded")
    out = {k: v for k, v in newer.items() if k != "report"}
    views = {view: {} for view in VIEWS}
    for view in VIEWS:
        for src in (older["report"].get(view) or {}, newer["report"].get(view) or {}):
            for key, b in src.items():
                dst = views[view].get(key)
                if dst is None:
                    views[view][key] = dict(b)
                    continue
                for f, v in b.items():
                    if f in COUNTER_FIELDS:
                        dst[f] = dst.get(f, 0) + v
                    elif f in PEAK_FIELDS:
                        dst[f] = max(dst.get(f, 0), v)
                    elif f == "windowSizes":
                        dst[f] = sorted(set(dst.get(f, ())) | set(v))
                    elif f != HIT_RATE_FIELD:
                        dst[f] = v
    for view in (WINDOW_VIEW, LIFECYCLE_VIEW):
        for b in views[view].values():
            b[HIT_RATE_FIELD] = hit_rate(b.get("iterReusedBlocks", 0), b.get("iterMissedBlocks", 0))
    out["report"] = views
    first = older.get("iterations", [older["iteration"]])[0]
    out["iterations"] = [first, newer["iteration"]]
    out["merged_seqs"] = (
        list(older.get("merged_seqs", ())) + [older["seq"]] + list(newer.get("merged_seqs", ()))
    )
    return out


# ---------------------------------------------------------------- cluster cumulative kvCacheStats


@dataclass
class _RankCumulative:
    dp_rank: int
    tp_rank: int
    current: str | None = None  # incarnation whose message is the newest
    current_ts: float = float("-inf")
    # incarnation -> (seq, counters) of its newest snapshot; at most `max_incarnations`, older ones banked
    snapshots: dict[str, tuple[int, dict[str, int]]] = field(default_factory=dict)
    banked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_STATS_COUNTERS, 0))
    banked_incarnations: set[str] = field(default_factory=set)
    gauges: dict[str, int] = field(default_factory=dict)
    tokens_per_block: int | None = None


class ClusterCumulative:
    """The cluster's cumulative kvCacheStats, rebuilt from the ranks' own cumulative snapshots.

    Idempotent (re-sent or reordered snapshots change nothing unless newer), survives rank restarts (each
    incarnation's last snapshot stays counted), and never goes backwards (`floor`, restored from a checkpoint
    after an aggregator restart, covers ranks that have not re-sent yet).
    """

    max_incarnations = 4

    def __init__(self) -> None:
        self.ranks: dict[int, _RankCumulative] = {}
        self.floor: dict[str, int] = dict.fromkeys(KV_STATS_COUNTERS, 0)
        # `computed()` kept up to date by `update` (a snapshot replaced: its difference; banking moves counts
        # between two places that are both summed): O(1) per message instead of O(ranks) per record
        self._sum: dict[str, int] = dict.fromkeys(KV_STATS_COUNTERS, 0)

    def update(self, message: dict[str, Any]) -> None:
        stats = message.get("kv_cache_stats")
        if not stats:
            return
        r = self.ranks.get(message["rank"])
        if r is None:
            r = self.ranks[message["rank"]] = _RankCumulative(message["dp_rank"], message["tp_rank"])
        inc, seq = message["incarnation"], message["seq"]
        if inc in r.banked_incarnations:
            return
        counters = {k: int(stats.get(k, 0)) for k in KV_STATS_COUNTERS}
        old = r.snapshots.get(inc)
        if old is None or seq > old[0]:
            r.snapshots[inc] = (seq, counters)
            if r.tp_rank == 0:
                total = self._sum
                for k, v in counters.items():
                    total[k] += v
                if old is not None:
                    for k, v in old[1].items():
                        total[k] -= v
        if len(r.snapshots) > self.max_incarnations:
            oldest = next(i for i in r.snapshots if i != inc)  # dict order = first seen
            for k, v in r.snapshots.pop(oldest)[1].items():
                r.banked[k] += v
            r.banked_incarnations.add(oldest)
        ts = float(message.get("timestamp", 0.0))
        if inc == r.current or ts >= r.current_ts:
            if inc == r.current and old is not None and seq < old[0]:
                return  # an older snapshot of the current incarnation: gauges stay
            r.current, r.current_ts = inc, max(ts, r.current_ts)
            r.gauges = {k: int(stats.get(k, 0)) for k in KV_STATS_GAUGES}
            r.tokens_per_block = stats.get("tokensPerBlock")

    def computed(self) -> dict[str, int]:
        """Sum over tp-rank-0 ranks of banked + every incarnation's latest snapshot (no floor)."""
        return dict(self._sum)

    def _resum(self) -> dict[str, int]:
        out = dict.fromkeys(KV_STATS_COUNTERS, 0)
        for r in self.ranks.values():
            if r.tp_rank != 0:
                continue
            for k, v in r.banked.items():
                out[k] += v
            for _, c in r.snapshots.values():
                for k, v in c.items():
                    out[k] += v
        return out

    def stats(self) -> dict[str, Any]:
        """The 9-key cluster kvCacheStats; counters never below the floor, which then rises to them."""
        counters = self.computed()
        for k in KV_STATS_COUNTERS:
            if counters[k] < self.floor[k]:
                counters[k] = self.floor[k]
            self.floor[k] = counters[k]
        gauges = dict.fromkeys(KV_STATS_GAUGES, 0)
        groups: dict[int, _RankCumulative] = {}
        for r in self.ranks.values():
            ref = groups.get(r.dp_rank)
            if r.gauges and (ref is None or r.tp_rank < ref.tp_rank):
                groups[r.dp_rank] = r
        for r in groups.values():
            for k, v in r.gauges.items():
                gauges[k] += v
        tpbs = {r.tokens_per_block for r in self.ranks.values() if r.tokens_per_block is not None}
        return {
            **gauges,
            "tokensPerBlock": min(tpbs) if tpbs else 0,
            **counters,
            "cacheHitRate": hit_rate(counters["reusedBlocks"], counters["missedBlocks"]),
        }

    def tokens_per_block_values(self) -> set[int]:
        return {r.tokens_per_block for r in self.ranks.values() if r.tokens_per_block is not None}

    def to_state(self) -> dict[str, Any]:
        """A JSON-able checkpoint (restored after an aggregator restart)."""
        return {
            "floor": dict(self.floor),
            "ranks": {
                str(rank): {
                    "dp_rank": r.dp_rank, "tp_rank": r.tp_rank, "current": r.current, "current_ts": r.current_ts,
                    "snapshots": {i: [s, c] for i, (s, c) in r.snapshots.items()},
                    "banked": r.banked, "banked_incarnations": sorted(r.banked_incarnations),
                    "gauges": r.gauges, "tokens_per_block": r.tokens_per_block,
                }
                for rank, r in self.ranks.items()
            },
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ClusterCumulative:
        c = cls()
        c.floor.update({k: int(v) for k, v in state.get("floor", {}).items() if k in c.floor})
        for rank, s in state.get("ranks", {}).items():
            c.ranks[int(rank)] = _RankCumulative(
                dp_rank=s["dp_rank"], tp_rank=s["tp_rank"], current=s["current"],
                current_ts=float(s["current_ts"]),
                snapshots={i: (int(v[0]), dict(v[1])) for i, v in s["snapshots"].items()},
                banked=dict(s["banked"]), banked_incarnations=set(s["banked_incarnations"]),
                gauges=dict(s["gauges"]), tokens_per_block=s["tokens_per_block"],
            )
        c._sum = c._resum()
        return c
