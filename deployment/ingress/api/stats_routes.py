"""The statistics routes: /stats, /stats/stream, /stats/ranks, /kv_cache_stats and /metrics over the replica's
FleetStats (deployment/ingress/stats/fleet.py: one StatsMirror per engine). Reading never removes a record
and never reaches the engine. With one engine (or `?engine=<id>`) a route reads that engine's mirror, as it
always has; with several and no `engine`, the merged reads, whose positions are vectors (fleet.parse_cursor)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from deployment.ingress.api.errors import APIError
from deployment.ingress.sse import SSE_EVENT, SSE_HEADERS
from deployment.ingress.sse import last_event_id as read_last_event_id
from deployment.ingress.stats.fleet import CursorError, FleetStats, format_cursor, parse_cursor
from deployment.ingress.stats.mirror import StatsMirror

STATS_PAGE = 100  # records a /stats page holds by default (~0.5 MB): the whole buffer is ~46 MB
MAX_STATS_PAGE = 1000
# a stream's longest write interval: at a GPU's 100 records/s, 10 s is a mirror read's 1,000 records (~5 MB
# in one write); a reader that wants records less often than that should poll /stats
MAX_STREAM_INTERVAL_MS = 10_000
TRTLLM_LIMIT = 100  # records GET /trtllm/metrics returns by default
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LIST = {"content": {"application/json": {"schema": {"type": "array", "items": {"type": "object"}}}}}
ENGINE = Query(None, description="one engine's records only (its id, as in /health's `engines`)")
UNKNOWN_ENGINE = {404: {"description": "`engine` names no engine of this fleet"}}
SINCE_HELP = ("records with iter > since; with several engines and no `engine`, a vector "
              "`<engine id>:<iter>,...` (or -1)")


def pick(fleet: FleetStats, engine: str | None) -> StatsMirror | None:
    """The mirror a route reads: the named engine's (404 for another id), the only one's, or None (merged)."""
    if engine is not None:
        if engine not in fleet.mirrors:
            raise APIError(404, f"unknown engine {engine!r}: this fleet has {', '.join(fleet.ids)}",
                           code="unknown_engine", param="engine")
        return fleet.mirrors[engine]
    return fleet.single


def one_engine(fleet: FleetStats, engine: str | None, route: str) -> StatsMirror:
    """A route that reads one engine: with several, `engine` must name it."""
    mirror = pick(fleet, engine)
    if mirror is None:
        raise APIError(400, f"{route} reads one engine: name it with ?engine= (one of {', '.join(fleet.ids)})",
                       code="engine_required", param="engine")
    return mirror


def iteration(text: str | None, param: str, what: str = "an integer") -> int:
    """One engine's position (an iteration >= -1); `param` names the parameter in the 400."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise APIError(400, f"{param} must be {what}, got {text!r}", code="int_parsing", param=param) from None
    if value < -1:
        raise APIError(400, f"{param} must be >= -1", code="greater_than_equal", param=param)
    return value


def vector(fleet: FleetStats, text: str | None, param: str) -> dict[str, int]:
    try:
        return parse_cursor(text, fleet.ids)
    except CursorError as exc:
        raise APIError(400, f"{param}: {exc}", code="invalid_cursor", param=param) from None


def last_event_id(request: Request, what: str) -> int | None:
    """A stream's resume point from the `Last-Event-ID` header (None when absent or blank); `what` the id
    is, for the 400 a bad one gets."""
    header = read_last_event_id(request.headers)
    if header is None:
        return None
    try:
        return int(header)
    except ValueError:
        raise APIError(400, f"Last-Event-ID must be {what}, got {header!r}", code="invalid_last_event_id",
                       param="Last-Event-ID") from None


async def trtllm_records(stats: StatsMirror, since: int | None, limit: int) -> list[dict]:
    """The records as trtllm-serve's GET /metrics lists them (/trtllm is trtllm-serve's layout, for tools given a
    trtllm-serve base URL): without `since` the newest `limit`, with it the first `limit` after it (a cursor:
    pass the last `iter` back). Unlike trtllm-serve's, reading removes nothing."""
    if since is not None:
        return await stats.query(since, limit, False)
    recs = await stats.query(-1, None, False)
    return recs[len(recs) - limit:] if limit else []


def stats_router(stats: FleetStats, world_size: int) -> APIRouter:
    router = APIRouter(tags=["statistics"])

    @router.get("/stats", responses={**UNKNOWN_ENGINE, 200: {
        "description": "a page of cluster records, oldest first; when more follow, `Link: <URL>; rel=\"next\"` "
        "names the next page (`since` = this page's last iter, or with several engines its vector)", **_LIST}})
    async def get_stats(request: Request, since: str = Query("-1", description=SINCE_HELP),
                        limit: int = Query(STATS_PAGE, ge=0, le=MAX_STATS_PAGE, description="records per page"),
                        ranks: bool = Query(False, description="include each rank's own record"),
                        engine: str | None = ENGINE) -> Response:
        mirror = pick(stats, engine)
        if mirror is not None:
            body, after = await mirror.page_json(iteration(since, "since"), limit, ranks)
        elif ranks:
            raise APIError(400, "ranks=true reads one engine's aggregator: name it with ?engine=",
                           code="engine_required", param="engine")
        else:
            body, vec = await stats.page_json(vector(stats, since, "since"), limit)
            after = None if vec is None else format_cursor(vec)
        headers = {}
        if after is not None:
            headers["Link"] = f'<{request.url.include_query_params(since=after, limit=limit)}>; rel="next"'
        return Response(body, media_type="application/json", headers=headers)

    @router.get("/stats/stream", response_class=StreamingResponse, responses={**UNKNOWN_ENGINE, 200: {
        "description": "the records as Server-Sent Events (id: iteration, or with several engines the vector); "
        "resume with Last-Event-ID; with interval_ms, the events of each interval arrive in one write",
        "content": {"text/event-stream": {"schema": SSE_EVENT}}}})
    async def stats_stream(request: Request, since: str | None = Query(None, description=SINCE_HELP),
                           interval_ms: int = Query(0, ge=0, le=MAX_STREAM_INTERVAL_MS, description=(
                               "write the records of each interval_ms as one chunk (0: each as it comes)")),
                           engine: str | None = ENGINE) -> Response:
        mirror, header = pick(stats, engine), read_last_event_id(request.headers)
        if mirror is None:
            start = vector(stats, header, "Last-Event-ID") if header is not None else vector(stats, since, "since")
            events = stats.events(start, interval_ms / 1000)
        else:
            first = last_event_id(request, "an iteration number")
            if first is None:
                first = -1 if since is None else iteration(since, "since")
            elif first < -1:
                raise APIError(400, "Last-Event-ID must be >= -1", code="invalid_last_event_id",
                               param="Last-Event-ID")
            events = mirror.events(first, interval_ms / 1000)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)

    @router.get("/stats/ranks", responses=UNKNOWN_ENGINE)
    async def all_ranks(engine: str | None = ENGINE) -> dict:
        mirror = pick(stats, engine)
        return await (mirror.ranks() if mirror is not None else stats.ranks())

    @router.get("/stats/ranks/{rank}", responses={404: {
        "description": "no such rank or engine, or the rank has not reported"}})
    async def one_rank(rank: int, engine: str | None = ENGINE) -> dict:
        mirror = one_engine(stats, engine, "/stats/ranks/{rank}")
        if not 0 <= rank < world_size:
            raise APIError(404, f"unknown rank {rank}: this engine has ranks 0..{world_size - 1}",
                           code="unknown_rank", param="rank")
        found = (await mirror.ranks()).get(str(rank))
        if found is None:
            raise APIError(404, f"rank {rank} has not reported yet", code="rank_not_reported", param="rank")
        return found

    @router.get("/trtllm/metrics", responses={**UNKNOWN_ENGINE, 200: {
        "description": "trtllm-serve's /metrics: iteration stats, a JSON list, oldest first", **_LIST}})
    async def trtllm_metrics(since: int | None = Query(None, ge=-1, description="records with iter > since"),
                             limit: int = Query(TRTLLM_LIMIT, ge=0, le=MAX_STATS_PAGE),
                             engine: str | None = ENGINE) -> Response:
        return JSONResponse(await trtllm_records(one_engine(stats, engine, "/trtllm/metrics"), since, limit))

    @router.get("/kv_cache_stats", responses=UNKNOWN_ENGINE)
    async def kv_cache_stats(engine: str | None = ENGINE) -> dict:
        mirror = pick(stats, engine)
        return await (mirror.kv_cache_stats() if mirror is not None else stats.kv_cache_stats())

    return router


def metrics_router(fleet: FleetStats, extra: Callable[[], str] | None = None) -> APIRouter:
    """/metrics and its trtllm-serve path: they take the scrape key as well as the API keys (auth.py
    METRICS_ROUTES). With several engines, every engine's series labelled `engine`, plus the fleet totals
    (deployment/ingress/stats/fleet_metrics.py); `extra` adds this process's own (the kv router's)."""
    router = APIRouter(tags=["statistics"])
    stats = fleet.single or fleet

    async def text() -> str:
        return await stats.metrics_text() + (extra() if extra is not None else "")

    @router.get("/metrics", response_class=PlainTextResponse, responses={200: {
        "description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return PlainTextResponse(await text(), media_type=PROMETHEUS_CONTENT_TYPE)

    @router.get("/trtllm/prometheus/metrics", response_class=PlainTextResponse, responses={200: {
        "description": "/metrics at trtllm-serve's Prometheus path",
        "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def trtllm_prometheus() -> Response:
        return PlainTextResponse(await text(), media_type=PROMETHEUS_CONTENT_TYPE)

    return router
