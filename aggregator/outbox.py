"""RankOutbox: a rank's unacknowledged stats messages and the daemon thread that delivers them.

`put` never blocks the step loop. The thread sends batches to the engine's StatsAggregator and keeps every
message until the aggregator acknowledges it, which it does once the message's counters are in an emitted
record; so when the aggregator dies, everything it had not emitted is re-sent to its successor (a new
`epoch` in a reply, or a failed call, marks every kept message for re-sending).

Bounded without losing counts: over `max_pending`, the oldest message that the current aggregator has not
received is folded into the next one (merge.fold_rank_messages: counters summed, newer gauges and
snapshot, `iterations: [first, last]`). Messages the aggregator already holds are never folded (that would
count them twice); it emits them within stats_timeout_s, which bounds them.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from .layout import LayoutError, packed
from .merge import fold_rank_messages

log = logging.getLogger("kvfleet.aggregator.outbox")


def resolve_sink(engine_id: str, node_id: str | None) -> Any:
    """Where a rank's outbox sends: its node's StatsRelay when there is one, else the StatsAggregator."""
    from .actor import aggregator_name
    from .relay import relay_name

    if node_id is not None:
        try:
            return ray.get_actor(relay_name(engine_id, node_id))
        except ValueError:
            pass
    return ray.get_actor(aggregator_name(engine_id))

NEW, IN_FLIGHT, DELIVERED = "new", "in_flight", "delivered"


@dataclass
class _Entry:
    message: dict[str, Any]
    wire: dict[str, Any] | None = None  # the packed form that travels (layout.py), made once, off the lock
    state: str = NEW
    sent_at: float = 0.0
    held: bool = False  # an aggregator may have counted it (now or before a restart): never fold it


class RankOutbox:
    """One rank's outbox (one process, one incarnation)."""

    def __init__(self, engine_id: str, max_pending: int = 256, *, handle: Any = None,
                 resolve: Callable[[], Any] | None = None, batch_max: int = 64,
                 resend_after_s: float = 1.0, retry_backoff_s: float = 0.2) -> None:
        if max_pending < 2:
            raise ValueError("max_pending must be >= 2")
        self.engine_id = engine_id
        self.max_pending = max_pending
        self.batch_max = batch_max
        self.resend_after_s = resend_after_s
        self.retry_backoff_s = retry_backoff_s
        self._handle = handle
        self._resolve = resolve or (lambda: resolve_sink(engine_id, None))  # finds a new handle after a failure
        self._cv = threading.Condition()
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._aggregator: tuple[str | None, int] | None = None  # (actor id, epoch) of the last reply
        self._closed = False
        self._flushing = 0
        self.folded = 0
        self.sent_batches = 0
        self._thread = threading.Thread(target=self._run, name=f"kvfleet-outbox-{engine_id}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- rank side

    def put(self, message: dict[str, Any]) -> None:
        """Queue one rank message; never blocks on the aggregator."""
        key = (message["incarnation"], message["seq"])
        with self._cv:
            if key in self._entries:
                return
            self._entries[key] = _Entry(message)
            self._bound()
            self._cv.notify_all()

    def pending(self) -> int:
        with self._cv:
            return len(self._entries)

    @property
    def epoch(self) -> int | None:
        """The epoch of the aggregator that answered last (None before the first answer)."""
        return self._aggregator[1] if self._aggregator else None

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every message is acknowledged; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._flushing += 1
            self._cv.notify_all()
            try:
                while self._entries:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cv.wait(left)
                return True
            finally:
                self._flushing -= 1

    def close(self, timeout_s: float = 1.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout_s)

    # ---------------------------------------------------------------- internals

    def _bound(self) -> None:
        while len(self._entries) > self.max_pending:
            new = [k for k, e in self._entries.items() if e.state == NEW and not e.held]
            pair = next(((a, b) for a, b in zip(new, new[1:], strict=False) if a[0] == b[0]), None)
            if pair is None:
                return  # everything left is held by the aggregator, which emits it within its timeout
            a, b = pair
            e = self._entries[b]
            e.message, e.wire = fold_rank_messages(self._entries.pop(a).message, e.message), None
            self.folded += 1

    def _next_batch(self) -> list[_Entry]:
        """Wait for work: new messages first, else held ones to re-send for their acks."""
        while not self._closed:
            batch = [e for e in self._entries.values() if e.state == NEW][: self.batch_max]
            if batch:
                return batch
            resend = 0.05 if self._flushing else self.resend_after_s
            now = time.monotonic()
            stale = [e for e in self._entries.values() if e.state == DELIVERED and now - e.sent_at >= resend]
            if stale:
                return stale[: self.batch_max]
            self._cv.wait(resend if self._entries else None)
        return []

    def _run(self) -> None:
        while True:
            with self._cv:
                batch = self._next_batch()
                if not batch:
                    return
                polling = self._aggregator is not None and all(e.state == DELIVERED for e in batch)
                now = time.monotonic()
                for e in batch:
                    e.state, e.sent_at = IN_FLIGHT, now
            try:
                if self._handle is None:
                    self._handle = self._resolve()
                expect = list(self._aggregator) if self._aggregator else None
                if polling:  # delivered, only waiting for acks: ask for them instead of re-sending
                    poll = sorted({e.message["incarnation"] for e in batch})
                    reply = ray.get(self._handle.ingest.remote([], poll=poll, expect=expect))
                    self._apply([], reply, polled=batch)
                    continue
                batch = self._pack(batch)
                blob = pickle.dumps([e.wire for e in batch], protocol=5)  # one buffer for Ray (actor.ingest)
                reply = ray.get(self._handle.ingest.remote(blob, expect=expect))
            except Exception as e:  # dead or unreachable actor, or not created yet: keep all, retry
                log.warning("stats aggregator unreachable (%s: %s); keeping %d messages", type(e).__name__,
                            e, len(self._entries))
                with self._cv:
                    if isinstance(e, RayActorError | ValueError):
                        self._handle = None
                    for entry in self._entries.values():
                        entry.held = entry.held or entry.state == IN_FLIGHT
                        entry.state = NEW
                    self._cv.wait(self.retry_backoff_s)
                continue
            self._apply(batch, reply)

    def _pack(self, batch: list[_Entry]) -> list[_Entry]:
        """Give each entry its packed form (outside the lock: in-flight entries are never folded); a message
        that cannot be packed is dropped with an error, as the aggregator would reject it."""
        ok = []
        for e in batch:
            if e.wire is None:
                try:
                    e.wire = packed(e.message)
                except LayoutError as err:
                    log.error("dropping stats message seq %s that cannot be packed: %s", e.message.get("seq"), err)
                    with self._cv:
                        self._entries.pop((e.message.get("incarnation"), e.message.get("seq")), None)
                        self._cv.notify_all()
                    continue
            ok.append(e)
        return ok

    def _apply(self, batch: list[_Entry], reply: dict[str, Any], polled: list[_Entry] = ()) -> None:
        with self._cv:
            self.sent_batches += 1
            for e in polled:  # still held by the same aggregator unless the reply says otherwise
                e.state, e.sent_at = DELIVERED, time.monotonic()
            who = (reply.get("aggregator_id"), reply["epoch"])
            if who != self._aggregator:
                if self._aggregator is not None:
                    log.info("stats aggregator %s -> %s: re-sending %d messages", self._aggregator, who,
                             len(self._entries))
                for e in self._entries.values():  # all again, to the new one; what the old one got stays
                    e.state = NEW  # held: its checkpoint may have counted it, so folding it could count twice
                self._aggregator = who
            if not reply.get("stale"):  # stale: the receiver restarted and took nothing; all of it goes again
                for e in batch:
                    e.state, e.held = DELIVERED, True
            for rej in reply.get("rejected", ()):
                if "seq" in rej:  # named (a relay passes on what the aggregator rejected later)
                    key = (rej.get("incarnation"), rej["seq"])
                else:
                    m = batch[rej["index"]].message
                    key = (m.get("incarnation"), m.get("seq"))
                log.error("stats aggregator rejected message seq %s: %s", key[1], rej["error"])
                self._entries.pop(key, None)
            for inc, seq in reply["acked"]:
                self._entries.pop((inc, seq), None)
            self._bound()
            self._cv.notify_all()
