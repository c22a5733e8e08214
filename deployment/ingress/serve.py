"""`KVFleetIngress`, the HTTP ingress's Serve deployment (`ingress_replicas` replicas): the FastAPI routes of
api/. Generation goes to the engine's replica through a `DeploymentHandle` (engine_client.py, streamed);
tokenizing and detokenizing happen here. Statistics are served from the replica's `FleetStats` (stats/: one
`StatsMirror`, one long poll, per engine's aggregator), so readers never touch the engines' event loops.
"""

import asyncio
import logging
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployment.ingress.api.routes import create_api
from deployment.ingress.engine_client import EngineClient
from deployment.ingress.stats.aggregator_client import AggregatorClient
from deployment.ingress.stats.fleet import FleetStats
from deployment.settings import Settings
from engine.serve import MAX_ONGOING_REQUESTS, NUM_CPUS

logger = logging.getLogger("kvfleet.deployment")


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    ray_actor_options={"num_cpus": NUM_CPUS},
    graceful_shutdown_timeout_s=30,
)
@serve.ingress()
class KVFleetIngress:
    async def __init__(self, settings: Settings, engine: DeploymentHandle) -> None:
        from workers.model_setting import load_tokenizer

        self._settings = settings
        info = await engine.info.remote()  # waits for the engine's replica to be up
        self._stats = fleet_stats(settings, info.aggregator)
        # under autoscaling the fleet's own list of engine ids, which follow_members keeps current
        ids = self._stats.ids if settings.autoscaling else settings.engine_ids()
        self._engine = EngineClient(engine, load_tokenizer(settings.model or None), info,
                                    settings.placement_timeout_s, settings.fleet_policy, ids, settings.token_transport)
        self._members: asyncio.Task | None = None
        if settings.autoscaling:  # engines join and leave: the fleet's registry says which (engine/registry.py)
            from engine.registry import get_registry

            registry = get_registry(settings.engine_id, settings.gone_engine_retention_s, settings.engine_resource)
            await follow_once(self._stats, registry)
            self._members = asyncio.get_running_loop().create_task(follow_members(self._stats, registry))

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_api(self._engine, self._stats, self._settings)

    async def check_health(self) -> None:
        """Serve's replica health check: a replica whose stats mirror (or its follower of the fleet's engines)
        died is replaced."""
        self._stats.check()
        if self._members is not None and self._members.done():
            raise RuntimeError(f"the fleet's member follower stopped: {self._members.exception()!r}")

    async def __del__(self) -> None:
        if getattr(self, "_members", None) is not None:
            self._members.cancel()
        stats = getattr(self, "_stats", None)
        if stats is not None:
            await stats.close()
        engine = getattr(self, "_engine", None)
        if engine is not None and engine.follower is not None:
            await engine.follower.close()


def fleet_stats(settings: Settings, aggregator: Any) -> FleetStats:
    """One mirror per engine: with one, over the aggregator the engine named (as always); with several, each
    over its engine's aggregator by name (the replica that answered `info` is any one of them)."""
    if settings.autoscaling:  # the registry names them (follow_members)
        return FleetStats.over({}, dynamic=True, capacity=settings.stats_buffer_size)
    ids = settings.engine_ids()
    if len(ids) == 1:
        upstreams = {ids[0]: AggregatorClient(aggregator)}
    else:
        upstreams = {eid: AggregatorClient(engine_id=eid) for eid in ids}
    return FleetStats.over(upstreams, capacity=settings.stats_buffer_size)


MEMBERS_POLL_S = 1.0  # how often an ingress asks the registry which engines there are


async def follow_once(fleet: FleetStats, registry: Any) -> None:
    fleet.apply(await registry.engines.remote(), lambda eid: AggregatorClient(engine_id=eid))


async def follow_members(fleet: FleetStats, registry: Any) -> None:
    """Keep the fleet's engines those the registry lists, every MEMBERS_POLL_S; a failed call (the registry
    restarting) is retried at the next poll."""
    failures = 0
    while True:
        await asyncio.sleep(MEMBERS_POLL_S)
        try:
            await follow_once(fleet, registry)
            failures = 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failures += 1
            if failures == 1 or failures % 60 == 0:
                logger.warning("fleet: the engine registry did not answer (%s), %d times in a row",
                               type(exc).__name__, failures)
