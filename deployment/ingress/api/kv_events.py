"""`GET /kv_events`: the engine's KV block events as Server-Sent Events, in vLLM's KV event shape.

Each event is one `data:` JSON object (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, with `dp_rank` and
`medium`), its `id:` `<incarnation>-<seq>` (the engine's stream incarnation and sequence number). A client
reconnecting with a `Last-Event-ID` of the engine's current incarnation resumes without a gap while the engine
still buffers what it missed; otherwise (a first connect, another engine's id, a malformed one) it gets a
resync: per dp group an `AllBlocksCleared` with `"resync": true` and the blocks the engine's index holds.
The ids, the buffer and the snapshot live in the engine (engine/kv_stream.py); polling keeps its events on.
With several engine replicas a stream is one engine's: `?engine=<id>` (fleet_routing=kv, whose router can
address a replica).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse

from deployment.ingress.api.errors import APIError, engine_error
from deployment.ingress.sse import SSE_EVENT, SSE_HEADERS, format_comment, format_event, last_event_id
from engine.errors import EngineError, RequestError

ENGINE = Query(None, alias="engine", description="with several engines, the one whose stream this is")
POLL_S = 15.0  # one long poll of the engine; an idle stream sends a keepalive comment after each
logger = logging.getLogger("kvfleet.deployment")


def kv_events_router(engine: Any) -> APIRouter:
    router = APIRouter(tags=["statistics"])

    @router.get("/kv_events", response_class=StreamingResponse, responses={200: {
        "description": "KV events as Server-Sent Events (id: <incarnation>-<seq>); resume with Last-Event-ID",
        "content": {"text/event-stream": {"schema": SSE_EVENT}}}})
    async def kv_events(request: Request, engine_id: str | None = ENGINE) -> Response:
        engines = getattr(engine, "engines", [])
        if engine_id is not None and engines and engine_id not in engines:
            raise APIError(404, f"unknown engine {engine_id!r}: this fleet has {', '.join(engines)}",
                           code="unknown_engine", param="engine")
        start = last_event_id(request.headers)  # the engine answers any id it cannot resume with a resync
        poll = functools.partial(engine.kv_events, engine=engine_id) if engine_id is not None else engine.kv_events
        try:
            first = await poll(start, 0.0)  # errors (engine down, no engine named) answer here, before the stream
        except (RequestError, EngineError) as exc:
            raise engine_error(exc) from None
        return StreamingResponse(_stream(poll, start, first), media_type="text/event-stream", headers=SSE_HEADERS)

    return router


async def _stream(poll: Any, last: str | None, got: list) -> AsyncIterator[str]:
    while True:
        if got:
            last = got[-1][0]
            yield "".join(format_event(json.dumps(ev), id=eid, event="kv_event") for eid, ev in got)
        else:
            yield format_comment("keepalive")
        try:
            got = await poll(last, POLL_S)
        except Exception as exc:  # the engine's replica went away mid-stream: end it; the client resumes by id
            logger.warning("/kv_events: ending a stream at event %s, the engine did not answer (%s)", last,
                           type(exc).__name__)
            return
