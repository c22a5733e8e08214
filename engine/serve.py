"""`KVFleetEngine`, the engine's Serve deployment: one replica per engine, owning its `Engine` (rank actors and
stats aggregator). It answers `generate` (a stream of token events), `info`, `health`, `kv_events` and the
fleet router's `follow` through its handle; Serve's `check_health` replaces a replica whose engine can no longer
serve at all. As Ray Serve LLM's `LLMServer` apart from its ingress (deployment/ingress/). Neither deployment
reserves CPU: the rank actors reserve theirs (dp * tp * num_cpus_per_rank), and the defaults must fit a 2-core
laptop, where `serve run deployment:app` gives Ray exactly 2 CPUs.
"""

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from engine.errors import EngineError
from engine.kv_stream import vllm_events
from engine.messages import EngineHealth, EngineInfo, FollowReport, GenerateRequest

logger = logging.getLogger("kvfleet.deployment")

NUM_CPUS = 0
# /stats pollers, /stats/stream subscribers and streamed generations are long-lived: Serve's default (5)
# would queue them
MAX_ONGOING_REQUESTS = 1000
# fleet routers (one per ingress replica process) whose tickets an engine replica reports: the least recently
# updated go first
MAX_ROUTERS = 64
ENGINE_HEALTH_CHECK_S = 1.0  # Serve's health check period of the engine replicas (see KVFleetEngine)


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    ray_actor_options={"num_cpus": NUM_CPUS},
    max_constructor_retry_count=3,
    graceful_shutdown_timeout_s=30,
    # how soon Serve's controller finds a dead replica (its default, 10 s, would be most of a replica's recovery,
    # as the replacement takes its ranks over): a check is one call that reads a field
    health_check_period_s=ENGINE_HEALTH_CHECK_S,
)
class KVFleetEngine:
    async def __init__(self, settings: Any) -> None:
        from engine.core import Engine  # imported here: importing `deployment` must stay light

        self._settings = settings
        self._tickets: dict[str, int] = {}  # the fleet router's newest ticket admitted, per router (follow)
        self._registry = self._holder = None
        rank = serve.get_replica_context().rank.rank  # Serve's replica rank: the engine this replica is
        if settings.autoscaling:  # ranks no longer name engines: the fleet's registry leases an id
            from engine.registry import get_registry

            self._registry = get_registry(settings.engine_id, settings.gone_engine_retention_s,
                                          settings.engine_resource)
            self._holder = ray.get_runtime_context().get_actor_name()
            rank = int((await self._registry.claim.remote(rank, self._holder)).rpartition("-")[2])
        else:  # an autoscaled app of this engine_id may have left a registry that still removes this id's actors
            from engine.registry import disown_if_leased

            await disown_if_leased(settings.engine_id, settings.engine_id_of(rank))
        self._engine = Engine(settings.engine_config(rank))
        try:
            await self._engine.start()
        except BaseException:
            logger.exception("engine %s failed to start", self._engine.config.engine_id)
            await self._engine.shutdown()
            # Serve still calls __del__ and tries again with a new replica of the same rank: the id stays leased to
            # this dead holder, so the retry takes it over (not released: a release would make it gone)
            self._engine = self._registry = None
            raise
        logger.info("engine %s started: dp=%d tp=%d model=%s", self._engine.config.engine_id, settings.dp, settings.tp,
                    settings.model or "built-in")

    def info(self) -> EngineInfo:
        e = self._engine
        return EngineInfo(e.max_model_len, e.max_seq_len, e.vocab_size, e.aggregator)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Any]:
        """`ADMITTED` once the engine has admitted the request (so the ingress answers a refusal with its status
        code, before any response starts), then its token events. With the dp group the fleet's `kv` router
        chose for this engine on `req`, if it did."""
        placed = req.placed(self._engine.config.engine_id)
        events = self._engine.generate(req.request_id, req.token_ids, req.params, req.cache_salt, announce=True,
                                       num_output_tokens=req.num_output_tokens, placed=placed)
        if placed is not None:  # from the next report on, the router finds it in this engine's load and room
            # popped and put back: the dict's order is the routers' last update, the first one the stalest
            self._tickets[req.router] = max(req.ticket, self._tickets.pop(req.router, -1))
            if len(self._tickets) > MAX_ROUTERS:  # the longest silent: an ingress replica long gone, likely
                self._tickets.pop(next(iter(self._tickets)))
        async with contextlib.aclosing(events):  # closed when this stream is: the engine aborts the request then
            async for ev in events:
                yield ev

    async def health(self) -> EngineHealth:
        return await self._engine.health()

    async def kv_events(self, after: str | None, timeout_s: float,
                        replica: str | None = None) -> list[tuple[str, dict]]:
        """Long poll of the KV event stream (engine/kv_stream.py): (id, vLLM-shaped event) after `after`.
        `replica`: the replica the `kv` router sends the call to (/kv_events?engine= with several)."""
        if replica is not None and replica != serve.get_replica_context().replica_id.unique_id:
            raise EngineError(f"engine {self._engine.config.engine_id!r} answered for replica {replica}, which "
                              "is not up: retry")
        return vllm_events(await self._engine.kv_events(after, timeout_s), self._engine.config.cache.tokens_per_block)

    async def follow(self, after: str | None, timeout_s: float, replica: str | None = None) -> FollowReport:
        """The fleet's `kv` router's long poll (deployment/router/fleet_view.py): this engine's KV events after
        `after`, then its groups' load and room. `replica`: the replica the router sends the call to."""
        e = self._engine
        me = serve.get_replica_context().replica_id.unique_id
        if replica is not None and replica != me:  # routed here while that replica is not in the router's set
            return FollowReport(me)
        events = await e.kv_events(after, timeout_s)
        tickets = dict(self._tickets)  # a copy: Serve may pickle the answer on another thread while generate runs
        return FollowReport(me, e.config.engine_id, e.config.cache.tokens_per_block, events, e.groups_state(), tickets)

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's routing stats of this replica: its engine id (what a router, or an operator, can read)."""
        return {"engine": self._engine.config.engine_id}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics of this replica: its engine's exact load (engine/messages.py
        `LoadReport`), which the engine deployment's policy reads (deployment/autoscale.py). Async: on the
        engine's loop, never in a thread beside it (its queues change under a sync method in Serve's pool)."""
        return dataclasses.asdict(self._engine.load_report())

    async def check_health(self) -> None:
        """Serve's replica health check: a replica whose engine cannot serve at all is replaced."""
        if self._engine.error:
            raise RuntimeError(self._engine.error)

    async def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            logger.info("engine %s shutting down", engine.config.engine_id)
            await engine.shutdown()
            if self._registry is not None:  # a scale-down (or the app's end): the id is gone, its aggregator goes
                await self._registry.release.remote(engine.config.engine_id, self._holder)
