"""The Ray Serve application: one ingress replica that owns the Engine and serves `routes.create_api`.

The engine (and through it the rank actors and the stats aggregator) lives in this replica, so there is
exactly one replica. It reserves no CPU: the rank actors reserve theirs (dp * tp * num_cpus_per_rank), and
the defaults must fit a 2-core laptop, where `serve run deployment:app` gives Ray exactly 2 CPUs. The FastAPI app is
built after the engine has started (`__serve_build_asgi_app__`), so the routes close over a live engine.
"""

import logging
from typing import Any

from fastapi import FastAPI
from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from deployment.routes import create_api
from deployment.settings import Settings

logger = logging.getLogger("kvfleet.deployment")

INGRESS_NUM_CPUS = 0
# /stats pollers and /stats/stream subscribers are long-lived: Serve's default (5) would queue them.
MAX_ONGOING_REQUESTS = 1000


class ActorStats:
    """routes.StatsSource over the StatsAggregator actor handle."""

    def __init__(self, handle: Any) -> None:
        self._h = handle

    async def query(self, since: int, limit: int | None, ranks: bool) -> list[dict]:
        return await self._h.query.remote(since=since, limit=limit, ranks=ranks)

    async def wait_records(self, since: int, timeout_s: float) -> list[dict]:
        return await self._h.wait_records.remote(since, timeout_s=timeout_s)

    async def ranks(self) -> dict:
        return await self._h.ranks.remote()

    async def kv_cache_stats(self) -> dict:
        return await self._h.kv_cache_stats.remote()

    async def metrics_text(self) -> str:
        return await self._h.metrics_text.remote()

    async def health(self) -> dict:
        return await self._h.health.remote()


@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    ray_actor_options={"num_cpus": INGRESS_NUM_CPUS},
    max_constructor_retry_count=3,
    graceful_shutdown_timeout_s=30,
)
@serve.ingress()
class KVFleetIngress:
    async def __init__(self, settings: Settings) -> None:
        from workers.engine import Engine  # imported here: importing `deployment` must stay light

        self._settings = settings
        self._engine = Engine(settings)
        try:
            await self._engine.start()
        except BaseException:
            logger.exception("engine %s failed to start", settings.engine_id)
            await self._engine.shutdown()
            raise
        self._stats = ActorStats(self._engine.aggregator)
        logger.info("engine %s started: dp=%d tp=%d model=%s", settings.engine_id, settings.dp, settings.tp,
                    settings.model or "built-in")

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_api(self._engine, self._stats, self._settings)

    async def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            logger.info("engine %s shutting down", self._settings.engine_id)
            await engine.shutdown()


def parse_settings(args: dict[str, Any] | None) -> Settings:
    """Settings from builder args (`key=value` on the command line, or a Serve config's `args:`) + env."""
    given = {str(k).strip().lower().replace("-", "_"): v for k, v in (args or {}).items()}
    try:
        return Settings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        known = ", ".join(Settings.model_fields)
        raise ValueError(f"invalid kvfleet settings: {problems} (known settings: {known})") from None


def build_app(args: dict[str, Any] | None = None) -> Application:
    """`serve run deployment:build_app tp=2 ...` and Serve configs' `args:` land here."""
    return KVFleetIngress.bind(parse_settings(args))
