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

from dataclasses import dataclass, field, fields
from operator import add, attrgetter, itemgetter, methodcaller, sub
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
from .layout import (
    GAUGES_AND_PEAKS,
    KIND_VIEWS,
    Layout,
    column_sums,
    from_row,
    key_order,
    layout_for,
    packed,
    report_of,
)


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
        view: dict(sorted(buckets.items(), key=lambda kv: key_order(kv[0])))
        for view, buckets in views.items()
    }


_BLOCK_FIELDS_OF_VIEW = {
    view: tuple(f for f in VIEW_COUNTERS[view] if f not in BYTE_FIELDS)
    + ((GAUGE_FIELDS + PEAK_FIELDS) if VIEW_HAS_GAUGES[view] else ())
    for view in VIEWS
}


_DIV_GETTERS = {view: itemgetter(*fs) for view, fs in _BLOCK_FIELDS_OF_VIEW.items()}


def tp_divergence(reference: dict[str, Any], other: dict[str, Any]) -> list[dict[str, Any]]:
    """Block fields of `other` (a tp rank's report) that differ from its group's `reference` report (a missing
    field counts as 0, as in the sums; a missing bucket as None)."""
    ref_r, oth_r = report_of(reference), report_of(other)
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
                ea = a.get(f, 0) if a is not None else None
                eb = b.get(f, 0) if b is not None else None
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
    try:  # the usual messages, at C speed
        values = set(map(_tokens_per_block, map(_kv_cache_stats, messages)))
    except (KeyError, TypeError):
        values = {(m.get("kv_cache_stats") or _NONE).get("tokensPerBlock") for m in messages}
    values.discard(None)
    if len(values) > 1:
        by_rank = {str(m["rank"]): (m.get("kv_cache_stats") or _NONE).get("tokensPerBlock") for m in messages}
        return {"field": "tokensPerBlock", "error": "ranks disagree on tokensPerBlock", "byRank": by_rank}
    return None


_NONE: dict = {}
_kv_cache_stats, _tokens_per_block = itemgetter("kv_cache_stats"), itemgetter("tokensPerBlock")
_dp_rank, _has_report = itemgetter("dp_rank"), methodcaller("__contains__", "report")
_layout, _counters, _gauges = itemgetter("layout"), itemgetter("counters"), itemgetter("gauges")
_tp_rank = itemgetter("tp_rank")


_TP0_FIELDS = {view: VIEW_COUNTERS[view] for view in VIEWS}
_TPN_FIELDS = {view: tuple(f for f in VIEW_COUNTERS[view] if f in BYTE_FIELDS) for view in VIEWS}
_GETTERS = {fs: itemgetter(*fs) for fs in (*_TP0_FIELDS.values(), *_TPN_FIELDS.values(), GAUGES_AND_PEAKS) if fs}


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
        report, tp0 = report_of(m), m["tp_rank"] == 0
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
            _collect(rows, views, view, report_of(ref), GAUGES_AND_PEAKS)
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


def _add_buckets(views: dict, lay: Layout, kind: str) -> None:
    """Create the buckets a `kind` row of `lay` lands in (static fields from the first layout that has the
    key) and union pool-group `windowSizes`; once per (layout, kind) per merge."""
    for view in KIND_VIEWS[kind]:
        dst_view = views[view]
        for key, static in lay.statics[view].items():
            dst = dst_view.get(key)
            if dst is None:
                dst_view[key] = _new_bucket(view, static)
            elif view == POOL_VIEW:
                ws = static.get("windowSizes")
                if ws and ws != dst["windowSizes"]:
                    dst["windowSizes"] = sorted(set(dst["windowSizes"]) | set(ws))


def _same_blocks(ref: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether tp rank message `other` has its reference's block counters and gauges (the healthy case,
    decided on the rows; only a difference is worth the per-field comparison)."""
    if other["layout"] != ref["layout"] or other["gauges"] != ref["gauges"]:
        return False
    blocks = layout_for(ref["layout"]).blocks
    return blocks(from_row(other["counters"])) == blocks(from_row(ref["counters"]))


def _group(sums: dict[tuple[str, str], list[bytes]], messages: list[dict[str, Any]], kinds: list[str],
           row_of) -> None:
    """Append each message's row under (its layout, its kind); one C-speed pass when all share both."""
    keys = list(zip(map(_layout, messages), kinds, strict=True))
    if len(set(keys)) == 1:
        sums.setdefault(keys[0], []).extend(map(row_of, messages))
        return
    for key, m in zip(keys, messages, strict=True):
        sums.setdefault(key, []).append(row_of(m))


def _counter_kinds(messages: list[dict[str, Any]]) -> list[str]:
    """'tp0' (all counters count) or 'tpn' (bytes only) per message."""
    return list(map(("tp0", "tpn").__getitem__, map(bool, map(_tp_rank, messages))))


def merge_iteration(messages: list[dict[str, Any]], late: list[dict[str, Any]] = ()) -> MergedIteration:
    """Merge the rank messages of one iteration (any subset of ranks; any rank may appear more than once
    when an outbox folded several messages) into the cluster statistics of that iteration.

    Messages may come in either form (layout.py; packed ones already checked by `check_rows`). The rows of
    one layout are summed column-wise at C speed, then added into the record's buckets. `late` are late
    deltas: their counters are added, their gauges are not.
    """
    if any(map(_has_report, messages)) or any(map(_has_report, late)):
        messages, late = [packed(m) for m in messages], [packed(m) for m in late]
    # (layout string, kind) -> rows to add, in order of first sight (bucket statics: first layout wins)
    sums: dict[tuple[str, str], list[bytes]] = {}
    every = [*messages, *late]
    _group(sums, every, _counter_kinds(every), _counters)
    divergence: list[dict[str, Any]] = []
    dps = list(map(_dp_rank, messages))
    if len(set(dps)) == len(dps):  # one message per dp group (tp = 1, no fold): each is its group's reference
        refs = messages
    else:
        refs = []
        by_group: dict[int, list[dict[str, Any]]] = {}
        for m in messages:
            by_group.setdefault(m["dp_rank"], []).append(m)
        for dp in sorted(by_group):
            group = sorted(by_group[dp], key=lambda m: (m["tp_rank"], m.get("seq", 0)))
            # the newest message of the lowest tp rank present gives the group's gauges
            ref = [m for m in group if m["tp_rank"] == group[0]["tp_rank"]][-1]
            refs.append(ref)
            seen_tp = {ref["tp_rank"]}
            for m in reversed(group):
                if m["tp_rank"] not in seen_tp:
                    seen_tp.add(m["tp_rank"])
                    if not _same_blocks(ref, m):
                        divergence.extend(tp_divergence(ref, m))
    _group(sums, refs, ["gauges"] * len(refs), _gauges)
    keys = {key for key, _ in sums}
    key = next(iter(keys)) if len(keys) == 1 else None
    if key is not None and (key, "tp0") in sums and (key, "gauges") in sums:
        views = _one_layout(sums, key)  # the usual iteration: one layout, a tp rank 0 present
    else:
        views = _any_layouts(sums)
    errors = []
    err = tokens_per_block_error(messages)
    if err:
        errors.append(err)
    return MergedIteration(views, divergence, errors)


def _one_layout(sums: dict[tuple[str, str], list[bytes]], key: str) -> dict[str, dict[str, dict]]:
    """The record's views when all rows share one layout: column sums straight into finished buckets."""
    lay = layout_for(key)
    counters = column_sums(sums[(key, "tp0")], lay.n_counters)
    tpn = sums.get((key, "tpn"))
    if tpn:  # other tp ranks' bytes
        extra = column_sums(tpn, lay.n_counters)
        for i, _ in lay.targets["tpn"]:
            counters[i] += extra[i]
    return lay.views(counters, column_sums(sums[(key, "gauges")], lay.n_gauges))


def _any_layouts(sums: dict[tuple[str, str], list[bytes]]) -> dict[str, dict[str, dict]]:
    """The record's views from rows of any layouts: buckets unioned, then each kind's column sums added."""
    views = new_views()
    for key, kind in sums:  # buckets in order of first sight, as the reference merge creates them
        _add_buckets(views, layout_for(key), kind)
    for (key, kind), rows in sums.items():
        lay = layout_for(key)
        totals = column_sums(rows, lay.n_gauges if kind == "gauges" else lay.n_counters)
        for i, (view, key, f) in lay.targets[kind]:
            views[view][key][f] += totals[i]
    finish_hit_rates(views)
    return sort_views(views)


def fold_rank_messages(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """Fold two messages of the same rank incarnation into one (RankOutbox over its bound).

    Counters are summed, gauges come from the newer, peaks are the max of both, the cumulative snapshot is
    the newer's; `iterations` spans both and `merged_seqs` lists every seq folded in (the result keeps the
    newer `seq`), so the aggregator can attribute the counters to the last iteration exactly once.
    """
    if older["incarnation"] != newer["incarnation"] or older["rank"] != newer["rank"]:
        raise ValueError("only messages of one rank incarnation can be folded")
    out = {k: v for k, v in newer.items() if k not in ("report", "layout", "counters", "gauges")}
    old_r, new_r = report_of(older), report_of(newer)
    views = {view: {} for view in VIEWS}
    for view in VIEWS:
        for src in (old_r.get(view) or {}, new_r.get(view) or {}):
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
    # incarnation -> (seq, kv_cache_stats, its KV_STATS_COUNTERS) of its newest snapshot; at most
    # `max_incarnations`, older ones banked
    snapshots: dict[str, tuple[int, dict[str, Any], tuple[int, ...]]] = field(default_factory=dict)
    banked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KV_STATS_COUNTERS, 0))
    banked_incarnations: set[str] = field(default_factory=set)
    gauges: dict[str, Any] = field(default_factory=dict)  # the newest kv_cache_stats (its KV_STATS_GAUGES)
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
        self._sum: list[int] = [0] * len(KV_STATS_COUNTERS)
        self._refs: dict[int, _RankCumulative] = {}  # dp rank -> the rank whose gauges count (see _set_gauges)
        self._ref_rows: dict[int, tuple[int, ...]] = {}  # dp rank -> the gauges it counts
        self._gauge_sum: list[int] = [0] * len(KV_STATS_GAUGES)
        self._tpb: dict[tuple[int, int], int] = {}  # (dp rank, tp rank) -> its tokensPerBlock

    def update(self, message: dict[str, Any]) -> None:
        """Take a message's cumulative snapshot (its kv_cache_stats dict is kept by reference)."""
        stats = message.get("kv_cache_stats")
        if not stats:
            return
        r = self.ranks.get(message["rank"])
        if r is None:
            r = self.ranks[message["rank"]] = _RankCumulative(message["dp_rank"], message["tp_rank"])
        inc, seq = message["incarnation"], message["seq"]
        old = r.snapshots.get(inc)
        if inc == r.current and old is not None and seq > old[0]:  # the usual case: this rank's next snapshot
            new = _kv_counters(stats)
            r.snapshots[inc] = (seq, stats, new)
            if r.tp_rank == 0:
                self._sum = list(map(add, self._sum, map(sub, new, old[2])))
            ts = message.get("timestamp", 0.0)
            if ts > r.current_ts:
                r.current_ts = ts
            r.gauges = stats  # the group's reference rank cannot change: this rank was already a candidate
            if self._refs.get(r.dp_rank) is r:
                self._set_ref_row(r.dp_rank, stats)
            if stats.get("tokensPerBlock") != r.tokens_per_block:
                self._set_gauges(r, stats)
            return
        if old is None or seq > old[0]:
            if old is None and inc in r.banked_incarnations:
                return
            new = _kv_counters(stats)
            r.snapshots[inc] = (seq, stats, new)
            if r.tp_rank == 0:
                self._sum = list(map(add, self._sum, new if old is None else map(sub, new, old[2])))
            if old is None and len(r.snapshots) > self.max_incarnations:
                oldest = next(i for i in r.snapshots if i != inc)  # dict order = first seen
                for k, v in zip(KV_STATS_COUNTERS, r.snapshots.pop(oldest)[2], strict=True):
                    r.banked[k] += v
                r.banked_incarnations.add(oldest)
        elif inc == r.current and seq < old[0]:
            return  # an older snapshot of the current incarnation: gauges stay
        ts = message.get("timestamp", 0.0)
        if inc == r.current or ts >= r.current_ts:
            r.current, r.current_ts = inc, max(ts, r.current_ts)
            self._set_gauges(r, stats)

    def _set_gauges(self, r: _RankCumulative, stats: dict[str, Any]) -> None:
        r.gauges = stats
        ref = self._refs.get(r.dp_rank)
        if ref is None or r.tp_rank <= ref.tp_rank:  # a dp group's gauges: its lowest tp rank that has some
            self._refs[r.dp_rank] = r
            self._set_ref_row(r.dp_rank, stats)
        tpb = r.tokens_per_block = stats.get("tokensPerBlock")
        if tpb is not None:
            self._tpb[(r.dp_rank, r.tp_rank)] = tpb
        else:
            self._tpb.pop((r.dp_rank, r.tp_rank), None)

    def _set_ref_row(self, dp_rank: int, stats: dict[str, Any]) -> None:
        """dp group `dp_rank` now counts these gauges: keep the cluster's gauge sum current (O(1))."""
        new = _kv_gauges(stats)
        old = self._ref_rows.get(dp_rank)
        self._ref_rows[dp_rank] = new
        self._gauge_sum = list(map(add, self._gauge_sum, new if old is None else map(sub, new, old)))

    def computed(self) -> dict[str, int]:
        """Sum over tp-rank-0 ranks of banked + every incarnation's latest snapshot (no floor)."""
        return dict(zip(KV_STATS_COUNTERS, self._sum, strict=True))

    def _resum(self) -> list[int]:
        out = [0] * len(KV_STATS_COUNTERS)
        for r in self.ranks.values():
            if r.tp_rank == 0:
                for row in (_kv_counters(r.banked), *(c for _, _, c in r.snapshots.values())):
                    out = list(map(add, out, row))
        return out

    def stats(self) -> dict[str, Any]:
        """The 9-key cluster kvCacheStats; counters never below the floor, which then rises to them."""
        floor = self.floor
        for k, v in zip(KV_STATS_COUNTERS, self._sum, strict=True):
            if v > floor[k]:
                floor[k] = v
        tpbs = self.tokens_per_block_values()
        return {
            **dict(zip(KV_STATS_GAUGES, self._gauge_sum, strict=True)),
            "tokensPerBlock": min(tpbs) if tpbs else 0,
            **floor,
            "cacheHitRate": hit_rate(floor["reusedBlocks"], floor["missedBlocks"]),
        }

    def tokens_per_block_values(self) -> set[int]:
        return set(self._tpb.values())

    def to_state(self) -> dict[str, Any]:
        """A picklable checkpoint (restored after an aggregator restart); it shares this object's snapshots, so
        serialise it before the next `update`."""
        return {"floor": dict(self.floor),
                "ranks": {rank: _rank_fields(r) for rank, r in self.ranks.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ClusterCumulative:
        c = cls()
        c.floor.update({k: v for k, v in state.get("floor", {}).items() if k in c.floor})
        for rank, fields_ in state.get("ranks", {}).items():
            r = c.ranks[int(rank)] = _RankCumulative(*fields_)
            r.snapshots, r.banked = dict(r.snapshots), dict(r.banked)
            r.banked_incarnations = set(r.banked_incarnations)
            if r.gauges:
                c._set_gauges(r, r.gauges)
        c._sum = c._resum()
        return c


_KV_COUNTERS_GET = itemgetter(*KV_STATS_COUNTERS)
_KV_GAUGES_GET = itemgetter(*KV_STATS_GAUGES)


def _kv_gauges(stats: dict[str, Any]) -> tuple[int, ...]:
    try:
        return _KV_GAUGES_GET(stats)
    except KeyError:
        return tuple(stats.get(k, 0) for k in KV_STATS_GAUGES)


def _kv_counters(stats: dict[str, Any]) -> tuple[int, ...]:
    """The KV_STATS_COUNTERS of a kv_cache_stats dict (a missing one counts as 0)."""
    try:
        return _KV_COUNTERS_GET(stats)
    except KeyError:
        return tuple(stats.get(k, 0) for k in KV_STATS_COUNTERS)


_rank_fields = attrgetter(*(f.name for f in fields(_RankCumulative)))  # a shallow astuple, at C speed
