"""Rank reports as number rows: the wire form of a rank message, and the rows the merge sums.

A report's *layout* is everything in it that is not a number: its three views' keys and each bucket's
static fields (pool group id, slot size, window sizes; life-cycle id, pool group, window size, kind). It is
the same on every message of a rank, so a rank sends it as one short JSON string next to two number rows:
- `counters`: every counter of every bucket (window buckets 15, pool-group buckets 11, life-cycle buckets 4),
- `gauges`: the gauges and peaks of the window and pool-group buckets (14 each),
in the layout's slot order, each as little-endian int64 bytes. This *packed* message holds exactly the
report's information (`unpack` gives the views back, hit rates recomputed). Nested report dicts cost the
aggregator ~22 us per message just to unpickle and keep (one object per bucket and per number, and the
garbage collector walking them); a packed one ~6 us, because bytes are one untracked object
(bench/aggregator_bench.py compares both through the actor).

The aggregator parses each distinct layout string once (cached), checks a message's rows against it at
ingest and merges an iteration as a C-speed column sum of the rows of each layout; `Layout.views` turns sums
into finished buckets. Each layout says which slots a row adds to, by kind: `tp0` (every counter: a tp rank
0 message), `tpn` (byte counters of the window and pool-group views: other tp ranks move only their own
shards) and `gauges`. A message in the dict form (`report`, as DESIGN.md names it) is packed on arrival; a
bucket that is not a dict or a value that is not an integer raises `LayoutError`, so the message is
rejected at ingest with the reason.
"""

from __future__ import annotations

import json
import sys
from array import array
from functools import partial
from operator import itemgetter
from typing import Any

from .fields import (
    BYTE_FIELDS,
    GAUGE_FIELDS,
    HIT_RATE_FIELD,
    PEAK_FIELDS,
    POOL_VIEW,
    STATIC_FIELDS,
    VIEW_COUNTERS,
    VIEW_HAS_GAUGES,
    VIEW_HAS_HIT_RATE,
    VIEWS,
    WINDOW_VIEW,
    hit_rate,
)

GAUGES_AND_PEAKS = GAUGE_FIELDS + PEAK_FIELDS
GAUGE_VIEWS = (WINDOW_VIEW, POOL_VIEW)
# the views whose buckets a row of each kind lands in (life-cycle buckets carry no bytes, so a tp rank > 0
# alone never creates one)
KIND_VIEWS = {"tp0": VIEWS, "tpn": GAUGE_VIEWS, "gauges": GAUGE_VIEWS}
# static fields a layout keeps per bucket (the pool-group view also lists its window sizes)
LAYOUT_FIELDS = {**STATIC_FIELDS, POOL_VIEW: STATIC_FIELDS[POOL_VIEW] + ("windowSizes",)}
MAX_CACHED = 256
_GETTERS = {fs: itemgetter(*fs) for fs in (*VIEW_COUNTERS.values(), GAUGES_AND_PEAKS)}


class LayoutError(ValueError):
    """A report or packed message whose buckets cannot be read as numbers."""


def _picker(idx: list[int]):
    """itemgetter that always returns a tuple (also for zero or one index)."""
    if len(idx) > 1:
        return itemgetter(*idx)
    return (lambda row, i=idx[0]: (row[i],)) if idx else (lambda row: ())


class Layout:
    """One report layout: its keys and static fields per view, and the (view, key, field) of every row slot."""

    __slots__ = ("key", "statics", "targets", "n_counters", "n_gauges", "row_bytes", "blocks", "_specs")

    def __init__(self, key: str) -> None:
        try:
            skeleton = json.loads(key)
        except ValueError as e:
            raise LayoutError(f"layout is not JSON: {e}") from None
        if not (isinstance(skeleton, list) and len(skeleton) == len(VIEWS)
                and all(isinstance(v, dict) and all(isinstance(b, dict) for b in v.values()) for v in skeleton)):
            raise LayoutError("layout must be a list of 3 views, each {key: {static fields}}")
        self.key = key
        self.statics: dict[str, dict[str, dict[str, Any]]] = dict(zip(VIEWS, skeleton, strict=True))
        counters = [(v, k, f) for v in VIEWS for k in self.statics[v] for f in VIEW_COUNTERS[v]]
        gauges = [(v, k, f) for v in GAUGE_VIEWS for k in self.statics[v] for f in GAUGES_AND_PEAKS]
        # kind -> (row index, (view, key, field)) of every slot a row of that kind adds to
        self.targets = {"tp0": tuple(enumerate(counters)), "gauges": tuple(enumerate(gauges)),
                        "tpn": tuple((i, slot) for i, slot in enumerate(counters) if slot[2] in BYTE_FIELDS)}
        self.n_counters, self.n_gauges = len(counters), len(gauges)
        self.row_bytes = (8 * len(counters), 8 * len(gauges))  # (counters, gauges) rows, as sent
        # counters row -> its block counters (what tp ranks of one dp group must agree on, with the gauges)
        self.blocks = _picker([i for i, (_, _, f) in enumerate(counters) if f not in BYTE_FIELDS])
        self._specs = {merged: self._bucket_specs(merged) for merged in (False, True)}

    def views(self, counters, gauges, merged: bool = True) -> dict[str, dict[str, dict[str, Any]]]:
        """The three views of a counters row and a gauges row, every bucket laid out as a cluster record's
        (counters, gauges, hit rate, static fields). `merged`: keys in numeric order and sorted window sizes,
        as in a cluster record; else the report's own order and static fields (a rank's record)."""
        views: dict[str, dict[str, dict[str, Any]]] = {view: {} for view in VIEWS}
        for view, key, c0, g0, tail in self._specs[merged]:
            fields_ = VIEW_COUNTERS[view]
            b = dict(zip(fields_, counters[c0:c0 + len(fields_)], strict=True))
            if g0 is not None:
                b.update(zip(GAUGES_AND_PEAKS, gauges[g0:g0 + len(GAUGES_AND_PEAKS)], strict=True))
            if VIEW_HAS_HIT_RATE[view]:
                b[HIT_RATE_FIELD] = hit_rate(b["iterReusedBlocks"], b["iterMissedBlocks"])
            for f, v in tail:
                b[f] = list(v) if type(v) is list else v  # records never share a list
            views[view][key] = b
        return views

    def unpack(self, counters: list, gauges: list) -> dict[str, dict[str, dict[str, Any]]]:
        """A packed message's report views (a rank's record)."""
        return self.views(counters, gauges, merged=False)

    def _bucket_specs(self, merged: bool) -> tuple:
        """(view, key, counters offset, gauges offset or None, static fields) per bucket, in output order."""
        starts, ci, gi = {}, 0, 0
        for view in VIEWS:
            for key in self.statics[view]:
                starts[(view, key)] = (ci, gi if VIEW_HAS_GAUGES[view] else None)
                ci += len(VIEW_COUNTERS[view])
                gi += len(GAUGES_AND_PEAKS) if VIEW_HAS_GAUGES[view] else 0
        specs = []
        for view in VIEWS:
            keys = sorted(self.statics[view], key=key_order) if merged else list(self.statics[view])
            for key in keys:
                static = self.statics[view][key]
                if merged:  # a merged bucket's static fields (merge._new_bucket): sorted windowSizes, always
                    tail = [(f, static[f]) for f in STATIC_FIELDS[view] if f in static]
                    if view == POOL_VIEW:
                        tail.append(("windowSizes", sorted(static.get("windowSizes", ()))))
                else:
                    tail = list(static.items())
                specs.append((view, key, *starts[(view, key)], tuple(tail)))
        return tuple(specs)


def key_order(key: str) -> tuple:
    """Numeric order of bucket keys (window sizes, pool group and life-cycle ids are decimal strings)."""
    return (not key.isdigit(), len(key), key)


_cache: dict[str, Layout] = {}


def layout_for(key: str) -> Layout:
    """The cached layout of a layout string (parsed on first sight)."""
    lay = _cache.get(key)
    if lay is None:
        if not isinstance(key, str):
            raise LayoutError(f"layout must be a str, got {type(key).__name__}")
        lay = Layout(key)
        if len(_cache) >= MAX_CACHED:  # a churning layout: start over rather than grow without bound
            _cache.clear()
        _cache[key] = lay
    return lay


_SWAP = sys.byteorder != "little"


def to_row(values: list, what: str = "numbers") -> bytes:
    """Integers as a row (little-endian int64 bytes); LayoutError naming the first value that is not one."""
    try:
        a = array("q", values)
    except (TypeError, OverflowError):
        bad = next(v for v in values if type(v) is not int or not -2**63 <= v < 2**63)
        raise LayoutError(f"report {what} must be integers, got {type(bad).__name__} {bad!r}") from None
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def from_row(row: bytes) -> array:
    """A row's integers (an int64 array: sums and slices at C speed)."""
    a = array("q", row)
    if _SWAP:
        a.byteswap()
    return a


def pack(report: dict[str, Any]) -> tuple[str, bytes, bytes]:
    """A report's (layout string, counters row, gauges row). A bucket lacking a field counts it as 0."""
    skeleton, counters, gauges = [], [], []
    for view in VIEWS:
        src = report.get(view) or {}
        if not isinstance(src, dict):
            raise LayoutError(f"report[{view!r}] must be a dict, got {type(src).__name__}")
        sk = {}
        get, fields_ = _GETTERS[VIEW_COUNTERS[view]], VIEW_COUNTERS[view]
        for key, b in src.items():
            if not isinstance(b, dict):
                raise LayoutError(f"report[{view!r}][{key!r}] must be a dict, got {type(b).__name__}")
            if not isinstance(key, str):
                raise LayoutError(f"report[{view!r}] keys must be strings, got {key!r}")
            sk[key] = {f: b[f] for f in LAYOUT_FIELDS[view] if f in b}
            try:
                counters.extend(get(b))
            except KeyError:
                counters.extend(b.get(f, 0) for f in fields_)
            if VIEW_HAS_GAUGES[view]:
                try:
                    gauges.extend(_GETTERS[GAUGES_AND_PEAKS](b))
                except KeyError:
                    gauges.extend(b.get(f, 0) for f in GAUGES_AND_PEAKS)
        skeleton.append(sk)
    try:
        key = json.dumps(skeleton, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise LayoutError(f"report static fields must be JSON values: {e}") from None
    # the cached layout's own string: the messages of one batch then share one object, pickled once
    return layout_for(key).key, to_row(counters, "counters"), to_row(gauges, "gauges")


def packed(message: dict[str, Any]) -> dict[str, Any]:
    """`message` in the packed form (itself when it already is)."""
    if "report" not in message:
        return message
    key, counters, gauges = pack(message["report"])
    out = {k: v for k, v in message.items() if k != "report"}
    out.update(layout=key, counters=counters, gauges=gauges)
    return out


def report_of(message: dict[str, Any]) -> dict[str, Any]:
    """The report views of a message in either form."""
    if "report" in message:
        return message["report"]
    lay = layout_for(message["layout"])
    return lay.unpack(from_row(message["counters"]), from_row(message["gauges"]))


def check_rows(message: dict[str, Any]) -> Layout:
    """A packed message's layout; LayoutError unless its rows fit it."""
    lay = _cache.get(message["layout"]) or layout_for(message["layout"])
    if (len(message["counters"]), len(message["gauges"])) != lay.row_bytes:
        raise LayoutError(f"layout has {lay.n_counters} counters and {lay.n_gauges} gauges, message rows "
                          f"{len(message['counters'])} and {len(message['gauges'])} bytes (8 per number)")
    return lay


def column_sums(rows: list[bytes], width: int) -> list[int]:
    """Column sums of equally wide rows (arrays, zip and sum: no Python loop per row or per column)."""
    arrays = [from_row(r) for r in rows] if _SWAP else map(_int64_array, rows)
    return list(map(sum, zip(*arrays, strict=True))) if len(rows) > 1 else list(from_row(rows[0]))


_int64_array = partial(array, "q")
