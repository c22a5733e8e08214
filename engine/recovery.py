"""Recovery from a dead rank: the restart of a down dp group, and the requests that wait while no group is up.

Why not Ray's actor restarts (`max_restarts`): a restarted rank actor would come back without the model, the
KV cache or its tp group, and its tp peers would still hold the dead rendezvous; a dp group is the unit that
restarts (engine/ranks.py starts one), so the engine restarts it, as new actors, with a backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from engine import ranks
from engine.backoff import backoff_s
from engine.config import EngineConfig
from engine.errors import RETRY_AFTER_DOWN_S, EngineError, RequestError, RequestFailed, one_line
from engine.scheduler import Group, Request
from engine.transport import StepFailure

log = logging.getLogger("kvfleet.engine")


class Orphans:
    """Requests that no dp group can take now (every group is down, some restarting), oldest first. Each
    waits until a group comes back (`take_all`) or its deadline, when it fails with a retryable EngineError
    (a 503) and `on_expired(req)` lets the engine forget it."""

    def __init__(self, timeout_s: float, on_expired: Callable[[Request], None]) -> None:
        self.timeout_s = timeout_s
        self.on_expired = on_expired
        self.reqs: list[Request] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def add(self, req: Request) -> None:
        req.dp = -1
        self.reqs.append(req)
        req.expiry = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, req)

    def remove(self, req: Request) -> None:
        if req.expiry is not None:
            req.expiry.cancel()
            req.expiry = None
        if req in self.reqs:
            self.reqs.remove(req)

    def take_all(self) -> list[Request]:
        reqs, self.reqs = self.reqs, []
        for req in reqs:
            self.remove(req)
        return reqs

    def _expire(self, req: Request) -> None:
        req.expiry = None
        if req in self.reqs and not req.done:
            self.reqs.remove(req)
            req.done = True
            self.on_expired(req)
            req.queue.put_nowait(EngineError(
                f"no dp group could take the request within placement_timeout_s ({self.timeout_s:g} s): every "
                "group is down or restarting", RETRY_AFTER_DOWN_S))


async def restart_group(dp: int, g: Group, config: EngineConfig, launch: Callable[[int], Awaitable[ranks.Launched]],
                        prepare: Callable[[ranks.Launched], Awaitable[None]],
                        stop: Callable[[list, list], None] = ranks.stop) -> ranks.Launched | None:
    """Restart down group `dp` until it is up: after a backoff, `launch` new rank actors, then `prepare` them
    (warm-up, stats registration). Each failed attempt counts as one more failure in a row; the group's
    launched ranks, or None once it has failed more than `max_group_restarts` times in a row."""
    while g.failures <= config.max_group_restarts:
        pause = backoff_s(g.failures, config.restart_backoff_s, ranks.BACKOFF_MAX_S)
        await asyncio.sleep(pause)  # the restart policy's backoff: there is nothing to wait for but time
        launched = None
        try:
            launched = await launch(dp)
            await prepare(launched)
            return launched
        except BaseException as e:  # cancelled too (shutdown mid-restart): what was launched goes again
            if launched is not None:
                stop(launched.workers, [launched.pg])
            if not isinstance(e, Exception):
                raise
            g.failures += 1
            log.error("dp group %d: restart failed (%d failures in a row): %s", dp, g.failures, one_line(e))
    return None


class GroupRecovery:
    """The part of `Engine` (engine/core.py) that handles a dp group's failure: the group down, its requests
    re-queued elsewhere, its restart and return to service. Kept here, beside the restart policy, so the step
    loop's file holds the loop; it works on the engine's own state (its groups, ranks, KV event hub, orphans)."""

    def _group_failed(self, dp: int, failure: StepFailure) -> None:
        """A dead rank takes its dp group down (the others go on): its requests are re-queued and the group
        is restarted. Any other step error fails the group's running requests, which are closed on every
        rank, and the group steps on (its KV index resyncs: that step's events are lost)."""
        g, tp = self._groups[dp], self.config.tp
        why = one_line(failure.error)
        if not failure.rank_gone:
            log.error("dp group %d: step of rank %d raised, failing %d running requests: %s", dp, failure.rank,
                      len(g.running), why)
            self.hub.drop_group(dp)  # the step's KV events are lost: resync from the rank's next snapshot
            for req in list(g.running):
                self._finish_failed(g, req, RequestFailed(f"generation failed: {why}"))
            return
        g.down = f"rank {failure.rank} is gone ({type(failure.error).__name__})"
        g.failures += 1
        # unreachable, not known dead: its node may be lost, and until Ray marks the node dead it would place
        # the group's new ranks there again (engine/ranks.py node_gone)
        g.lost_node = g.node if ranks.unreachable(failure.error) else None
        self.hub.drop_group(dp)  # its cache is gone: the KV index forgets it
        moved = list(g.running) + list(g.waiting)
        g.waiting.clear()
        g.running.clear()
        g.to_close.clear()
        self._stop(self.workers[dp * tp:(dp + 1) * tp], [self._pgs[dp]])  # what is left of it
        self.workers[dp * tp:(dp + 1) * tp] = [None] * tp
        self.transport.replace(self.workers)
        log.error("dp group %d is down: %s; re-queueing %d requests", dp, g.down, len(moved))
        for req in reversed(moved):  # oldest first, ahead of what was waiting there (or orphans, if none is up)
            req.requeue()
            self._replace(req, front=True)
        if g.failures > self.config.max_group_restarts:
            self._stays_down(dp)  # the last group to stay down fails every request, these included, once
        else:
            task = self._restarting[dp] = asyncio.get_running_loop().create_task(self._restart(dp))
            task.add_done_callback(lambda _: self._restarting.pop(dp, None))

    def _stays_down(self, dp: int) -> None:
        g = self._groups[dp]
        g.stays_down = True
        g.down = f"{g.down}; stays down after {g.failures} failures in a row"
        log.error("dp group %d stays down: %s", dp, g.down)
        if all(other.stays_down for other in self._groups):
            self.error = "every dp group is down: " + "; ".join(
                f"group {i}: {other.down}" for i, other in enumerate(self._groups))
            self._fail_all(EngineError(self.error, RETRY_AFTER_DOWN_S))

    async def _restart(self, dp: int) -> None:
        """Bring a down group back (`restart_group`), then into service; or it stays down."""
        g, tp = self._groups[dp], self.config.tp
        launched = await restart_group(dp, g, self.config, self._launch, self._prepare, self._stop)
        if launched is None:
            self._stays_down(dp)
            return
        self.workers[dp * tp:(dp + 1) * tp] = launched.workers
        self.transport.replace(self.workers)
        self._pgs[dp] = launched.pg
        self._set_limit(dp, launched.infos)
        self.hub.group_started(dp, launched.infos[0])
        g.down = None
        g.restarts += 1
        log.info("dp group %d back in service (restart %d)", dp, g.restarts)
        for req in self._orphans.take_all():
            self._replace(req)
        self._poke()

    def _replace(self, req: Request, front: bool = False) -> None:
        """Place an admitted request again (its group died, or it waited for one to come back); one that no
        group can take any more fails with its error instead."""
        try:
            self._place(req, front)
        except (RequestError, EngineError) as e:
            req.done = True
            self._requests.pop(req.id, None)
            req.queue.put_nowait(e)

    async def _prepare(self, launched: ranks.Launched) -> None:
        """A restarted group before it serves: warmed up, its new incarnations registered for statistics."""
        await ranks.warm_up(launched.workers)
        if self.stats is not None:
            await self.stats.register([info["layout"] for info in launched.infos])
