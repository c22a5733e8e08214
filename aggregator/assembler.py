"""The iteration assembler (no Ray): rank messages in, cluster records out, in iteration order.

Holds what the StatsAggregator actor must decide, with an injectable clock so every rule is testable
without Ray or sleeping:
- dedupe by (incarnation, seq); a merged outbox message also marks its `merged_seqs` seen;
- iteration i is emitted when every expected rank reported it, or `stats_timeout_s` after its first
  message with `complete: false` and `missingRanks`; records leave strictly in increasing `iter` order
  (a complete iteration waits behind an older pending one);
- a message whose iteration was already emitted is a late delta: its counters (tp rule of merge.py) go
  into the next emitted record and are counted in `lateDeltas`; its gauges are not used;
- a merged message covering iterations [a, b] reports its rank for all of them, its counters count at b;
- a message is acknowledged only once its counters are in an emitted record, so a rank's outbox keeps
  it (and re-sends it to a restarted aggregator) until then: no iteration's counts are lost across an
  aggregator restart.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from itertools import repeat
from operator import itemgetter, methodcaller
from typing import Any

from .layout import LayoutError, check_rows, layout_for, packed
from .merge import KV_STATS_COUNTERS, KV_STATS_GAUGES, VIEWS, ClusterCumulative, merge_iteration

REQUIRED = {"engine_id": str, "rank": int, "dp_rank": int, "tp_rank": int, "incarnation": str,
            "iteration": int, "seq": int}


class MessageError(ValueError):
    """A rank message that cannot be merged (wrong shape or wrong rank layout)."""


def iso_timestamp(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


# the usual message: packed, with a kv_cache_stats dict; its fields' exact types, checked in one comparison
_FAST_GET = itemgetter(*REQUIRED, "layout", "counters", "gauges", "kv_cache_stats")
_incarnation, _seq = itemgetter("incarnation"), itemgetter("seq")
_FAST_TYPES = (*REQUIRED.values(), str, bytes, bytes, dict)
_KV_NUMBERS = KV_STATS_COUNTERS + KV_STATS_GAUGES + ("tokensPerBlock",)
_ZEROS = (0,) * len(_KV_NUMBERS)
_KV_NUMBERS_GET = itemgetter(*_KV_NUMBERS)


def validate_message(m: Any, engine_id: str, world_size: int, tp: int) -> None:
    """Raise MessageError saying what is wrong with rank message `m` (either form: layout.py). Its rows are
    checked against its layout at ingest (`check_rows`).

    The usual message (packed, exact types, no `iterations`) passes one straight-line check; anything else
    takes the field-by-field path, which names the first problem."""
    if type(m) is dict:
        try:
            values = _FAST_GET(m)
        except KeyError:
            pass
        else:
            eng, r, dp, tpr, _, it, seq, _, _, _, kvs = values
            if (tuple(map(type, values)) == _FAST_TYPES and eng == engine_id and 0 <= r < world_size
                    and dp == r // tp and tpr == r % tp and it >= 0 and seq >= 0
                    and "iterations" not in m and "report" not in m):
                try:
                    sum(map(kvs.get, _KV_NUMBERS, _ZEROS))  # its numbers are numbers (C speed)
                    return
                except TypeError:
                    pass  # the full check names the field
    _validate_fields(m, engine_id, world_size, tp)
    _check_kv_stats(m.get("kv_cache_stats"))


def batch_valid(messages: list[Any], engine_id: str, placements: set[tuple[int, int, int]]) -> bool:
    """Whether every message of a batch is a usual one (what validate_message's straight-line check and
    check_rows accept), decided in C-level passes over the whole batch. False sends the batch through the
    per-message checks, which name what is wrong. `placements`: the valid (rank, dp_rank, tp_rank)."""
    if not messages:
        return True
    try:
        if set(map(type, messages)) != {dict}:
            return False
        values = list(map(_FAST_GET, messages))
        if (set(map(tuple, map(partial(map, type), values))) != {_FAST_TYPES}
                or set(map(_first, values)) != {engine_id} or not set(map(_placement, values)) <= placements
                or min(map(_iteration_of, values)) < 0 or min(map(_seq_of, values)) < 0
                or any(map(_has_iterations, messages)) or any(map(_has_report, messages))):
            return False
        sum(map(sum, map(_KV_NUMBERS_GET, map(_kv_of, values))))  # TypeError unless all numbers
        [key] = set(map(_layout_of, messages))  # ValueError unless one layout (the usual batch)
        lay = layout_for(key)
        return ({*map(len, map(_counters_of, messages))}, {*map(len, map(_gauges_of, messages))}) == (
            {lay.row_bytes[0]}, {lay.row_bytes[1]})
    except (KeyError, TypeError, ValueError):  # LayoutError is a ValueError
        return False


_first, _placement, _iteration_of, _seq_of, _kv_of = (itemgetter(0), itemgetter(1, 2, 3), itemgetter(5),
                                                      itemgetter(6), itemgetter(10))
_layout_of, _counters_of, _gauges_of = itemgetter("layout"), itemgetter("counters"), itemgetter("gauges")
_has_iterations, _has_report = methodcaller("__contains__", "iterations"), methodcaller("__contains__", "report")


def _check_kv_stats(kvs: dict[str, Any] | None) -> None:
    if kvs:
        try:
            sum(map(kvs.get, _KV_NUMBERS, _ZEROS))  # C speed; fails on str/None/containers
        except TypeError:
            bad = next(k for k in _KV_NUMBERS if not isinstance(kvs.get(k, 0), int | float))
            raise MessageError(f"kv_cache_stats[{bad!r}] must be a number, got {kvs[bad]!r}") from None


def _validate_fields(m: Any, engine_id: str, world_size: int, tp: int) -> None:
    if not isinstance(m, dict):
        raise MessageError(f"message must be a dict, got {type(m).__name__}")
    for k, t in REQUIRED.items():
        v = m.get(k)
        if type(v) is not t and not (t is dict and isinstance(v, dict)):  # exact: bool is no int here
            if k not in m:
                raise MessageError(f"message lacks {k!r}")
            raise MessageError(f"{k!r} must be {t.__name__}, got {type(v).__name__}")
    if m["engine_id"] != engine_id:
        raise MessageError(f"engine_id {m['engine_id']!r} is not this aggregator's {engine_id!r}")
    r = m["rank"]
    if not 0 <= r < world_size:
        raise MessageError(f"rank {r} outside world_size {world_size}")
    if (m["dp_rank"], m["tp_rank"]) != (r // tp, r % tp):
        raise MessageError(f"rank {r} must have dp_rank {r // tp}, tp_rank {r % tp} with tp={tp}")
    if m["iteration"] < 0 or m["seq"] < 0:
        raise MessageError("iteration and seq must be >= 0")
    its = m.get("iterations")
    if its is not None and (
        not isinstance(its, list | tuple) or len(its) != 2 or not its[0] <= its[1] == m["iteration"]
    ):
        raise MessageError("'iterations' must be [first, last] with last == iteration")
    if "report" in m or "layout" not in m:
        if "layout" in m:
            raise MessageError("a message carries either 'report' or 'layout', 'counters' and 'gauges', not both")
        if not isinstance(m.get("report"), dict):
            raise MessageError("message lacks 'report'" if "report" not in m else "'report' must be a dict")
        for view in VIEWS:
            if not isinstance(m["report"].get(view, {}), dict):
                raise MessageError(f"report[{view!r}] must be a dict")
    else:
        for k, t in (("layout", str), ("counters", bytes), ("gauges", bytes)):
            if type(m.get(k)) is not t:
                raise MessageError(f"packed message needs {k!r} ({t.__name__})")
    if m.get("kv_cache_stats") is not None and not isinstance(m["kv_cache_stats"], dict):
        raise MessageError("'kv_cache_stats' must be a dict")


@dataclass
class _Pending:
    first_seen: float
    reported: set[int] = field(default_factory=set)
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Seen:
    """Seqs of one incarnation seen so far: everything <= low, plus `above`.

    A gap below `above` (an aggregator restarted mid-stream sees seqs from 5000 on) is closed once `above`
    holds `compact_after` seqs: a sender keeps at most its unacknowledged messages, far fewer, so a seq that
    far below the newest ones cannot still be on its way.
    """

    low: int = -1
    above: set[int] = field(default_factory=set)
    compact_after = 1024

    def to_state(self, holes: list[int]) -> list:
        return [self.low, sorted(self.above), holes]

    @classmethod
    def from_state(cls, state: list) -> _Seen:
        """Seen seqs minus `holes` (seen, not yet emitted: a restarted aggregator must take them again)."""
        low, above, holes = int(state[0]), set(state[1]), set(state[2])
        if holes and min(holes) <= low:
            above |= set(range(min(holes), low + 1))
            low = min(holes) - 1
        seen = cls(low, above - holes)
        return seen

    def has(self, seq: int) -> bool:
        return seq <= self.low or seq in self.above

    def add(self, seq: int) -> None:
        if seq == self.low + 1 and not self.above:  # the usual case: the next seq in order
            self.low = seq
        elif seq > self.low:
            self.above.add(seq)
            if len(self.above) > self.compact_after:
                self.low = min(self.above) - 1
            while self.low + 1 in self.above:
                self.low += 1
                self.above.discard(self.low)


@dataclass
class IngestResult:
    acked: list[tuple[str, int]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    duplicates: int = 0


class IterationAssembler:
    """Pending iterations, emission, late deltas, dedupe and acks for one engine's ranks."""

    def __init__(self, engine_id: str, world_size: int, tp: int, stats_timeout_s: float = 2.0, *,
                 epoch: int = 1, last_emitted: int = -1, cumulative: ClusterCumulative | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        if world_size < 1 or tp < 1 or world_size % tp:
            raise ValueError(f"world_size {world_size} must be a positive multiple of tp {tp}")
        if stats_timeout_s <= 0:
            raise ValueError("stats_timeout_s must be > 0")
        self.engine_id, self.world_size, self.tp = engine_id, world_size, tp
        self._placements = {(r, r // tp, r % tp) for r in range(world_size)}
        self.timeout = stats_timeout_s
        self.epoch = epoch
        self.clock, self.wall = clock, wall
        self.last_emitted = last_emitted
        self.cumulative = cumulative or ClusterCumulative()
        self.pending: dict[int, _Pending] = {}
        self._order: list[int] = []  # sorted pending iteration numbers
        self.late: list[dict[str, Any]] = []  # late deltas, for the next record
        self._seen: OrderedDict[str, _Seen] = OrderedDict()
        self._unemitted: dict[tuple[str, int], int] = {}  # (inc, seq) -> iteration its counters wait for
        self._ack_ready: dict[str, list[int]] = {}
        self.latest: dict[int, dict[str, Any]] = {}  # rank -> newest message
        self.last_seen: dict[int, float] = {}  # rank -> wall time of its newest message
        self.counts = {"messages": 0, "duplicates": 0, "rejected": 0, "records": 0, "incomplete": 0,
                       "late_deltas": 0, "tp_divergences": 0}

    # ------------------------------------------------------------------ ingest

    def ingest(self, messages: list[dict[str, Any]], poll: tuple[str, ...] | list[str] = ()) -> IngestResult:
        """Take messages; `poll` names incarnations that only ask for their acks (an idle rank's outbox).

        This loop is the aggregator's hot path (bench/aggregator_bench.py): per message it validates,
        dedupes and files the message under its iteration; everything else waits for emission."""
        res = IngestResult()
        incs: set[str] = set(poll)
        now, wall = self.clock(), self.wall()
        engine_id, world_size, tp = self.engine_id, self.world_size, self.tp
        seen_of, latest, unemitted, update = self._seen, self.latest, self._unemitted, self.cumulative.update
        pending, last_emitted, last_seen = self.pending, self.last_emitted, self.last_seen
        snapshot_runs: dict[int, list[dict[str, Any]]] = {}  # rank -> its snapshots to apply, in order
        accepted = 0
        checked = batch_valid(messages, engine_id, self._placements)  # the usual batch: checked at C speed
        for idx, m in enumerate(messages):
            try:
                if not checked:
                    validate_message(m, engine_id, world_size, tp)
                inc, seq = m["incarnation"], m["seq"]
                seen = seen_of.get(inc)
                if seen is not None and (seq <= seen.low or seq in seen.above):
                    self.counts["duplicates"] += 1
                    res.duplicates += 1
                    incs.add(inc)
                    if (inc, seq) not in unemitted:
                        res.acked.append((inc, seq))
                    continue
                if not checked:
                    if "report" in m:
                        m = packed(m)
                    check_rows(m)
            except (MessageError, LayoutError) as e:  # not marked seen: a corrected re-send is taken
                self.counts["rejected"] += 1
                res.rejected.append({"index": idx, "error": str(e)})
                continue
            incs.add(inc)
            if seen is None:
                seen = seen_of[inc] = _Seen()
                if len(seen_of) > 8 * world_size:
                    old, _ = seen_of.popitem(last=False)
                    self._ack_ready.pop(old, None)
            if seq == seen.low + 1 and not seen.above:  # the usual case: the next seq in order
                seen.low = seq
            else:
                seen.add(seq)
            if "merged_seqs" in m:
                for s in m["merged_seqs"]:
                    seen.add(s)
            accepted += 1
            rank, it = m["rank"], m["iteration"]
            prev = latest.get(rank)
            if prev is None or m.get("timestamp", 0) >= prev.get("timestamp", 0):
                latest[rank] = m
            last_seen[rank] = wall
            if m.get("kv_cache_stats"):  # a run of one incarnation's rising snapshots: only its last counts
                runs = snapshot_runs.get(rank)
                if runs is None:
                    snapshot_runs[rank] = [m]
                elif runs[-1]["incarnation"] == inc and seq > runs[-1]["seq"]:
                    runs[-1] = m
                else:
                    runs.append(m)
            if "iterations" in m:  # a folded message reports its rank for every iteration it spans
                for j in range(max(m["iterations"][0], last_emitted + 1), it):
                    self._pending_at(j, now).reported.add(rank)
            if it <= last_emitted:
                self.late.append(m)
                unemitted[(inc, seq)] = -1
                continue
            p = pending.get(it) or self._pending_at(it, now)
            p.reported.add(rank)
            p.messages.append(m)
            unemitted[(inc, seq)] = it
        self.counts["messages"] += accepted
        # cumulative snapshots: within a run of one incarnation's rising seqs the last snapshot stands for the
        # earlier ones (each is cumulative), so a batch of k iterations costs this once per rank, not k times;
        # the same result as applying every message in order, which a test checks
        for runs in snapshot_runs.values():
            for m in runs:
                update(m)
        for inc in incs:
            ready = self._ack_ready.pop(inc, None)
            if ready:
                res.acked.extend((inc, s) for s in ready)
        return res

    def _pending_at(self, it: int, now: float) -> _Pending:
        p = self.pending.get(it)
        if p is None:
            p = self.pending[it] = _Pending(first_seen=now)
            bisect.insort(self._order, it)
        return p

    # ------------------------------------------------------------------ restart

    def checkpoint(self) -> dict[str, Any]:
        """What a restarted aggregator needs to count every message exactly once (picklable; pickle it at once)."""
        holes: dict[str, list[int]] = {}
        for inc, seq in self._unemitted:
            holes.setdefault(inc, []).append(seq)
        return {
            "epoch": self.epoch,
            "last_iter": self.last_emitted,
            "seen": {inc: seen.to_state(sorted(holes.get(inc, ()))) for inc, seen in self._seen.items()},
            "cumulative": self.cumulative.to_state(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue after a restart from `checkpoint()`: pending iterations are gone (their ranks re-send
        them, unacknowledged), iterations up to `last_iter` were emitted, emitted messages stay counted."""
        self.last_emitted = int(state["last_iter"])
        self._seen = OrderedDict((inc, _Seen.from_state(s)) for inc, s in state["seen"].items())
        self.cumulative = ClusterCumulative.from_state(state["cumulative"])

    # ------------------------------------------------------------------ emission

    def next_deadline(self) -> float | None:
        """Clock time at which the oldest pending iteration times out (None when nothing is pending)."""
        if not self._order:
            return None
        return self.pending[self._order[0]].first_seen + self.timeout

    def due(self) -> bool:
        """Whether `poll()` would emit a record now."""
        if not self._order:
            return False
        p = self.pending[self._order[0]]
        return len(p.reported) >= self.world_size or self.clock() - p.first_seen >= self.timeout

    def poll(self) -> list[dict[str, Any]]:
        """Emit every iteration that is due, oldest first."""
        out = []
        now = self.clock()
        while self._order:
            it = self._order[0]
            p = self.pending[it]
            if len(p.reported) < self.world_size and now - p.first_seen < self.timeout:
                break
            self._order.pop(0)
            del self.pending[it]
            out.append(self._emit(it, p))
        return out

    def _emit(self, it: int, p: _Pending) -> dict[str, Any]:
        late, self.late = self.late, []
        merged = merge_iteration(p.messages, late)
        missing = [r for r in range(self.world_size) if r not in p.reported]
        self.last_emitted = it
        self.counts["records"] += 1
        self.counts["incomplete"] += bool(missing)
        self.counts["late_deltas"] += len(late)
        self.counts["tp_divergences"] += len(merged.tp_divergence)
        errors = list(merged.errors)
        tpbs = self.cumulative.tokens_per_block_values()
        if len(tpbs) > 1 and not errors:
            errors.append({"field": "tokensPerBlock", "error": "ranks disagree on tokensPerBlock",
                           "values": sorted(tpbs)})
        done = p.messages + late
        keys = list(zip(map(_incarnation, done), map(_seq, done), strict=True))
        deque(map(self._unemitted.pop, keys, repeat(None)), maxlen=0)  # counted now: acks may go out
        ready = self._ack_ready
        for inc, seq in keys:
            seqs = ready.get(inc)
            if seqs is None:
                if inc not in self._seen:  # an incarnation long gone: nobody asks
                    continue
                seqs = ready[inc] = []
            seqs.append(seq)
        return {
            "iter": it,
            "timestamp": iso_timestamp(self.wall()),
            "engineId": self.engine_id,
            "aggregatorEpoch": self.epoch,
            "numRanks": self.world_size,
            "reportedRanks": sorted(p.reported),
            "missingRanks": missing,
            "complete": not missing,
            "lateDeltas": len(late),
            "tpDivergence": merged.tp_divergence,
            "errors": errors,
            "kvCacheStats": self.cumulative.stats(),
            **merged.views,
            "_rank_messages": p.messages,  # the actor moves these to its per-rank detail buffer
        }
