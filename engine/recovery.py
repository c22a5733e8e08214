"""Recovery from a dead rank: the restart of a down dp group, and the requests that wait while no group is up.

Why not Ray's actor restarts (`max_restarts`): a restarted rank actor would come back without the model, the
KV cache or its tp group, and its tp peers would still hold the dead rendezvous; a dp group is the unit that
restarts (workers/ranks.py starts one), so the engine restarts it, as new actors, with a backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from engine import ranks
from engine.config import EngineConfig
from engine.errors import RETRY_AFTER_DOWN_S, EngineError, one_line
from engine.scheduler import Group, Request

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
        pause = ranks.backoff_s(g.failures, config.restart_backoff_s)
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
