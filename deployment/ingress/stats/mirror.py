"""StatsMirror: each ingress replica's copy of the cluster records, kept fresh by one long-poll.

Readers of /stats, /stats/stream and /kv_cache_stats are served from here: they cost the engine's replica and
the aggregator nothing, whatever their number, and each record is serialized to JSON once per replica (the SSE
event and the /stats list are built from the same text). The mirror starts from the aggregator's oldest
buffered record and then follows `wait_records`, so it holds exactly records the aggregator emitted, in order.
What only the aggregator knows (per-rank detail, rank health, Prometheus text) is asked of it directly;
/metrics is cached for `metrics_ttl_s` so that scrapers from several Prometheus replicas share one call.
After a failed call the mirror resyncs from its own head: it asks the aggregator for its newest record alone
(a `wait_records(-1)` answer is capped to the oldest records, so it cannot tell). Found as it was, the mirror
goes on after it and readers get no repeat; an aggregator with another history (a fresh actor numbering from 0
again, or iterations that went backwards) replaces the mirror's records, and `generation` counts that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from aggregator.buffer import LongPoll, RecordBuffer
from aggregator.messages import AggregatorHealth, RankHealth
from deployment.ingress.sse import format_comment, format_event
from engine.backoff import backoff_s

logger = logging.getLogger("kvfleet.deployment")
UPSTREAM_BACKOFF_S = (0.2, 5.0)  # the pause after a failed aggregator call, doubling, and its ceiling
PRIME_TIMEOUT_S = 5.0
CHUNK = 1000  # records a reader takes from the mirror at once: one SSE write at most


class Upstream(Protocol):
    """What the mirror needs of the aggregator (aggregator_client.py `AggregatorClient` calls the actor)."""

    async def query(self, since: int, limit: int | None, ranks: bool) -> list[dict]: ...
    async def wait_records(self, since: int, timeout_s: float) -> list[dict]: ...
    async def ranks(self) -> dict[str, RankHealth]: ...
    def newest_stats(self) -> dict:
        """The newest mirrored record's kvCacheStats ({} before any), asking the aggregator nothing."""
        latest = self._records.latest()
        return dict(latest["record"]["kvCacheStats"]) if latest else {}

    async def kv_cache_stats(self) -> dict: ...
    async def metrics_text(self) -> str: ...
    async def health(self) -> AggregatorHealth: ...


async def paced(changes: LongPoll, poll: Callable[[], list], interval_s: float,
                keepalive_s: float) -> AsyncIterator[list]:
    """What `poll()` has whenever it has something, at least `interval_s` apart (a full CHUNK goes on at once:
    the reader is behind), or [] after `keepalive_s` with nothing (a keepalive is due): one SSE write each."""
    wrote = float("-inf")
    while True:
        got = await changes.wait(poll, keepalive_s)
        if got:
            early = wrote + interval_s - time.monotonic()
            if early > 0:
                await asyncio.sleep(early)  # the pacing itself: records of one interval go in one write
                got = poll()
            wrote = time.monotonic() if len(got) < CHUNK else float("-inf")
        yield got


class StatsMirror:
    def __init__(self, upstream: Upstream, capacity: int = 10_000, keepalive_s: float = 15.0,
                 metrics_ttl_s: float = 1.0, changes: LongPoll | None = None) -> None:
        self.upstream = upstream
        self.keepalive_s = keepalive_s
        self.metrics_ttl_s = metrics_ttl_s
        self._records = RecordBuffer(capacity)  # {"iter", "record", "json"}
        self._head = -1
        self._primed = asyncio.Event()  # set once the first call copied the aggregator's buffer
        self._resync = False  # after a failed call: compare the aggregator's history with ours
        self.generation = 0  # +1 each time another history replaced the records
        # readers waiting for new records (a fleet shares one over its mirrors, so a reader waits on them all)
        self._changes = changes or LongPoll()
        self._pump: asyncio.Task | None = None
        self._metrics: tuple[float, str] = (float("-inf"), "")
        self.subscribers = 0
        self.upstream_calls = 0
        self.frozen = False  # its engine is gone and its aggregator removed: it keeps what it has, follows nothing

    def start(self) -> None:
        if not self.frozen and (self._pump is None or self._pump.done()):
            self._pump = asyncio.get_running_loop().create_task(self._follow())

    def freeze(self) -> None:
        """Stop following (the aggregator was removed after a scale-down); the records stay readable."""
        self.frozen = True
        self._primed.set()
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None  # cancelled, maybe not done yet

    def check(self) -> None:
        """Raise if the follower died of a bug (it outlives aggregator restarts by itself)."""
        if self._pump is not None and self._pump.done() and not self._pump.cancelled():
            raise RuntimeError(f"the stats mirror stopped: {self._pump.exception()!r}")

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)

    async def _follow(self) -> None:
        failures = 0
        while True:
            try:
                self.upstream_calls += 1
                records = await self._next_records()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the aggregator is restarting or not up yet
                failures += 1
                self._resync = self._primed.is_set()
                logger.warning("stats mirror: aggregator call failed (%s), retry %d", type(exc).__name__, failures)
                await asyncio.sleep(backoff_s(failures, *UPSTREAM_BACKOFF_S))
                continue
            self._primed.set()
            fresh = [r for r in records if r["iter"] > self._head]
            for r in fresh:
                self._records.append(_entry(r))
            if fresh:
                self._head = fresh[-1]["iter"]
                self._changes.notify()

    async def _next_records(self) -> list[dict]:
        """The aggregator's whole buffer at first, then each long poll's records after our head; after a failed
        call, the history is checked first."""
        if not self._primed.is_set():
            return await self.upstream.query(-1, None, False)
        if self._resync:
            return await self._resynced()
        return await self.upstream.wait_records(self._head, self.keepalive_s)

    async def _resynced(self) -> list[dict]:
        """After a failed call: the records after our head when the aggregator still has our history (readers
        get no repeat), else, once it holds something, its history from its oldest record."""
        same = await self._same_history()
        if same is None:  # nothing at or after our head: anything it holds is another history
            records = await self.upstream.wait_records(-1, self.keepalive_s)
            if records:
                self._resync = False
                self._restart_history()
            return records
        self._resync = False
        if not same:
            self._restart_history()
        return await self.upstream.wait_records(self._head, self.keepalive_s)

    async def _same_history(self) -> bool | None:
        """Whether the aggregator continues our history (the client's `same_history` rule): it holds our newest
        record with the same timestamp, or buffers only records after it (it moved past our head: nothing to
        contradict ours). None when it holds nothing at or after our head (empty, or iterations went back).
        Our record is asked for alone: a `wait_records(-1)` answer is capped to the oldest records."""
        mine = self._records.latest()
        if mine is None:
            return True
        got = await self.upstream.query(self._head - 1, 1, False)
        if not got:
            return None
        if got[0]["iter"] == self._head:
            return _identity(got[0]) == _identity(mine["record"])
        oldest = await self.upstream.query(-1, 1, False)  # a same history misses our record only past its oldest
        return bool(oldest) and oldest[0]["iter"] > self._head

    def _restart_history(self) -> None:
        logger.warning("stats mirror: the aggregator has another history (newest %d here): following it afresh",
                       self._head)
        self._records = RecordBuffer(self._records.capacity)
        self._head = -1
        self.generation += 1
        self._changes.notify()

    async def _ready(self) -> None:
        """Start following, and wait (a little) for the first copy, so a first reader sees what exists."""
        self.start()
        if not self._primed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._primed.wait(), PRIME_TIMEOUT_S)

    async def _wait(self, since: int, timeout_s: float) -> list[dict]:
        await self._ready()
        return await self._changes.wait(lambda: self._records.since(since, CHUNK), timeout_s)

    # ---- what a fleet (deployment/ingress/stats/fleet.py) reads

    async def ready(self) -> None:
        await self._ready()

    def entries(self, since: int, limit: int | None) -> list[dict]:
        """Mirrored entries ({"iter", "record", "json"}) with iter > since, oldest first."""
        return self._records.since(since, limit)

    @property
    def changes(self) -> LongPoll:
        return self._changes

    # ---- what the routes read

    async def query(self, since: int, limit: int | None, ranks: bool) -> list[dict]:
        if ranks:  # per-rank detail lives in the aggregator only
            return await self.upstream.query(since, limit, True)
        await self._ready()
        return [e["record"] for e in self._records.since(since, limit)]

    async def page_json(self, since: int, limit: int, ranks: bool = False) -> tuple[str, int | None]:
        """One /stats page as JSON text (each record's cached text), and the cursor of the next page: the
        page's last iter when more records follow it, else None."""
        if ranks:
            got = [_entry(r) for r in await self.query(since, limit + 1, True)]
        else:
            await self._ready()
            got = self._records.since(since, limit + 1)
        page = got[:limit]
        after = page[-1]["iter"] if page and len(got) > limit else None
        return "[" + ",".join(e["json"] for e in page) + "]", after

    async def wait_records(self, since: int, timeout_s: float) -> list[dict]:
        return [e["record"] for e in await self._wait(since, timeout_s)]

    async def events(self, since: int, interval_s: float = 0.0) -> AsyncIterator[str]:
        """SSE text for every record with iter > since, forever (keepalive comments while idle). Each yield is
        one write. With `interval_s` writes are that far apart at least, each with the records since the last
        (up to CHUNK: a backlog comes at once), so a subscriber costs the proxy a write per interval, not one
        per record. A reader behind the mirror's window resumes at its oldest record."""
        self.subscribers += 1
        try:
            await self._ready()
            last = since

            def poll() -> list[dict]:
                return self._records.since(last, CHUNK)  # from the reader's position, as the loop moves it

            async for got in paced(self._changes, poll, interval_s, self.keepalive_s):
                if not got:
                    yield format_comment("keepalive")
                    continue
                last = got[-1]["iter"]
                yield "".join(format_event(e["json"], id=e["iter"], event="stats") for e in got)
        finally:
            self.subscribers -= 1

    def newest_stats(self) -> dict:
        """The newest mirrored record's kvCacheStats ({} before any), asking the aggregator nothing."""
        latest = self._records.latest()
        return dict(latest["record"]["kvCacheStats"]) if latest else {}

    async def kv_cache_stats(self) -> dict:
        latest = self._records.latest()
        if latest is None and self.frozen:
            return {}
        return dict(latest["record"]["kvCacheStats"]) if latest else await self.upstream.kv_cache_stats()

    async def metrics_text(self) -> str:
        at, text = self._metrics
        if time.monotonic() - at > self.metrics_ttl_s:
            text = await self.upstream.metrics_text()
            self._metrics = (time.monotonic(), text)
        return text

    async def ranks(self) -> dict[str, dict[str, Any]]:
        """Every rank's health, as /stats/ranks shows it (none once its engine is gone)."""
        if self.frozen:
            return {}
        return {rank: dataclasses.asdict(r) for rank, r in (await self.upstream.ranks()).items()}

    async def health(self) -> dict[str, Any]:
        """The aggregator's health and what this mirror holds: the /health `aggregator` object."""
        h = dataclasses.asdict(await self.upstream.health())
        return {**h, "mirrored": len(self._records), "subscribers": self.subscribers}


def _identity(record: dict) -> tuple:
    """What tells a record from another history's record of the same iteration."""
    return record.get("engineId"), record.get("timestamp")


def _entry(record: dict) -> dict:
    """A mirrored record with its JSON text, serialized once for every reader."""
    return {"iter": record["iter"], "record": record, "json": json.dumps(record, separators=(",", ":"))}
