"""StatsRelay: one per node, the first stage of the aggregator tree (see the package docstring).

Every Ray call costs the receiving actor a fixed amount of CPU (about 1 ms on a small host) whatever it
carries, so with one call per rank per iteration the StatsAggregator saturates near a thousand calls a
second: 64 ranks at 20 iterations/s already lag by more than a step. A relay on each node takes its ranks'
outbox calls and forwards everything that arrived within `flush_interval_s` as one pickled batch, so the
aggregator pays per node, not per rank, and its per-message cost is the batched one the bench measures.

The relay keeps nothing that matters: acknowledgements still mean "counted in an emitted record" (the relay
passes the aggregator's acks back to each rank on its next call) and ranks keep every unacknowledged
message. A reply names the relay and the aggregator behind it (`aggregator_id`, `epoch`), and every call
names the identity its sender last heard (`expect`): a relay or aggregator that restarted takes nothing from
a call that expects its predecessor and answers `stale`, so the sender re-sends everything unacknowledged
oldest first (newer iterations never overtake lost older ones, which would turn them into late deltas).
A relay that finds its aggregator restarted drops its queue for the same reason; the aggregator dedupes.
When the aggregator cannot be reached the relay keeps its queue (bounded: past `max_queue` it refuses new
batches, and the outboxes hold and fold them) and retries.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import uuid
from typing import Any

import ray
from ray.exceptions import RayActorError

log = logging.getLogger("kvfleet.aggregator.relay")
FIRST_CONTACT_TIMEOUT_S = 10.0  # an outbox call before the aggregator ever answered fails after this


def relay_name(engine_id: str, node_id: str) -> str:
    return f"kvfleet-stats-relay-{engine_id}-{node_id}"


class RelayBusy(RuntimeError):
    """The relay's queue is full (its aggregator has been unreachable for a while)."""


class StatsRelayImpl:
    """The relay's body; `StatsRelay` is this class made a Ray actor."""

    def __init__(self, engine_id: str, flush_interval_s: float = 0.005, max_batch: int = 4096,
                 max_queue: int = 65_536, retry_backoff_s: float = 0.2, aggregator: Any = None) -> None:
        self.engine_id = engine_id
        self.flush_interval_s, self.max_batch, self.max_queue = flush_interval_s, max_batch, max_queue
        self.retry_backoff_s = retry_backoff_s
        self._aggregator = aggregator
        self.id = uuid.uuid4().hex  # new on every (re)start: a restart must look like a new relay to the ranks
        self.queue: list[dict[str, Any]] = []
        self.queued: set[tuple[str, int]] = set()  # (incarnation, seq) in the queue: re-sends are not doubled
        self.acks: dict[str, list[int]] = {}  # incarnation -> acked seqs not yet handed back
        self.rejected: dict[str, list[dict[str, Any]]] = {}
        self.recent: dict[str, float] = {}  # incarnation -> when its rank last called (polled for acks)
        self.who: tuple[str | None, int] | None = None  # (aggregator id, epoch) of the last reply
        self.forwarded = self.batches = 0
        self._kick: asyncio.Event | None = None
        self._first: asyncio.Event | None = None
        self._pump: asyncio.Task | None = None

    def _ensure_started(self) -> None:
        if self._pump is None or self._pump.done():
            self._kick, self._first = asyncio.Event(), asyncio.Event()
            self._pump = asyncio.get_running_loop().create_task(self._run())

    async def ingest(self, messages: list[dict[str, Any]] | bytes, poll: list[str] | None = None,
                     expect: list | None = None) -> dict[str, Any]:
        """An outbox's call (the StatsAggregator.ingest signature, `expect` included): queue its messages,
        answer the acks and rejections the aggregator sent for its incarnations since its last call."""
        self._ensure_started()
        if self.who is None:  # no aggregator answer yet: wait for one, so the identity never flips later
            await asyncio.wait_for(self._first.wait(), FIRST_CONTACT_TIMEOUT_S)
        me = {"epoch": self.who[1], "aggregator_id": f"{self.id}/{self.who[0]}"}
        if expect is not None and list(expect) != [me["aggregator_id"], me["epoch"]]:
            return {**me, "acked": [], "stale": True}  # this relay or its aggregator restarted: re-send all
        if isinstance(messages, bytes | bytearray | memoryview):
            try:
                messages = pickle.loads(messages)
            except Exception as e:
                raise ValueError(f"ingest: messages bytes are not a pickled list ({type(e).__name__}: {e})") from None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("ingest takes a list of message dicts (or one pickle of it)")
        if len(self.queue) + len(messages) > self.max_queue:
            raise RelayBusy(f"stats relay queue full ({len(self.queue)} messages): aggregator unreachable")
        now = time.monotonic()
        incs = set(poll or ())
        for m in messages:
            inc, seq = m.get("incarnation"), m.get("seq")
            incs.add(inc)
            if (inc, seq) not in self.queued:
                self.queued.add((inc, seq))
                self.queue.append(m)
        for inc in incs:
            self.recent[inc] = now
        if messages:
            self._kick.set()
        acked = [(inc, s) for inc in incs for s in self.acks.pop(inc, ())]
        rejected = [r for inc in incs for r in self.rejected.pop(inc, ())]
        out: dict[str, Any] = {**me, "acked": acked}
        if rejected:
            out["rejected"] = rejected
        return out

    async def _run(self) -> None:
        """Forward the queue: at most one call in flight, each carrying what arrived during the last one."""
        while True:
            if not self.queue and self.who is not None:
                self._kick.clear()
                try:  # idle: still collect acks now and then for ranks that stopped sending
                    await asyncio.wait_for(self._kick.wait(), 0.5)
                except TimeoutError:
                    pass
            await asyncio.sleep(self.flush_interval_s)  # let the node's other ranks' messages join
            batch = self.queue[: self.max_batch]
            now = time.monotonic()
            self.recent = {i: t for i, t in self.recent.items() if now - t < 60.0}
            for gone in [i for i in (*self.acks, *self.rejected) if i not in self.recent]:  # ranks that left
                self.acks.pop(gone, None)
                self.rejected.pop(gone, None)
            if not batch and not self.recent and self.who is not None:
                continue  # nobody to forward for or to collect acks for: an idle engine costs nothing
            try:
                if self._aggregator is None:
                    from .actor import aggregator_name

                    self._aggregator = ray.get_actor(aggregator_name(self.engine_id))
                reply = await self._aggregator.ingest.remote(pickle.dumps(batch, protocol=5),
                                                             poll=sorted(self.recent),
                                                             expect=list(self.who) if self.who else None)
            except Exception as e:  # unreachable, or not created yet: keep the queue, retry
                log.warning("stats relay: aggregator unreachable (%s: %s); %d messages queued", type(e).__name__,
                            e, len(self.queue))
                if isinstance(e, RayActorError | ValueError):
                    self._aggregator = None  # look it up by name again
                if self.who is not None:
                    # the call may have run and its reply (with acks handed out once) be lost: a new identity
                    # makes every rank re-send what it holds, and the aggregator acks what it already counted
                    self.id = uuid.uuid4().hex
                await asyncio.sleep(self.retry_backoff_s)
                continue
            who = (reply.get("aggregator_id"), reply["epoch"])
            if who != self.who:
                if self.who is not None:  # the aggregator restarted: the ranks re-send all they hold, in order
                    log.info("stats relay: aggregator %s -> %s, dropping %d queued messages", self.who, who,
                             len(self.queue))
                    self.queue.clear()
                    self.queued.clear()
                    self.rejected.clear()
                self.acks.clear()
                self.who = who
                self._first.set()
            if reply.get("stale"):
                continue
            del self.queue[: len(batch)]
            for m in batch:
                self.queued.discard((m.get("incarnation"), m.get("seq")))
            self.forwarded += len(batch)
            self.batches += 1
            for inc, seq in reply["acked"]:
                self.acks.setdefault(inc, []).append(seq)
            for rej in reply.get("rejected", ()):
                m = batch[rej["index"]]
                self.rejected.setdefault(m.get("incarnation"), []).append(
                    {"incarnation": m.get("incarnation"), "seq": m.get("seq"), "error": rej["error"]})

    async def health(self) -> dict[str, Any]:
        return {"ok": True, "queued": len(self.queue), "forwarded": self.forwarded, "batches": self.batches,
                "aggregator": list(self.who) if self.who else None}


StatsRelay = ray.remote(max_restarts=-1, max_task_retries=-1)(StatsRelayImpl)
