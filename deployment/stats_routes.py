"""The statistics routes: /stats, /stats/stream, /stats/ranks, /kv_cache_stats and /metrics over the replica's
StatsMirror (deployment/mirror.py). Reading never removes a record and never reaches the engine."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from deployment.errors import APIError
from deployment.mirror import StatsMirror
from deployment.sse import SSE_EVENT, SSE_HEADERS
from deployment.sse import last_event_id as read_last_event_id

STATS_PAGE = 100  # records a /stats page holds by default (~0.5 MB): the whole buffer is ~46 MB
MAX_STATS_PAGE = 1000
# a stream's longest write interval: at a GPU's 100 records/s, 10 s is a mirror read's 1,000 records (~5 MB
# in one write); a reader that wants records less often than that should poll /stats
MAX_STREAM_INTERVAL_MS = 10_000
TRTLLM_LIMIT = 100  # records GET /trtllm/metrics returns by default
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LIST = {"content": {"application/json": {"schema": {"type": "array", "items": {"type": "object"}}}}}


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


def stats_router(stats: StatsMirror, world_size: int) -> APIRouter:
    router = APIRouter(tags=["statistics"])

    @router.get("/stats", responses={200: {
        "description": "a page of cluster records, oldest first; when more follow, `Link: <URL>; rel=\"next\"` "
        "names the next page (`since` = this page's last iter)", **_LIST}})
    async def get_stats(request: Request, since: int = Query(-1, ge=-1, description="records with iter > since"),
                        limit: int = Query(STATS_PAGE, ge=0, le=MAX_STATS_PAGE, description="records per page"),
                        ranks: bool = Query(False, description="include each rank's own record")) -> Response:
        body, after = await stats.page_json(since, limit, ranks)
        headers = {}
        if after is not None:
            headers["Link"] = f'<{request.url.include_query_params(since=after, limit=limit)}>; rel="next"'
        return Response(body, media_type="application/json", headers=headers)

    @router.get("/stats/stream", response_class=StreamingResponse, responses={200: {
        "description": "the records as Server-Sent Events (id: iteration); resume with Last-Event-ID; with "
        "interval_ms, the events of each interval arrive in one write",
        "content": {"text/event-stream": {"schema": SSE_EVENT}}}})
    async def stats_stream(request: Request, since: int | None = Query(None, ge=-1),
                           interval_ms: int = Query(0, ge=0, le=MAX_STREAM_INTERVAL_MS, description=(
                               "write the records of each interval_ms as one chunk (0: each as it comes)"))
                           ) -> Response:
        start = last_event_id(request, "an iteration number")
        if start is None:
            start = -1 if since is None else since
        elif start < -1:
            raise APIError(400, "Last-Event-ID must be >= -1", code="invalid_last_event_id", param="Last-Event-ID")
        return StreamingResponse(stats.events(start, interval_ms / 1000), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    @router.get("/stats/ranks")
    async def all_ranks() -> dict:
        return await stats.ranks()

    @router.get("/stats/ranks/{rank}", responses={404: {"description": "no such rank, or it has not reported"}})
    async def one_rank(rank: int) -> dict:
        if not 0 <= rank < world_size:
            raise APIError(404, f"unknown rank {rank}: this engine has ranks 0..{world_size - 1}",
                           code="unknown_rank", param="rank")
        found = (await stats.ranks()).get(str(rank))
        if found is None:
            raise APIError(404, f"rank {rank} has not reported yet", code="rank_not_reported", param="rank")
        return found

    @router.get("/trtllm/metrics", responses={200: {"description": "trtllm-serve's /metrics: iteration stats, "
                                                                  "a JSON list, oldest first", **_LIST}})
    async def trtllm_metrics(since: int | None = Query(None, ge=-1, description="records with iter > since"),
                             limit: int = Query(TRTLLM_LIMIT, ge=0, le=MAX_STATS_PAGE)) -> Response:
        return JSONResponse(await trtllm_records(stats, since, limit))

    @router.get("/kv_cache_stats")
    async def kv_cache_stats() -> dict:
        return await stats.kv_cache_stats()

    return router


def metrics_router(stats: StatsMirror) -> APIRouter:
    """/metrics alone: it takes the scrape key as well as the API keys (routes.py)."""
    router = APIRouter(tags=["statistics"])

    @router.get("/metrics", response_class=PlainTextResponse, responses={200: {
        "description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return PlainTextResponse(await stats.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    @router.get("/trtllm/prometheus/metrics", response_class=PlainTextResponse, responses={200: {
        "description": "/metrics at trtllm-serve's Prometheus path",
        "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def trtllm_prometheus() -> Response:
        return PlainTextResponse(await stats.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    return router
