"""FleetStats: an ingress replica's view of every engine, one StatsMirror (one long poll) per engine.

Each engine numbers its own iterations, so no single number orders the fleet's records. A merged reader's
position is therefore a vector, one iteration per engine: `engine-0-0:812,engine-0-1:400` (each engine's last
iteration delivered; an engine it does not name starts from its oldest record). A page or a stream delivers,
for each engine, the next records of that engine in its order, so resuming from any vector, on any ingress
replica, repeats and skips nothing. Across engines records come in arrival order (within one read, by
timestamp). With one engine the fleet is that engine's mirror and every route keeps its single-engine shape.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

from aggregator.buffer import LongPoll
from deployment.ingress.sse import format_comment, format_event
from deployment.ingress.stats.fleet_metrics import merge_metrics
from deployment.ingress.stats.mirror import CHUNK, StatsMirror, Upstream, paced
from kvcache.stats import hit_rate

logger = logging.getLogger("kvfleet.deployment")
CURSOR_FORM = "<engine id>:<iteration>,... (e.g. engine-0-0:812,engine-0-1:400)"
NOT_SUMMED = ("tokensPerBlock", "cacheHitRate")
# the cumulative kvCacheStats: a gone engine's stay in the fleet's sums (they must never go back), its gauges not
COUNTERS = ("allocTotalBlocks", "allocNewBlocks", "reusedBlocks", "missedBlocks")


class CursorError(ValueError):
    """A position that is not a fleet cursor."""


def parse_cursor(text: str | None, engine_ids: list[str]) -> dict[str, int]:
    """A merged reader's position: -1 (or nothing) is every engine from its oldest record; else the vector.
    Engines the vector does not name start at -1; ids of no engine of this fleet are ignored (another app)."""
    pos = dict.fromkeys(engine_ids, -1)
    text = (text or "").strip()
    if text in ("", "-1"):
        return pos
    if ":" not in text:
        raise CursorError(f"with several engines a position is one iteration per engine: {CURSOR_FORM}")
    for part in text.split(","):
        eid, sep, it = part.strip().rpartition(":")
        try:
            value = int(it)
        except ValueError:
            value = None
        if not sep or not eid or value is None or value < -1:
            raise CursorError(f"bad cursor entry {part!r}: the form is {CURSOR_FORM}")
        if eid in pos:
            pos[eid] = value
    return pos


def format_cursor(pos: dict[str, int]) -> str:
    return ",".join(f"{eid}:{it}" for eid, it in pos.items())


def sum_kv_cache_stats(per_engine: dict[str, dict]) -> dict[str, Any]:
    """The fleet's kvCacheStats: each count summed over the engines, the hit rate recomputed from the sums
    (an average of rates would weigh an idle engine like a busy one)."""
    fleet: dict[str, Any] = {}
    for stats in per_engine.values():
        for k, v in stats.items():
            if k in NOT_SUMMED or not isinstance(v, int | float) or isinstance(v, bool):
                fleet.setdefault(k, v)
            else:
                fleet[k] = fleet.get(k, 0) + v
    if "tokensPerBlock" in fleet:
        fleet["tokensPerBlock"] = max(s.get("tokensPerBlock", 0) for s in per_engine.values())
    if "cacheHitRate" in fleet or "reusedBlocks" in fleet:
        fleet["cacheHitRate"] = hit_rate(fleet.get("reusedBlocks", 0), fleet.get("missedBlocks", 0))
    return fleet


def _order(entry_of: tuple[str, dict]) -> tuple:
    eid, e = entry_of
    return e["record"].get("timestamp") or "", eid, e["iter"]


class FleetStats:
    """The engines' mirrors side by side; the merged reads over them.

    Under autoscaling (`dynamic`) engines come and go (`apply`, from the fleet's registry, engine/registry.py):
    one that joins gets a mirror at once; one that is gone stays readable (its records, and its counters in the
    fleet's sums, so they never go back) but leaves /metrics' per-engine series, /stats/ranks and /health's
    count of engines up, and is forgotten `retention_s` after it went (its counters then stay in `retired`)."""

    def __init__(self, mirrors: dict[str, StatsMirror], dynamic: bool = False,
                 mirror_options: dict[str, Any] | None = None) -> None:
        if not mirrors and not dynamic:
            raise ValueError("a fleet has at least one engine")
        self.mirrors = mirrors
        self.ids = list(mirrors)
        self.dynamic = dynamic
        self._options = mirror_options or {}
        first = next(iter(mirrors.values()), None) or StatsMirror(None, **self._options)
        self.keepalive_s = first.keepalive_s
        self._changes = first.changes  # shared by every mirror when built by `over`
        self.subscribers = 0
        self.gone: dict[str, dict] = {}  # engine id -> its lease in the registry, while gone
        self.retired: dict[str, int] = {}  # the counters of the gone engines the registry no longer lists

    @classmethod
    def over(cls, upstreams: dict[str, Upstream], dynamic: bool = False, **mirror_options: Any) -> FleetStats:
        """One mirror per engine, all waking one change signal (a merged reader waits on every engine)."""
        changes = LongPoll()
        mirrors = {eid: StatsMirror(up, changes=changes, **mirror_options) for eid, up in upstreams.items()}
        fleet = cls(mirrors, dynamic, mirror_options)
        fleet._changes = changes
        return fleet

    @property
    def single(self) -> StatsMirror | None:
        """The one engine's mirror (every route as with one engine), or None with several (or under
        autoscaling, where a fleet of one now may be several soon: the routes keep the fleet's shape)."""
        return self.mirrors[self.ids[0]] if len(self.ids) == 1 and not self.dynamic else None

    @property
    def live_ids(self) -> list[str]:
        return [eid for eid in self.ids if eid not in self.gone]

    def start(self) -> None:
        for m in self.mirrors.values():
            m.start()

    # ---- engines joining and leaving (autoscaling)

    def apply(self, answer: dict[str, Any], make_upstream: Any) -> None:
        """Follow the registry (engine/registry.py `engines`: {"engines": {id: {"gone", "aggregator", "final"}},
        "retired": counters}): a new live engine gets a mirror, started at once; one gone is marked so, and its
        mirror stops following once its aggregator is removed; one the registry no longer lists is forgotten
        (its counters are in `retired`, the registry's, so every ingress sums the same)."""
        table = answer["engines"]
        self.retired = dict(answer.get("retired") or {})
        for eid, lease in table.items():
            if eid in self.mirrors and not (eid in self.gone and not lease["gone"]):
                continue
            if eid in self.mirrors:  # a gone id leased to a new engine: the old one's counters retired
                self._forget(eid)
            # a gone engine this ingress never saw (it started later) too: its final counters are in the sums
            self.mirrors[eid] = StatsMirror(make_upstream(eid), changes=self._changes, **self._options)
            self.ids.append(eid)
            self.mirrors[eid].start()  # at once, reader or not: once the engine is gone its aggregator goes too
            logger.info("fleet: engine %s joined", eid)
            self._changes.notify()
        for eid in list(self.ids):
            lease = table.get(eid)
            if lease is None:
                self._forget(eid)
                continue
            if not lease["gone"]:
                continue
            if eid not in self.gone:
                logger.info("fleet: engine %s is gone", eid)
            self.gone[eid] = lease
            if not lease["aggregator"]:
                self.mirrors[eid].freeze()

    def _forget(self, eid: str) -> None:
        del self.mirrors[eid]
        self.gone.pop(eid, None)
        self.ids.remove(eid)
        self._changes.notify()
        logger.info("fleet: engine %s forgotten", eid)

    def check(self) -> None:
        for m in self.mirrors.values():
            m.check()

    async def close(self) -> None:
        await asyncio.gather(*(m.close() for m in self.mirrors.values()))

    async def _ready(self) -> None:
        await asyncio.gather(*(m.ready() for m in self.mirrors.values()))

    def _merged(self, pos: dict[str, int], limit: int) -> list[tuple[str, dict]]:
        """Up to `limit` entries after `pos`, each engine's in its order (heapq.merge takes only heads)."""
        runs = [[(eid, e) for e in self.mirrors[eid].entries(pos.get(eid, -1), limit)] for eid in self.ids]
        return list(itertools.islice(heapq.merge(*runs, key=_order), limit))

    # ---- the merged reads (several engines, no `engine` filter)

    async def page_json(self, pos: dict[str, int], limit: int) -> tuple[str, dict[str, int] | None]:
        """One merged /stats page, and the vector of the next page when more records follow it."""
        await self._ready()
        got = self._merged(pos, limit + 1)
        page = got[:limit]
        after = dict(pos)
        for eid, e in page:
            after[eid] = e["iter"]
        more = bool(page) and len(got) > limit  # an empty page (limit 0) moves nowhere: no Link, as one engine
        return "[" + ",".join(e["json"] for _, e in page) + "]", after if more else None

    async def records(self, pos: dict[str, int], limit: int | None) -> list[dict]:
        await self._ready()
        return [e["record"] for _, e in self._merged(pos, limit if limit is not None else 10**9)]

    async def events(self, pos: dict[str, int], interval_s: float = 0.0) -> AsyncIterator[str]:
        """The merged SSE stream: each event's `id:` is the vector after it. An engine whose mirror took
        another history (a fresh aggregator) is followed from its oldest record again."""
        self.subscribers += 1
        pos, gens = dict(pos), {eid: m.generation for eid, m in self.mirrors.items()}

        def poll() -> list[tuple[str, dict]]:
            for eid, m in self.mirrors.items():
                if m.generation != gens.setdefault(eid, m.generation):  # an engine that joins starts at -1
                    gens[eid], pos[eid] = m.generation, -1
            return self._merged(pos, CHUNK)

        try:
            await self._ready()
            async for got in paced(self._changes, poll, interval_s, self.keepalive_s):
                if not got:
                    yield format_comment("keepalive")
                    continue
                out = []
                for eid, e in got:
                    pos[eid] = e["iter"]
                    out.append(format_event(e["json"], id=format_cursor(pos), event="stats"))
                yield "".join(out)
        finally:
            self.subscribers -= 1

    async def kv_cache_stats(self) -> dict[str, Any]:
        """{"fleet": the exact sum, "engines": {id: kvCacheStats}}; under autoscaling also "gone": the ids
        of engines gone but still readable (their counters are in the sum, their gauges not)."""
        ids = list(self.ids)
        per = await asyncio.gather(*(self.mirrors[eid].kv_cache_stats() for eid in ids), return_exceptions=True)
        # an engine whose aggregator is not there yet (starting) or any more counts nothing in this answer
        engines = {eid: st if isinstance(st, dict) else {} for eid, st in zip(ids, per, strict=True)}
        if not self.dynamic:
            return {"fleet": sum_kv_cache_stats(engines), "engines": engines}
        return {"fleet": self._fleet_sum(engines), "engines": engines, "gone": [e for e in ids if e in self.gone]}

    def _fleet_sum(self, engines: dict[str, dict]) -> dict[str, Any]:
        """The live engines' kvCacheStats summed, plus the counters of those gone (their final ones as the
        registry read them, else their newest record's) and of those retired."""
        counted = {eid: st for eid, st in engines.items() if eid not in self.gone and st}
        gone = [self.retired] + [self.gone[eid].get("final") or engines.get(eid) or {} for eid in self.gone]
        counted["(gone)"] = {k: sum(st.get(k, 0) for st in gone) for k in COUNTERS}
        return sum_kv_cache_stats(counted)

    async def ranks(self) -> dict[str, dict]:
        ids = self.live_ids
        per = await asyncio.gather(*(self.mirrors[eid].ranks() for eid in ids))
        return dict(zip(ids, per, strict=True))

    async def metrics_text(self) -> str:
        """Every engine's text with an `engine` label, plus the fleet totals; an engine whose aggregator does
        not answer is left out of this scrape (the others are still scraped)."""
        ids = self.live_ids  # a gone engine's series stop
        texts = await asyncio.gather(*(self.mirrors[eid].metrics_text() for eid in ids), return_exceptions=True)
        got = {eid: t for eid, t in zip(ids, texts, strict=True) if isinstance(t, str)}
        if not got:
            raise texts[0] if texts else RuntimeError("no engine is up")
        for eid, t in zip(ids, texts, strict=True):
            if not isinstance(t, str):
                logger.warning("metrics: engine %s left out of this scrape (%s)", eid, type(t).__name__)
        per = {eid: (await self.mirrors[eid].kv_cache_stats()) for eid in got}
        if self.dynamic:  # the gone engines' counters too: the fleet's counters never go back
            per.update({eid: self.mirrors[eid].newest_stats() for eid in self.ids if eid in self.gone})
            return merge_metrics(got, self._fleet_sum(per), len(ids))
        return merge_metrics(got, sum_kv_cache_stats(per), len(ids))

    async def engines_health(self, timeout_s: float) -> dict[str, dict]:
        """Each engine: up (its aggregator answers: an idle engine's ranks have reported nothing yet), why not,
        and the aggregator's health."""
        async def one(m: StatsMirror) -> dict:
            try:
                agg = await asyncio.wait_for(m.health(), timeout_s)
            except Exception as exc:
                why = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
                return {"up": False, "why": f"aggregator: {why}", "aggregator": None}
            up = bool(agg.get("ok", True))
            return {"up": up, "why": None if up else "aggregator: not ok", "aggregator": agg}
        ids, live = list(self.ids), self.live_ids
        got = await asyncio.gather(*(one(self.mirrors[eid]) for eid in live))
        out = dict(zip(live, got, strict=True))
        for eid in ids:
            if eid not in live:  # readable in /stats until forgotten, never up again under this engine
                out[eid] = {"up": False, "gone": True, "why": "gone: autoscaling stopped its replica",
                            "aggregator": None}
        return out

