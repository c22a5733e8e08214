"""`KVFleetIngress`, the HTTP ingress's Serve deployment (`ingress_replicas` replicas): the FastAPI routes of
api/. Generation goes to the engine's replica through a `DeploymentHandle` (engine_client.py, streamed);
tokenizing and detokenizing happen here. Statistics are served from the replica's `FleetStats` (stats/: one
`StatsMirror`, one long poll, per engine's aggregator), so readers never touch the engines' event loops.
"""

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
        self._engine = EngineClient(engine, load_tokenizer(settings.model or None), info,
                                    settings.placement_timeout_s, settings.fleet_policy, settings.engine_ids())
        self._stats = fleet_stats(settings, info.aggregator)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_api(self._engine, self._stats, self._settings)

    async def check_health(self) -> None:
        """Serve's replica health check: a replica whose stats mirror died is replaced."""
        self._stats.check()

    async def __del__(self) -> None:
        stats = getattr(self, "_stats", None)
        if stats is not None:
            await stats.close()
        engine = getattr(self, "_engine", None)
        if engine is not None and engine.follower is not None:
            await engine.follower.close()


def fleet_stats(settings: Settings, aggregator: Any) -> FleetStats:
    """One mirror per engine: with one, over the aggregator the engine named (as always); with several, each
    over its engine's aggregator by name (the replica that answered `info` is any one of them)."""
    ids = settings.engine_ids()
    if len(ids) == 1:
        upstreams = {ids[0]: AggregatorClient(aggregator)}
    else:
        upstreams = {eid: AggregatorClient(engine_id=eid) for eid in ids}
    return FleetStats.over(upstreams, capacity=settings.stats_buffer_size)
