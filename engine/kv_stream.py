"""The engine's public KV event stream (`GET /kv_events`): the ranks' events in vLLM's KV event shape.

Each event's id (the SSE `id:`) is `<incarnation>-<seq>`: `seq` counts this stream's events, `incarnation`
is fresh for every stream (every engine replica's start), so an id from another engine never names an event
here. Events wait in a bounded buffer, so a client that reconnects with a `Last-Event-ID` of this
incarnation resumes exactly while its events are buffered. Any other client (a new one, one further behind,
one with another incarnation's or a malformed id) gets an explicit resync instead: for every dp group an
`AllBlocksCleared` (with `"resync": true`) and one `BlockStored` per tier with every block the index holds
(no tokens, no parent: the keys and the medium are what a router needs), all with the newest id, then the
live events after it. Events are converted only while someone listens (a poll within `LISTEN_S`, or
buffering asked for), so an idle stream costs nothing. The buffer holds them typed (`KVStreamEvent`): the
fleet's router applies their KV events as they are (`FollowReport`), /kv_events shows them in vLLM's shape
(`vllm_event`).
Keys are unsigned 64-bit ints; the salt is in them and is never shown. A salted block's `BlockStored` carries
no tokens (`token_ids` is empty): a router keys by hash, and the tokens are the tenant's prompt.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import deque
from typing import Any

from aggregator.buffer import LongPoll
from engine.messages import KVStreamEvent
from kvcache.events import CLEARED, MOVED, REMOVED, STORED, KVEvent

MEDIUM = ("GPU", "CPU")
LISTEN_S = 30.0
MAX_SEQ_DIGITS = 20  # an event count fits in 64 bits: 20 decimal digits


def stream_events(ev: KVEvent) -> list[tuple[KVEvent, ...]]:
    """One rank event as the stream's events, one per vLLM event (a tier move is removed from one medium, stored
    on the other), each as a KVIndex applies it. A salted block keeps only its key: its tokens are the tenant's."""
    if ev.kind == CLEARED:
        return [(KVEvent(CLEARED),)]
    if ev.kind == REMOVED:
        return [(KVEvent(REMOVED, ev.key, tier=ev.tier),)]
    if ev.kind == MOVED:
        return [(KVEvent(REMOVED, ev.key, tier=1 - ev.tier),), (KVEvent(STORED, ev.key, tier=ev.tier),)]
    assert ev.kind == STORED
    tokens = ev.tokens if ev.salt is None else ()  # a salted prompt is its tenant's: only keys leave
    return [(KVEvent(STORED, ev.key, ev.parent, tokens, ev.tier),)]


def vllm_event(ev: KVStreamEvent, block_size: int) -> dict[str, Any]:
    """One stream event in vLLM's KV event shape, with its `dp_rank` and `ts` (what /kv_events shows)."""
    first = ev.events[0]
    if first.kind == CLEARED:
        out = {"type": "AllBlocksCleared", "dp_rank": ev.dp, "ts": ev.ts}
        return {**out, "resync": True} if ev.resync else out
    keys = [e.key for e in ev.events]
    if first.kind == REMOVED:
        return {"type": "BlockRemoved", "block_hashes": keys, "medium": MEDIUM[first.tier], "dp_rank": ev.dp,
                "ts": ev.ts}
    return {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": first.parent,
            "token_ids": list(first.tokens), "block_size": block_size, "lora_id": None, "lora_name": None,
            "medium": MEDIUM[first.tier], "dp_rank": ev.dp, "ts": ev.ts}


def vllm_events(events: list[KVStreamEvent], block_size: int) -> list[tuple[str, dict[str, Any]]]:
    """(id, vLLM-shaped event) of each: the /kv_events stream's JSON objects."""
    return [(ev.id, vllm_event(ev, block_size)) for ev in events]


class KVEventStream:
    def __init__(self, capacity: int, block_size: int, index: Any, buffer_always: bool = False) -> None:
        self.incarnation = secrets.token_hex(6)
        self.buffer: deque[KVStreamEvent] = deque(maxlen=capacity)  # ids in order
        self.seq = 0  # the newest seq handed out
        self.block_size = block_size
        self.index = index
        self.buffer_always = buffer_always
        self.last_poll = float("-inf")
        self.exact_from = 0  # a client that has seen seqs up to at least this one can resume exactly
        self._changes = LongPoll()  # long polls waiting for new events

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
            for out in stream_events(ev):
                self.seq += 1
                self.buffer.append(KVStreamEvent(self._id(self.seq), dp, ts, out))
        self._changes.notify()

    def cleared(self, dp: int) -> None:
        """A group's blocks are gone (down, restarted, or events switched off)."""
        self.publish(dp, [KVEvent(CLEARED)])

    def since(self, after: str | None) -> list[KVStreamEvent]:
        """Every event after the one `after` names; a resync snapshot first unless that is an
        event of this incarnation that every later one is still buffered after."""
        self.last_poll = time.monotonic()
        seq = self._seq_of(after)
        if seq == self.seq:
            return []
        if seq is not None and max(self.seq - len(self.buffer), self.exact_from) <= seq < self.seq:
            newer = list(itertools.islice(reversed(self.buffer), self.seq - seq))  # the buffer's tail: O(new)
            newer.reverse()
            return newer
        return self._snapshot()

    def _id(self, seq: int) -> str:
        return f"{self.incarnation}-{seq}"

    def _seq_of(self, after: str | None) -> int | None:
        """The seq of an id of this incarnation; None for no id, another incarnation's, or a malformed one (one
        longer than any seq this stream can reach is malformed too: Python refuses int() of 4,300+ digits)."""
        incarnation, _, seq = str(after).partition("-")
        if incarnation != self.incarnation or not (seq.isascii() and seq.isdigit()) or len(seq) > MAX_SEQ_DIGITS:
            return None
        return int(seq)

    def _snapshot(self) -> list[KVStreamEvent]:
        """The index now, as of the newest id (it already holds what every buffered event did)."""
        at = self._id(self.seq)
        ts = time.time()
        out: list[KVStreamEvent] = []
        for dp, held in enumerate(self.index.blocks):
            out.append(KVStreamEvent(at, dp, ts, (KVEvent(CLEARED),), resync=True))
            for tier in (0, 1):
                stored = tuple(KVEvent(STORED, k, tier=tier) for k, t in held.items() if t == tier)
                if stored:
                    out.append(KVStreamEvent(at, dp, ts, stored))
        return out

    async def wait(self, after: str | None, timeout_s: float) -> list[KVStreamEvent]:
        """Long poll: the events after `after` (`since`) as soon as there are any, [] after timeout_s."""
        return await self._changes.wait(lambda: self.since(after), timeout_s)
