"""The HTTP API of DESIGN.md as a FastAPI app over two collaborators: the engine and the stats source.

`create_api(engine, stats, settings)` knows nothing about Ray Serve, so the routes are tested with a fake
engine under plain uvicorn; `ingress.py` plugs in the real Engine and the aggregator actor. Every input is
checked here (model, prompt length, max_tokens, since/limit, rank) before the engine sees it.
"""

import asyncio
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from deployment import protocol
from deployment.detokenize import TextStream
from deployment.errors import APIError, ErrorResponse, clean_message, error_body, install_error_handlers
from deployment.mirror import StatsMirror
from deployment.settings import Settings
from workers.errors import EngineError, RequestError, RequestFailed

logger = logging.getLogger("kvfleet.deployment")

MAX_STATS_LIMIT = 10_000
HEALTH_TIMEOUT_S = 5.0
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def default_sampling_params(**kwargs: Any) -> Any:
    from workers.sampling import SamplingParams

    return SamplingParams(**kwargs)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _aclose(it: Any) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()


def _request_error(exc: Exception) -> APIError:
    message = getattr(exc, "message", None) or str(exc)
    return APIError(400, message, code=getattr(exc, "code", None) or "invalid_request")


def _engine_error(exc: Exception) -> APIError:
    """What a client sees of a failure past validation: one clean line, never a traceback."""
    if isinstance(exc, EngineError):
        return APIError(503, f"the engine cannot serve: {clean_message(str(exc))}", code="engine_unavailable")
    if isinstance(exc, RequestFailed):
        return APIError(500, clean_message(str(exc)), code="request_failed")
    return APIError(500, f"generation failed: {type(exc).__name__}", code="internal_error")


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone away (only a disconnect can follow a fully read request body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Usage:
    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0

    def as_dict(self) -> dict[str, int]:
        return protocol.usage(self.prompt_tokens, self.completion_tokens)


def create_api(engine: Any, stats: StatsMirror, settings: Settings,
               make_params: Callable[..., Any] = default_sampling_params,
               request_errors: tuple[type[BaseException], ...] | None = None) -> FastAPI:
    """The FastAPI app with every route of DESIGN.md.

    `request_errors`: the engine's exception types that mean "bad request" (400); default the Engine's
    `RequestError`.
    """
    api = FastAPI(title="kvfleet", version="0.1.0")
    install_error_handlers(api)
    model_name = settings.served_model_name
    world_size = settings.dp * settings.tp
    created = int(time.time())
    api.state.stats = stats
    if request_errors is None:
        request_errors = (RequestError,)

    # ---- generation ----

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model '{name}' does not exist; this server serves '{model_name}'",
                           code="model_not_found", param="model")

    async def prepare(req: protocol._SamplingRequest, prompt_ids: list[int]) -> tuple[Any, int]:
        n_prompt, limit = len(prompt_ids), engine.max_model_len
        if n_prompt >= limit:
            raise APIError(400, f"prompt is {n_prompt} tokens; this model allows at most {limit - 1} prompt "
                           f"tokens (its maximum context length {limit} includes the completion)",
                           code="context_length_exceeded", param="prompt")
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(settings.max_tokens_default, limit - n_prompt)
        elif n_prompt + max_tokens > limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens; you requested "
                           f"{n_prompt + max_tokens} ({n_prompt} in the prompt, {max_tokens} for the "
                           "completion)",
                           code="context_length_exceeded", param="max_tokens")
        try:
            params = make_params(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                 top_k=max(req.top_k, 0), seed=req.seed)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_sampling_params") from None
        try:
            await _maybe_await(engine.validate(prompt_ids, params))
        except request_errors as exc:
            raise _request_error(exc) from None
        return params, max_tokens

    def encode_prompt(prompt: str | list[int]) -> list[int]:
        try:
            ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        except ValueError as exc:
            raise APIError(400, f"prompt: {exc}", code="invalid_prompt", param="prompt") from None
        if not ids:
            raise APIError(400, "prompt encodes to no tokens", code="invalid_prompt", param="prompt")
        vocab = getattr(engine, "vocab_size", None) or getattr(engine.tokenizer, "vocab_size", None)
        if vocab and max(ids) >= vocab:
            raise APIError(400, f"token id {max(ids)} is outside the vocabulary (ids 0..{vocab - 1})",
                           code="invalid_token_id", param="prompt")
        return ids

    def encode_chat(req: protocol.ChatCompletionRequest) -> list[int]:
        tok = engine.tokenizer
        try:  # encode_chat does not double a BOS that the model's template already writes
            ids = (tok.encode_chat(req.chat_messages()) if hasattr(tok, "encode_chat")
                   else tok.encode(tok.apply_chat_template(req.chat_messages())))
        except ValueError as exc:  # the model's template refused these messages (e.g. roles out of order)
            raise APIError(400, f"chat template: {exc}", code="invalid_messages", param="messages") from None
        return encode_prompt(ids)

    async def run(request_id: str, ids: list[int], params: Any, stop: list[str],
                  usage: "Usage") -> AsyncIterator[tuple[str, str | None]]:
        """Yields (text delta, None) while generating and ends with one (final delta, finish_reason)."""
        text = TextStream(engine.tokenizer.detokenizer(), stop)
        tok = engine.tokenizer
        eos = set(getattr(tok, "eos_token_ids", ()) or (getattr(tok, "eos_token_id", None),))
        events = engine.generate(request_id, ids, params)
        finish: str | None = None
        pending = ""
        try:
            async for ev in events:
                usage.completion_tokens += 1
                finish = ev.finish_reason
                if finish == "stop" and ev.token_id in eos:
                    break
                delta = text.add(ev.token_id)
                if text.stopped:
                    finish = "stop"
                if finish is not None:
                    pending = delta
                    break
                if delta:
                    yield delta, None
        finally:
            await _aclose(events)  # leaving early (stop string, disconnect) aborts the engine's request
        if finish is None:
            raise RuntimeError(f"engine ended request {request_id} without a finish reason")
        yield pending + text.finish(), finish

    async def collect(gen: AsyncIterator[tuple[str, str | None]]) -> tuple[str, str]:
        parts, finish = [], "length"
        try:
            async for delta, reason in gen:
                parts.append(delta)
                finish = reason or finish
        except request_errors as exc:
            raise _request_error(exc) from None
        except Exception as exc:
            if not isinstance(exc, EngineError | RequestFailed):
                logger.exception("generation failed")
            raise _engine_error(exc) from None
        return "".join(parts), finish

    async def respond(request: Request, gen: AsyncIterator[tuple[str, str | None]],
                      build: Callable[[str, str], dict]) -> Response:
        """A non-streamed answer; a client that leaves first aborts the engine's request (as a stream does)."""
        work = asyncio.ensure_future(collect(gen))
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()  # closes `gen`, whose finally aborts the engine's request
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody is there to read it
        text, finish = work.result()
        return JSONResponse(build(text, finish))

    def sse_json(obj: dict) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    async def stream_body(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as exc:  # the response has started: report in-band, as OpenAI does
            if isinstance(exc, request_errors):
                err = _request_error(exc)
            else:
                if not isinstance(exc, EngineError | RequestFailed):
                    logger.exception("generation failed mid-stream")
                err = _engine_error(exc)
            yield sse_json(error_body(err.message, err.type, err.code))
        yield "data: [DONE]\n\n"

    @api.post("/v1/completions")
    async def completions(req: protocol.CompletionRequest, request: Request) -> Response:
        check_model(req.model)
        ids = encode_prompt(req.prompt)
        params, _ = await prepare(req, ids)
        rid, model = protocol.new_id("cmpl"), model_name
        use = Usage(len(ids))
        gen = run(rid, ids, params, req.stop_strings, use)
        if not req.stream:
            return await respond(request, gen, lambda text, finish: protocol.completion_response(
                rid, model, text, finish, use.as_dict()))

        async def chunks() -> AsyncIterator[str]:
            async for delta, finish in gen:
                if delta or finish:
                    yield sse_json(protocol.completion_chunk(rid, model, created, delta, finish))
            if req.include_usage:
                yield sse_json(protocol.usage_chunk(rid, model, created, "text_completion", use.as_dict()))

        return StreamingResponse(stream_body(chunks()), media_type="text/event-stream", headers=SSE_HEADERS)

    @api.post("/v1/chat/completions")
    async def chat_completions(req: protocol.ChatCompletionRequest, request: Request) -> Response:
        check_model(req.model)
        ids = encode_chat(req)
        params, _ = await prepare(req, ids)
        rid, model = protocol.new_id("chatcmpl"), model_name
        use = Usage(len(ids))
        gen = run(rid, ids, params, req.stop_strings, use)
        if not req.stream:
            return await respond(request, gen, lambda text, finish: protocol.chat_response(
                rid, model, text, finish, use.as_dict()))

        async def chunks() -> AsyncIterator[str]:
            first = {"role": "assistant", "content": ""}
            yield sse_json(protocol.chat_chunk(rid, model, created, first, None))
            async for delta, finish in gen:
                if delta:
                    yield sse_json(protocol.chat_chunk(rid, model, created, {"content": delta}, None))
                if finish:
                    yield sse_json(protocol.chat_chunk(rid, model, created, {}, finish))
            if req.include_usage:
                obj = "chat.completion.chunk"
                yield sse_json(protocol.usage_chunk(rid, model, created, obj, use.as_dict()))

        return StreamingResponse(stream_body(chunks()), media_type="text/event-stream", headers=SSE_HEADERS)

    @api.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kvfleet", "max_model_len": engine.max_model_len}]}

    # ---- statistics ----

    @api.get("/stats")
    async def get_stats(since: int = Query(-1, ge=-1, description="records with iter > since"),
                        limit: int | None = Query(None, ge=0, le=MAX_STATS_LIMIT),
                        ranks: bool = Query(False, description="include each rank's own record")) -> Response:
        if ranks:
            return JSONResponse(await stats.query(since, limit, True))
        return Response(await stats.query_json(since, limit), media_type="application/json")

    @api.get("/stats/stream")
    async def stats_stream(request: Request, since: int | None = Query(None, ge=-1)) -> Response:
        start = -1 if since is None else since
        header = request.headers.get("last-event-id")
        if header is not None and header.strip():
            try:
                start = int(header)
            except ValueError:
                raise APIError(400, f"Last-Event-ID must be an iteration number, got {header!r}",
                               code="invalid_last_event_id", param="Last-Event-ID") from None
            if start < -1:
                raise APIError(400, "Last-Event-ID must be >= -1", code="invalid_last_event_id",
                               param="Last-Event-ID")
        return StreamingResponse(stats.events(start), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    @api.get("/stats/ranks")
    async def all_ranks() -> dict:
        return await stats.ranks()

    @api.get("/stats/ranks/{rank}")
    async def one_rank(rank: int) -> dict:
        if not 0 <= rank < world_size:
            raise APIError(404, f"unknown rank {rank}: this engine has ranks 0..{world_size - 1}",
                           code="unknown_rank", param="rank")
        found = (await stats.ranks()).get(str(rank))
        if found is None:
            raise APIError(404, f"rank {rank} has not reported yet", code="rank_not_reported", param="rank")
        return found

    @api.get("/kv_cache_stats")
    async def kv_cache_stats() -> dict:
        return await stats.kv_cache_stats()

    @api.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(await stats.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    @api.get("/health")
    async def health() -> Response:
        try:
            eng, agg = await asyncio.wait_for(
                asyncio.gather(_maybe_await(engine.health()), stats.health()), HEALTH_TIMEOUT_S)
        except Exception as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {clean_message(exc)}"
            logger.warning("health check failed: %s", reason)
            return ErrorResponse(error_body(f"unhealthy: {reason}", "service_unavailable", "unhealthy"),
                                 status_code=503)
        return JSONResponse({"status": "ok", "engine": eng, "aggregator": agg})

    return api
