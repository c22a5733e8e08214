"""The engine's end of the stats channel: each iteration's rank deltas to the aggregator, never blocking a step.

`put` queues an iteration (O(1), from the step loop). One task sends everything queued in one `ingest` call,
keeping one call in flight and at most one call every SEND_EVERY_S, so calls batch by themselves when the
aggregator is slow or the steps are fast. Delivery rides Ray: the
aggregator actor restarts and Ray retries the call in flight (`max_task_retries`). What this adds is the one
thing Ray cannot know: the engine keeps every iteration until a reply acknowledges it (the aggregator acks
only what its checkpoint covers), and when a reply shows a new aggregator epoch it re-sends everything not
acknowledged; ingest is idempotent by iteration, so re-sending never counts twice. Only if the aggregator
stays unreachable for `max_unacked` iterations are the oldest dropped (logged; their counts stay in the
ranks' cumulative kvCacheStats). The first `register` attaches this engine (a session that every later call
carries); once another engine attaches, the aggregator refuses this one's calls and the channel stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from aggregator.actor import StaleSession
from aggregator.delta import Iteration
from aggregator.messages import Ack
from engine.backoff import backoff_s
from engine.errors import one_line

log = logging.getLogger("kvfleet.engine")

RETRY_S = (0.05, 2.0)  # the pause after a failed call, doubling (engine/backoff.py), and its ceiling
# At most one ingest call this often: each call costs the aggregator a merge and a checkpoint write to Ray's GCS,
# so at a step every few milliseconds the calls, not the records, were the cost (bench/engine_bench.py's stats
# on/off ratio). The first iteration after a quiet spell still goes at once. 0.1 s, not 0.05: a lone request's
# steps (~40 ms) each took a call, whose two synchronous GCS writes (~90% of the aggregator's time in `ingest`)
# cost the aggregator, the GCS and the engine ~10 ms of CPU a token beside the rank's two threads on 2 cores;
# one call every 0.2 s gave TPOT 37-46 ms against 45-55 (bench/README.md). A record reaches readers up to 0.1 s later.
SEND_EVERY_S = 0.1


class StatsChannel:
    def __init__(self, aggregator: Any, max_unacked: int = 10_000, retry_s: tuple[float, float] = RETRY_S,
                 send_every_s: float = SEND_EVERY_S) -> None:
        self.aggregator = aggregator
        self.max_unacked = max_unacked
        self.retry_s = retry_s
        self.send_every_s = send_every_s
        self._last_send = -float("inf")
        self.unacked: deque[Iteration] = deque()
        self.sent = -1  # newest iteration sent to the current aggregator epoch
        self.epoch: int | None = None
        self.session: int | None = None  # from the attach (the first register)
        self.acked = -1
        self.dropped = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing is unacknowledged
        self._idle.set()
        self._task: asyncio.Task | None = None

    def put(self, it: Iteration) -> None:
        self.unacked.append(it)
        self._idle.clear()
        if len(self.unacked) > self.max_unacked:
            self.unacked.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("stats: aggregator unreachable, %d iterations dropped unsent", self.dropped)
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def register(self, layouts: list) -> int | None:
        """Register rank layouts; the first call attaches the engine. The aggregator's last emitted iteration
        (the engine's iterations continue after the one its attach returned)."""
        reply = await self.aggregator.register.remote(layouts, self.session)
        self.epoch, self.session = reply.epoch, reply.session
        return reply.acked

    async def drained(self) -> None:
        """Until every queued iteration is acknowledged (tests, shutdown)."""
        await self._idle.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        failures = 0
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.unacked and self.unacked[-1].iteration > self.sent:
                wait = self._last_send + self.send_every_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)  # what arrives meanwhile goes in this call
                self._last_send = time.monotonic()
                batch = [it for it in self.unacked if it.iteration > self.sent]
                try:
                    reply = await self.aggregator.ingest.remote(batch, self.session)
                except StaleSession as e:  # replaced by a new engine: what is left here is not ours to send
                    log.warning("stats: %s; %d iterations not sent", one_line(e), len(self.unacked))
                    self.unacked.clear()
                    self._idle.set()
                    return
                except Exception as e:  # not restartable (killed for good), or a bad batch: retry, then log
                    failures += 1
                    pause = backoff_s(failures, *self.retry_s)
                    log.warning("stats: ingest failed (%s), retrying in %.2f s", one_line(e), pause)
                    await asyncio.sleep(pause)
                    continue
                failures = 0
                self._acknowledged(reply, batch[-1].iteration)

    def _acknowledged(self, reply: Ack, newest: int) -> None:
        acked = -1 if reply.acked is None else reply.acked
        if self.epoch is not None and reply.epoch != self.epoch:
            log.warning("stats: aggregator restarted (epoch %s -> %s), re-sending from iteration %d", self.epoch,
                        reply.epoch, acked + 1)
            self.sent = acked
        else:
            self.sent = max(self.sent, newest)
        self.epoch = reply.epoch
        self.acked = acked
        while self.unacked and self.unacked[0].iteration <= acked:
            self.unacked.popleft()
        if not self.unacked:
            self._idle.set()
