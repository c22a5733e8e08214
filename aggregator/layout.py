"""Report key layouts: a rank report flattened once into fixed-order number rows, so merging an iteration
is a C-speed column sum instead of per-bucket dict work.

A layout is the ordered key set of a report's three views (window keys, pool group ids, life-cycle ids),
identical across the messages of a healthy cluster, so it is built once and cached under that key tuple
(its signature). For each layout it holds three plans, each a list of (bucket, fields) pairs and the
(view, key, field) slot every number of a row belongs to:
- `tp0`: every counter of every bucket (a tp rank 0 message: block counters and bytes);
- `tpn`: the byte counters of the window and pool views (other tp ranks move their own shards only);
- `gauges`: gauges and peaks of the window and pool views (the reference rank of a dp group).
A bucket lacking a field counts it as 0 (the dict merge's rule); a bucket that is not a dict, or a value
that is not a number, raises `LayoutError` when the row is built, so a rank message is rejected at ingest.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from .fields import BYTE_FIELDS, GAUGE_FIELDS, PEAK_FIELDS, POOL_VIEW, VIEW_COUNTERS, VIEWS, WINDOW_VIEW

KINDS = ("tp0", "tpn", "gauges")
_KIND_FIELDS = {
    "tp0": {view: VIEW_COUNTERS[view] for view in VIEWS},
    "tpn": {WINDOW_VIEW: tuple(f for f in VIEW_COUNTERS[WINDOW_VIEW] if f in BYTE_FIELDS),
            POOL_VIEW: tuple(f for f in VIEW_COUNTERS[POOL_VIEW] if f in BYTE_FIELDS)},
    "gauges": {WINDOW_VIEW: GAUGE_FIELDS + PEAK_FIELDS, POOL_VIEW: GAUGE_FIELDS + PEAK_FIELDS},
}
# the views whose buckets a message of each kind creates in a merged record (life-cycle buckets carry no
# byte counters, so a tp rank > 0 alone never creates one: the dict merge's rule)
KIND_VIEWS = {kind: tuple(v for v in VIEWS if v in fields) for kind, fields in _KIND_FIELDS.items()}
_GETTERS = {fs: itemgetter(*fs) for per_view in _KIND_FIELDS.values() for fs in per_view.values()}
MAX_CACHED = 256


class LayoutError(ValueError):
    """A report whose buckets cannot be read as numbers."""


class Layout:
    """The flattening plans of one report key layout (see the module docstring)."""

    __slots__ = ("signature", "keys", "plans", "slots")

    def __init__(self, signature: tuple[tuple[str, ...], ...]) -> None:
        self.signature = signature
        self.keys = dict(zip(VIEWS, signature, strict=True))
        self.plans: dict[str, tuple[tuple[int, str, Any, tuple[str, ...]], ...]] = {}
        self.slots: dict[str, tuple[tuple[str, str, str], ...]] = {}
        for kind, per_view in _KIND_FIELDS.items():
            plan, slots = [], []
            for vi, view in enumerate(VIEWS):
                fields_ = per_view.get(view)
                if not fields_:
                    continue
                for key in self.keys[view]:
                    plan.append((vi, key, _GETTERS[fields_], fields_))
                    slots.extend((view, key, f) for f in fields_)
            self.plans[kind], self.slots[kind] = tuple(plan), tuple(slots)

    def row(self, report: dict[str, Any], kind: str) -> list:
        """The numbers of `report` this plan reads, in slot order."""
        vds = (report.get(VIEWS[0]) or {}, report.get(VIEWS[1]) or {}, report.get(VIEWS[2]) or {})
        out: list = []
        ext = out.extend
        for vi, key, get, fields_ in self.plans[kind]:
            src = vds[vi][key]
            try:
                ext(get(src))
            except KeyError:  # a bucket without some field: counts as 0
                ext([src.get(f, 0) for f in fields_])
            except TypeError:
                raise LayoutError(
                    f"report[{VIEWS[vi]!r}][{key!r}] must be a dict, got {type(src).__name__}") from None
        return out


_cache: dict[tuple, Layout] = {}


def signature(report: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    return (tuple(report.get(VIEWS[0]) or ()), tuple(report.get(VIEWS[1]) or ()),
            tuple(report.get(VIEWS[2]) or ()))


def layout_of(report: dict[str, Any]) -> Layout:
    """The cached layout of `report`'s keys (built on first sight of a new key set)."""
    sig = signature(report)
    lay = _cache.get(sig)
    if lay is None:
        if len(_cache) >= MAX_CACHED:  # a churning key set: start over rather than grow without bound
            _cache.clear()
        lay = _cache[sig] = Layout(sig)
    return lay


class Flat:
    """One rank message's report, flattened once at ingest: its layout, its counter row (`tp0` or `tpn`
    plan, by the message's tp rank) and its gauge row (used when it is its dp group's reference)."""

    __slots__ = ("layout", "kind", "counters", "gauges")

    def __init__(self, layout: Layout, kind: str, counters: list, gauges: list) -> None:
        self.layout, self.kind, self.counters, self.gauges = layout, kind, counters, gauges


def _numbers(row: list, what: str) -> list:
    try:
        sum(row)  # C speed; fails on str/None/containers
    except TypeError:
        bad = next(v for v in row if not isinstance(v, int | float))
        raise LayoutError(f"report {what} must be numbers, got {type(bad).__name__} {bad!r}") from None
    return row


def flatten(report: dict[str, Any], tp_rank: int, check: bool = True) -> Flat:
    """`report` as rows; with `check`, LayoutError unless every bucket is a dict and every number a number."""
    lay = layout_of(report)
    kind = "tp0" if tp_rank == 0 else "tpn"
    counters, gauges = lay.row(report, kind), lay.row(report, "gauges")
    if check:
        _numbers(counters, "counters")
        _numbers(gauges, "gauges")
        if kind == "tpn":  # the tpn plan reads no life-cycle bucket: check their shape here
            for key, b in (report.get(VIEWS[2]) or {}).items():
                if not isinstance(b, dict):
                    raise LayoutError(f"report[{VIEWS[2]!r}][{key!r}] must be a dict, got {type(b).__name__}")
    return Flat(lay, kind, counters, gauges)
