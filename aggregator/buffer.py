"""The cluster-record ring buffer: newest `capacity` records, read by iteration without removing anything; and
`LongPoll`, how its readers (and the mirror's and the KV event stream's) wait for what comes next."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class LongPoll:
    """Wakes the long polls waiting on something when it changes: `notify()` after each change, and
    `wait(poll, timeout_s)` answers `poll()` as soon as it has something, else its empty answer at the deadline.
    One event per change, made only while someone waits (so it binds no loop before that)."""

    def __init__(self) -> None:
        self._changed: asyncio.Event | None = None

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait(self, poll: Callable[[], T], timeout_s: float) -> T:
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            got = poll()
            left = deadline - time.monotonic()
            if got or left <= 0:
                return got
            if self._changed is None:
                self._changed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)


class RecordBuffer:
    """Fixed-capacity ring of records in increasing `iter` order; `since` is O(log n + limit)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("buffer capacity must be >= 1")
        self.capacity = capacity
        self._buf: list[dict[str, Any] | None] = [None] * capacity
        self._start = 0  # physical index of the oldest record
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def _at(self, k: int) -> dict[str, Any]:
        return self._buf[(self._start + k) % self.capacity]  # type: ignore[return-value]

    def append(self, record: dict[str, Any]) -> None:
        if self._n and record["iter"] <= self._at(self._n - 1)["iter"]:
            raise ValueError(f"record iter {record['iter']} does not follow {self._at(self._n - 1)['iter']}")
        if self._n < self.capacity:
            self._buf[(self._start + self._n) % self.capacity] = record
            self._n += 1
        else:
            self._buf[self._start] = record
            self._start = (self._start + 1) % self.capacity

    def latest(self) -> dict[str, Any] | None:
        return self._at(self._n - 1) if self._n else None

    def oldest_iter(self) -> int | None:
        return self._at(0)["iter"] if self._n else None

    def since(self, since: int, limit: int | None = None) -> list[dict[str, Any]]:
        """Records with iter > since, oldest first, at most `limit` of them."""
        lo, hi = 0, self._n
        while lo < hi:
            mid = (lo + hi) // 2
            if self._at(mid)["iter"] <= since:
                lo = mid + 1
            else:
                hi = mid
        end = self._n if limit is None else min(self._n, lo + limit)
        return [self._at(k) for k in range(lo, end)]
