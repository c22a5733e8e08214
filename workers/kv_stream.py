"""The engine's public KV event stream (`GET /kv_events`): the ranks' events in vLLM's KV event shape.

Each event gets a per-engine sequence number (the SSE `id:`) and waits in a bounded buffer, so a client that
reconnects with `Last-Event-ID` resumes without a gap while its events are buffered. A client further behind
(and a new client, without `Last-Event-ID`) gets an explicit resync instead: for every dp group an
`AllBlocksCleared` (with `"resync": true`) and one `BlockStored` per tier with every block the index holds
(no tokens, no parent: the keys and the medium are what a router needs), all with the newest id, then the
live events after it. Events are converted only while someone
listens (a poll within `placement.LISTEN_S`, or buffering asked for), so an idle stream costs nothing.
Keys are unsigned 64-bit ints; the salt is in them and is never shown. A salted block's `BlockStored` carries
no tokens (`token_ids` is empty): a router keys by hash, and the tokens are the tenant's prompt.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from kvcache.events import CLEARED, MOVED, REMOVED, STORED, KVEvent

MEDIUM = ("GPU", "CPU")
LISTEN_S = 30.0


def vllm_event(ev: KVEvent, dp: int, block_size: int, ts: float) -> list[dict[str, Any]]:
    """One rank event as vLLM KV events (a tier move is removed from one medium, stored on the other)."""
    if ev.kind == CLEARED:
        return [{"type": "AllBlocksCleared", "dp_rank": dp, "ts": ts}]
    if ev.kind == REMOVED:
        return [{"type": "BlockRemoved", "block_hashes": [ev.key], "medium": MEDIUM[ev.tier], "dp_rank": dp, "ts": ts}]
    if ev.kind == MOVED:
        return [{"type": "BlockRemoved", "block_hashes": [ev.key], "medium": MEDIUM[1 - ev.tier], "dp_rank": dp,
                 "ts": ts}, _stored([ev.key], None, [], block_size, ev.tier, dp, ts)]
    assert ev.kind == STORED
    tokens = list(ev.tokens) if ev.salt is None else []  # a salted prompt is its tenant's: only keys leave
    return [_stored([ev.key], ev.parent, tokens, block_size, ev.tier, dp, ts)]


def _stored(keys: list[int], parent: int | None, tokens: list[int], block_size: int, tier: int, dp: int,
            ts: float) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "lora_name": None, "medium": MEDIUM[tier], "dp_rank": dp,
            "ts": ts}


class KVEventStream:
    def __init__(self, capacity: int, block_size: int, index: Any, buffer_always: bool = False) -> None:
        self.buffer: deque[tuple[int, dict]] = deque(maxlen=capacity)
        self.seq = 0  # the newest id handed out
        self.block_size = block_size
        self.index = index
        self.buffer_always = buffer_always
        self.last_poll = float("-inf")
        self.exact_from = 0  # a client that has seen ids up to at least this one can resume exactly
        self._new: asyncio.Event | None = None

    @property
    def listening(self) -> bool:
        return self.buffer_always or time.monotonic() - self.last_poll < LISTEN_S

    def publish(self, dp: int, events: list[KVEvent]) -> None:
        if not self.listening:
            if events and self.exact_from != self.seq + 1:
                self.seq += 1  # an id nobody gets: what came before it is known only from a snapshot
                self.exact_from = self.seq
            return
        ts = time.time()
        for ev in events:
            for out in vllm_event(ev, dp, self.block_size, ts):
                self.seq += 1
                self.buffer.append((self.seq, out))
        self._wake()

    def cleared(self, dp: int) -> None:
        """A group's blocks are gone (down, restarted, or events switched off)."""
        self.publish(dp, [KVEvent(CLEARED)])

    def _wake(self) -> None:
        if self._new is not None:
            self._new.set()
            self._new = None

    def since(self, after: int) -> list[tuple[int, dict]]:
        """(id, event) for every event with id > after; a resync snapshot first when some were lost."""
        self.last_poll = time.monotonic()
        oldest = self.buffer[0][0] if self.buffer else self.seq + 1
        if after == self.seq:
            return []
        if max(oldest - 1, self.exact_from) <= after < self.seq:  # else lost, or from another engine's ids
            newer = []
            for item in reversed(self.buffer):  # ids only grow: walk back from the newest, O(new events)
                if item[0] <= after:
                    break
                newer.append(item)
            newer.reverse()
            return newer
        return self._snapshot()

    def _snapshot(self) -> list[tuple[int, dict]]:
        """The index now, as of the newest id (it already holds what every buffered event did)."""
        at = self.seq
        ts = time.time()
        out: list[tuple[int, dict]] = []
        for dp, held in enumerate(self.index.blocks):
            out.append((at, {"type": "AllBlocksCleared", "dp_rank": dp, "ts": ts, "resync": True}))
            for tier in (0, 1):
                keys = [k for k, t in held.items() if t == tier]
                if keys:
                    out.append((at, _stored(keys, None, [], self.block_size, tier, dp, ts)))
        return out

    async def wait(self, after: int, timeout_s: float) -> list[tuple[int, dict]]:
        """Long poll: events with id > after as soon as there are any, [] after timeout_s."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            got = self.since(after)
            left = deadline - time.monotonic()
            if got or left <= 0:
                return got
            if self._new is None:
                self._new = asyncio.Event()
            try:
                await asyncio.wait_for(self._new.wait(), left)
            except TimeoutError:
                pass
