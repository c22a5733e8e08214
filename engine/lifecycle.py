"""The engine's life cycle: its start (the aggregator checked, a dead predecessor's dp groups taken over, the
rest launched, set up and warmed up) and its shutdown.

Kept apart from the step loop (engine/core.py), as the restart of one group is (engine/recovery.py): what
starts and stops the rank actors is one job, what steps them another. `_launch` and `_stop` are the seams the
restart uses too, and that tests replace with in-process ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from engine import ranks
from engine.errors import EngineError, EngineStopping
from engine.stats_channel import StatsChannel
from engine.transport import make_transport

log = logging.getLogger("kvfleet.engine")


def first_iteration(last_emitted: int | None) -> int:
    """The iteration a (re)started engine begins with: one past what its aggregator already emitted."""
    return 0 if last_emitted is None else max(0, int(last_emitted) + 1)


class EngineLifecycle:
    """The part of `Engine` (engine/core.py) that brings it up and down; it works on the engine's own state."""

    async def start(self) -> None:
        from aggregator import get_or_create_aggregator

        s = self.config
        self.hub.publisher.start()  # ZMQ KV events: a bad endpoint fails first, named
        device = self._device = ranks.device_of(s)
        dtype = self._dtype = ranks.dtype_of(s, device)
        self.placement.resolve_load_weight(device)
        # detached: the aggregator (and the cluster's cumulative statistics) outlive this engine's replica
        self.aggregator = get_or_create_aggregator(s.engine_id, self.world_size, s.tp, s.stats_buffer_size,
                                                   s.engine_resource, lifetime="detached")
        health = await self.aggregator.health.remote()
        if (health.world_size, health.tp) != (self.world_size, s.tp):
            raise EngineError(
                f"a stats aggregator for engine {s.engine_id!r} already runs with world_size "
                f"{health.world_size} and tp {health.tp}, but this engine has {self.world_size} ranks "
                f"(tp {s.tp}): use another engine_id, or stop the old engine first")
        self.iteration = first_iteration(health.last_iter)
        left = ranks.left_behind(s.engine_id)  # what a previous engine of this id left (its replica died)
        adopted = await self._adopt_all(left)  # its live groups, taken over
        ranks.remove_leftovers(s.engine_id, left, list(adopted.values()))  # the rest

        async def launch(dp: int) -> ranks.Launched:
            return adopted[dp] if dp in adopted else await self._launch(dp)

        launched = await ranks.launch_all(launch, s.dp, self._stop)
        for group in launched:
            self._pgs.append(group.pg)
            self.workers += group.workers
        self.rank_info = [info for group in launched for info in group.infos]
        for dp, group in enumerate(launched):
            self._set_limit(dp, group.infos)
        self.vocab_size = self.rank_info[0]["vocab_size"]
        self.transport = make_transport(s.step_transport, self.workers)
        self.placement.reuse_table = self.rank_info[0]["reuse_table"]
        self.placement.partial_worth = self.rank_info[0]["partial_reuse_blocks"]
        for dp, group in enumerate(launched):
            self.hub.group_started(dp, group.infos[0])
        if device == "cpu" and s.tp == 1:  # the cores a rank may take when no other group on its node steps
            self._cores = {info["node_id"]: info.get("cpus", 0) for info in self.rank_info}
        if s.cache.enable_stats:
            self.stats = StatsChannel(self.aggregator)
            self.iteration = first_iteration(await self.stats.register([info["layout"] for info in self.rank_info]))
        await asyncio.gather(*[ranks.warm_up(g.workers) for dp, g in enumerate(launched) if dp not in adopted])
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        log.info("engine %s: %d ranks on %s (%s, %d of %d groups taken over), iterations from %d, requests up to "
                 "%d tokens", s.engine_id, self.world_size, device, dtype, len(adopted), s.dp, self.iteration,
                 self.max_request_tokens)

    async def _adopt_all(self, left: ranks.Left) -> dict[int, ranks.Launched]:
        """The dp groups a dead engine of this id left alive, taken over with their caches (engine/ranks.py).
        Not with compiled graphs: their ranks stay bound to the dead engine's graph."""
        if self.config.step_transport != "actor_calls" or not left.actors:
            return {}
        got = await asyncio.gather(*[ranks.adopt_group(self.config, dp, self._device, self._dtype, left)
                                     for dp in range(self.config.dp)])
        adopted = {dp: g for dp, g in enumerate(got) if g is not None}
        for dp, g in adopted.items():
            self._groups[dp].node = g.infos[0]["node_id"]
        return adopted

    async def _launch(self, dp: int) -> ranks.Launched:
        """Start and set up dp group `dp`, preferring the node with the fewest of the other groups (tests replace
        this and `_stop` with in-process ranks). A restart waits for resources as long as it takes (the group
        is pending meanwhile, and /health says so): a lost node's groups come back when a node joins."""
        g = self._groups[dp]
        if g.lost_node is not None:
            lost, g.lost_node = g.lost_node, None
            if not await ranks.node_gone(lost):
                log.warning("dp group %d: node %s still counts as alive; restarting anyway", dp, lost[:12])
        taken = [other.node for i, other in enumerate(self._groups) if i != dp and not other.stays_down]
        g.node = ranks.spread_target(self.config, self._device, taken)
        first = self._loop_task is None
        launched = await ranks.launch_group(self.config, dp, self._device, self._dtype, g.node,
                                            ranks.SETUP_TIMEOUT_S if first else None,
                                            lambda on: setattr(g, "pending", on))
        g.node = launched.infos[0]["node_id"]
        if self._cores:  # a restart may land on another node
            self._cores[g.node] = launched.infos[0].get("cpus", 0)
        return launched

    def _stop(self, workers: list, pgs: list) -> None:
        ranks.stop(workers, pgs)

    async def shutdown(self) -> None:
        """Stop stepping, fail what is left (Serve has drained the replica's requests before this), remove
        every rank actor and placement group. The detached aggregator stays: a next engine of this id goes on
        with its statistics."""
        self._closing = True
        for task in list(self._restarting.values()):
            task.cancel()
        await asyncio.gather(*self._restarting.values(), return_exceptions=True)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._fail_all(EngineStopping(f"engine {self.config.engine_id} is shutting down"))
        if self.stats is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.stats.drained(), 5.0)
            await self.stats.close()
        if self.transport is not None:
            await self.transport.close()
        await asyncio.to_thread(self.hub.publisher.close)  # sends what is queued, for up to 1 s
        self._stop(self.workers, self._pgs)
        self.workers, self._pgs = [], []
