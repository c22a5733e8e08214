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
    """The engines' mirrors side by side; the merged reads over them."""

    def __init__(self, mirrors: dict[str, StatsMirror]) -> None:
        if not mirrors:
            raise ValueError("a fleet has at least one engine")
        self.mirrors = mirrors
        self.ids = list(mirrors)
        first = next(iter(mirrors.values()))
        self.keepalive_s = first.keepalive_s
        self._changes = first.changes  # shared by every mirror when built by `over`
        self.subscribers = 0

    @classmethod
    def over(cls, upstreams: dict[str, Upstream], **mirror_options: Any) -> FleetStats:
        """One mirror per engine, all waking one change signal (a merged reader waits on every engine)."""
        changes = LongPoll()
        return cls({eid: StatsMirror(up, changes=changes, **mirror_options) for eid, up in upstreams.items()})

    @property
    def single(self) -> StatsMirror | None:
        """The one engine's mirror (every route as with one engine), or None with several."""
        return self.mirrors[self.ids[0]] if len(self.ids) == 1 else None

    def start(self) -> None:
        for m in self.mirrors.values():
            m.start()

    def check(self) -> None:
        for m in self.mirrors.values():
            m.check()

    async def close(self) -> None:
        await asyncio.gather(*(m.close() for m in self.mirrors.values()))

    async def _ready(self) -> None:
        await asyncio.gather(*(m.ready() for m in self.mirrors.values()))

    def _merged(self, pos: dict[str, int], limit: int) -> list[tuple[str, dict]]:
        """Up to `limit` entries after `pos`, each engine's in its order (heapq.merge takes only heads)."""
        runs = [[(eid, e) for e in self.mirrors[eid].entries(pos[eid], limit)] for eid in self.ids]
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
                if m.generation != gens[eid]:
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
        per = await asyncio.gather(*(m.kv_cache_stats() for m in self.mirrors.values()))
        engines = dict(zip(self.ids, per, strict=True))
        return {"fleet": sum_kv_cache_stats(engines), "engines": engines}

    async def ranks(self) -> dict[str, dict]:
        per = await asyncio.gather(*(m.ranks() for m in self.mirrors.values()))
        return dict(zip(self.ids, per, strict=True))

    async def metrics_text(self) -> str:
        """Every engine's text with an `engine` label, plus the fleet totals; an engine whose aggregator does
        not answer is left out of this scrape (the others are still scraped)."""
        texts = await asyncio.gather(*(m.metrics_text() for m in self.mirrors.values()), return_exceptions=True)
        got = {eid: t for eid, t in zip(self.ids, texts, strict=True) if isinstance(t, str)}
        if not got:
            raise texts[0]
        for eid, t in zip(self.ids, texts, strict=True):
            if not isinstance(t, str):
                logger.warning("metrics: engine %s left out of this scrape (%s)", eid, type(t).__name__)
        fleet = sum_kv_cache_stats({eid: (await self.mirrors[eid].kv_cache_stats()) for eid in got})
        return merge_metrics(got, fleet, len(self.ids))

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
        got = await asyncio.gather(*(one(m) for m in self.mirrors.values()))
        return dict(zip(self.ids, got, strict=True))

