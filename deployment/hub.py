"""SSE fan-out: one long-poll to the aggregator per replica, shared by every /stats/stream subscriber.

Without it each subscriber holds its own `wait_records` call, so every new record is pickled out of the
aggregator and JSON-encoded once per subscriber. The hub fetches each record once, encodes it once as an
SSE event, and wakes all local subscribers. A subscriber behind the hub's window (a reconnect with an old
`Last-Event-ID`) first catches up with direct `query` calls, then joins the shared feed, so what it
receives is exactly what `/stats` would return: no gap, no repeat. The hub starts from the oldest buffered
record, so its window is only ever built from records the aggregator really emitted.
"""

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from deployment.sse import format_comment, format_event

logger = logging.getLogger("kvfleet.deployment")

CATCH_UP_PAGE = 1000


def encode_record(record: dict) -> str:
    return format_event(json.dumps(record, separators=(",", ":")), id=record["iter"], event="stats")


class StatsHub:
    def __init__(self, stats: Any, keepalive_s: float = 15.0, window: int = 2000) -> None:
        self._stats = stats
        self._keepalive_s = keepalive_s
        self._events: deque[tuple[int, str]] = deque(maxlen=window)  # (iter, encoded event), oldest first
        self._covered_from: int | None = None  # the hub has every record with iter > this (None: not pumping)
        self._head = -1  # newest iter the hub has seen (or its start point)
        self._changed = asyncio.Event()
        self._pump_task: asyncio.Task | None = None
        self.subscribers = 0
        self.upstream_calls = 0

    def _covers(self, since: int) -> bool:
        return self._covered_from is not None and since >= self._covered_from

    def _start_pump(self, since: int) -> None:
        self._covered_from = self._head = since
        self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        failures = 0
        while True:
            try:
                self.upstream_calls += 1
                records = await self._stats.wait_records(self._head, self._keepalive_s)
                fresh = [r for r in records if r["iter"] > self._head]
                failures = 0
            except Exception as exc:
                failures += 1
                logger.warning("stats hub: aggregator call failed (%s), retry %d", type(exc).__name__, failures)
                await asyncio.sleep(min(5.0, 0.2 * 2**failures))  # backoff before calling the aggregator again
                continue
            if not fresh:
                continue
            for r in fresh:
                if len(self._events) == self._events.maxlen:
                    self._covered_from = self._events[0][0]  # the oldest falls out of the window
                self._events.append((r["iter"], encode_record(r)))
            self._head = fresh[-1]["iter"]
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    def _newer_than(self, since: int) -> list[str]:
        out = []
        for it, ev in reversed(self._events):
            if it <= since:
                break
            out.append(ev)
        out.reverse()
        return out

    async def events(self, since: int) -> AsyncIterator[str]:
        """SSE text for every record with iter > since, forever (keepalive comments while idle)."""
        self.subscribers += 1
        try:
            last = since
            if self._pump_task is None:
                self._start_pump(-1)  # from the start of the aggregator's buffer: only real records count
            while True:
                if not self._covers(last):
                    page = await self._catch_up(last)
                    if page is None:
                        yield format_comment("aggregator unavailable")
                        continue
                    if page:
                        last = page[-1]["iter"]
                        yield "".join(encode_record(r) for r in page)
                        continue
                    # nothing after `last` upstream, yet the hub's window starts later: those records are gone
                    logger.info("stats stream: records after %d left the buffer; resuming at %d", last,
                                self._covered_from)
                    last = self._covered_from
                    continue
                out = self._newer_than(last)
                if out:
                    last = self._head
                    yield "".join(out)
                elif not await self._wait_changed():
                    yield format_comment("keepalive")
        finally:
            self.subscribers -= 1

    async def _catch_up(self, since: int) -> list[dict] | None:
        try:
            return await self._stats.query(since, CATCH_UP_PAGE, False)
        except Exception as exc:
            logger.warning("stats hub: catch-up query failed (%s)", type(exc).__name__)
            await asyncio.sleep(1.0)  # backoff before asking the aggregator again
            return None

    async def _wait_changed(self) -> bool:
        """True when new records arrived, False after keepalive_s without any."""
        try:
            await asyncio.wait_for(self._changed.wait(), self._keepalive_s)
            return True
        except TimeoutError:
            return False
