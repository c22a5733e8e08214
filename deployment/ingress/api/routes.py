"""The HTTP API: one FastAPI app from the OpenAI router, the statistics router, the dashboard and /health.

`create_api(engine, stats, settings)` knows nothing about Ray Serve: the routes are tested with a fake engine
(implementing `EngineProtocol`) under plain uvicorn; `ingress/serve.py` plugs in the engine's handle and the fleet's
stats mirrors (one per engine; a lone StatsMirror is the fleet of `settings.engine_id`).
The OpenAPI document says what the app does: errors are OpenAI-shaped 4xx/5xx bodies (FastAPI's 422
never happens: validation errors are answered 400), and each route's real media type.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from deployment.ingress.api.auth import BEARER_SCHEME, KeyGuard, load_keys
from deployment.ingress.api.dashboard_routes import dashboard_router
from deployment.ingress.api.errors import ERROR_SCHEMA, ErrorResponse, clean_message, error_body, install_error_handlers
from deployment.ingress.api.generation import EngineProtocol, openai_router
from deployment.ingress.api.kv_events import kv_events_router
from deployment.ingress.api.stats_routes import metrics_router, stats_router
from deployment.ingress.stats.fleet import FleetStats
from deployment.ingress.stats.mirror import StatsMirror
from deployment.router.fleet_view import router_metrics
from deployment.settings import Settings

logger = logging.getLogger("kvfleet.deployment")

HEALTH_TIMEOUT_S = 5.0


def create_api(engine: EngineProtocol, stats: StatsMirror | FleetStats, settings: Settings) -> FastAPI:
    """The FastAPI app with every route of docs/http-api.md."""
    fleet = stats if isinstance(stats, FleetStats) else FleetStats({settings.engine_id: stats})
    api = FastAPI(title="kvfleet", version="0.1.0")
    install_error_handlers(api)
    api.state.stats = stats
    guard = KeyGuard(load_keys(settings.api_keys.get_secret_value()),
                     load_keys(settings.metrics_api_key.get_secret_value()))
    if guard:
        api.add_middleware(guard.wrap)  # outside the routes: no body is read before the key is checked
    api.include_router(openai_router(engine, settings))
    api.include_router(stats_router(fleet, settings.dp * settings.tp))
    follower = getattr(engine, "follower", None)
    api.include_router(metrics_router(fleet, follower and (lambda: router_metrics(follower.view))))
    api.include_router(dashboard_router())
    api.include_router(kv_events_router(engine))

    @api.get("/health", responses={503: {"description": "no dp group can serve, or the aggregator is down "
                                                        "(with several engines: no engine is up)"}})
    async def health() -> Response:
        if fleet.single is None:
            return await fleet_health(engine, fleet)
        stats = fleet.single
        try:
            eng, agg = await asyncio.wait_for(asyncio.gather(engine.health(), stats.health()), HEALTH_TIMEOUT_S)
        except Exception as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {clean_message(exc)}"
            logger.warning("health check failed: %s", reason)
            return ErrorResponse(error_body(f"unhealthy: {reason}", "service_unavailable", "unhealthy"),
                                 status_code=503)
        return JSONResponse({"status": "ok", "engine": dataclasses.asdict(eng), "aggregator": agg})

    api.openapi = lambda: _openapi(api, guard)
    return api


async def fleet_health(engine: EngineProtocol, fleet: FleetStats) -> Response:
    """Several engines: which are up (judged by each one's aggregator), and the engine replica that answered
    the handle's call; 200 while any engine is up."""
    async def answered() -> dict[str, Any]:
        try:
            return dataclasses.asdict(await asyncio.wait_for(engine.health(), HEALTH_TIMEOUT_S))
        except Exception as exc:
            return {"ok": False, "why": f"{type(exc).__name__}: {clean_message(exc)}"}
    eng, engines = await asyncio.gather(answered(), fleet.engines_health(HEALTH_TIMEOUT_S))
    up = [eid for eid, e in engines.items() if e["up"]]
    body = {"status": "ok" if up else "unhealthy", "engine": eng, "engines": engines,
            "engines_up": len(up), "subscribers": fleet.subscribers}
    if not up:
        logger.warning("health check failed: no engine is up")
        return ErrorResponse({**error_body("unhealthy: no engine is up", "service_unavailable", "unhealthy"),
                              "engines": engines}, status_code=503)
    return JSONResponse(body)


def _openapi(api: FastAPI, guard: KeyGuard) -> dict[str, Any]:
    """FastAPI's document with the error responses as they are: every error is the OpenAI error object, a
    request that fails validation is a 400 (not 422), any route may answer 500, and each keyed route states
    the bearer scheme and its 401."""
    if api.openapi_schema:
        return api.openapi_schema
    doc = get_openapi(title=api.title, version=api.version, routes=api.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["Error"] = ERROR_SCHEMA
    if guard:
        doc["components"]["securitySchemes"] = {"HTTPBearer": BEARER_SCHEME}
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, ops in doc["paths"].items():
        for op in ops.values():
            responses = op.setdefault("responses", {})
            if guard.check_for(path):
                op["security"] = [{"HTTPBearer": []}]
                responses.setdefault("401", {"description": "no API key, or a wrong one"})
            takes_input = responses.pop("422", None) is not None or "requestBody" in op
            if takes_input:
                responses.setdefault("400", {"description": "the request is invalid"})
            responses.setdefault("500", {"description": "an internal error"})
            for code, resp in responses.items():
                if code[0] in "45" and code != "499":
                    resp.update(error)
    api.openapi_schema = doc
    return doc
