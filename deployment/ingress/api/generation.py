"""The OpenAI routes: /v1/completions, /v1/chat/completions and /v1/models over an `EngineProtocol`.

Completions and chat share one path (`_Generation.respond`): tokenize, validate with the engine's own rules,
stream token events, detokenize with stop strings, and answer as one JSON body or as SSE chunks. A client that
goes away aborts the engine's request, streamed or not. The engine decides what a valid request is (prompt
length, vocabulary); this module only maps its errors to HTTP.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Literal, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployment.ingress import resume
from deployment.ingress.api import protocol
from deployment.ingress.api.detokenize import TextStream
from deployment.ingress.api.errors import APIError, engine_error, error_body
from deployment.ingress.resend import with_seed
from deployment.ingress.sse import SSE_EVENT, SSE_HEADERS, format_comment, format_event, last_event_id
from deployment.settings import Settings
from engine.errors import RequestError
from engine.messages import Admitted, EngineHealth

logger = logging.getLogger("kvfleet.deployment")

RESUME_COMMENT_S = 1.0  # while a resumed stream makes again what the client has: one comment a second



class EngineProtocol(Protocol):
    """What the routes need of the engine: the in-process Engine, the ingress's EngineClient, test fakes."""

    tokenizer: Any
    max_model_len: int
    max_seq_len: int
    vocab_size: int

    async def validate(self, prompt_token_ids: list[int], params: Any) -> None: ...
    def generate(self, request_id: str | None, prompt_token_ids: list[int], params: Any,
                 cache_salt: str | None = None) -> AsyncGenerator[Any, None]:
        """Token events; an engine behind a handle yields `ADMITTED` first, once it has admitted the request."""
    async def health(self) -> EngineHealth: ...


async def _admitted(events: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """The events once the engine has admitted the request (its first event), so that a refusal (overload,
    no dp group up) is answered with its HTTP status and Retry-After, not as an error inside a 200 stream."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    except Exception as exc:
        await events.aclose()
        raise engine_error(exc) from None
    # the engine's marker: its tokens follow in `events` itself, with no generator between (per token); a stream
    # that ended before any event is empty
    return events if first is None or isinstance(first, Admitted) else _chain(first, events)


async def _chain(first: Any, events: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    """`first` then `events`, for an engine whose first event is already a token (the tests' fake engine)."""
    try:
        yield first
        async for ev in events:
            yield ev
    finally:
        await events.aclose()  # leaving early (stop string, disconnect) aborts the engine's request


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone away (only a disconnect can follow a fully read request body)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Generation:
    def __init__(self, engine: EngineProtocol, settings: Settings) -> None:
        self.engine = engine
        self.settings = settings
        self.model = settings.served_model_name
        self.created = int(time.time())  # the model's, for /v1/models; a response's is its request's

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise APIError(404, f"model '{name}' does not exist; this server serves '{self.model}'",
                           code="model_not_found", param="model")

    def _prompt_ids(self, req: protocol.CompletionRequest | protocol.ChatCompletionRequest) -> list[int]:
        tok = self.engine.tokenizer
        if isinstance(req, protocol.ChatCompletionRequest):
            try:  # encode_chat does not double a BOS that the model's template already writes
                return tok.encode_chat(req.chat_messages())
            except ValueError as exc:  # the template refused these messages (e.g. roles out of order)
                raise APIError(400, f"chat template: {exc}", code="invalid_messages", param="messages") from None
        if not isinstance(req.prompt, str):
            return list(req.prompt)
        try:
            return tok.encode(req.prompt)
        except ValueError as exc:
            raise APIError(400, f"prompt: {exc}", code="invalid_prompt", param="prompt") from None

    async def _params(self, req: protocol.SamplingRequest, ids: list[int]) -> Any:
        from workers.sampling_params import SamplingParams  # torch: only where a request is served

        max_tokens = req.max_tokens
        if max_tokens is None:  # the server default, cut to what the context has left (the engine checks)
            max_tokens = max(1, min(self.settings.max_tokens_default, self.engine.max_model_len - len(ids)))
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    top_k=max(req.top_k, 0), seed=req.seed, ignore_eos=req.ignore_eos,
                                    stop_token_ids=tuple(req.stop_token_ids or ()),
                                    repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                                    frequency_penalty=req.frequency_penalty, min_p=req.min_p,
                                    min_tokens=req.min_tokens)
        except ValueError as exc:  # SamplingParams' messages start with the field's name
            raise APIError(400, str(exc), code="invalid_sampling_params", param=str(exc).split()[0]) from None
        try:
            await self.engine.validate(ids, params)
        except RequestError as exc:
            raise engine_error(exc) from None
        return params

    async def _text(self, rid: str, events: AsyncGenerator[Any, None], stop: list[str], params: Any,
                    usage: list[int]) -> AsyncIterator[tuple[str, str | None]]:
        """Yields (text delta, None) while generating, the first time at the first token even when its text is
        held back (a stream's first chunk goes out with the first token, as vLLM's), and ends with one (final
        delta, finish_reason)."""
        tok = self.engine.tokenizer
        text = TextStream(tok.detokenizer(), stop, params.min_tokens)
        stop_ids = set(tok.eos_token_ids) | set(params.stop_token_ids)  # their text is not returned, as vLLM
        finish: str | None = None
        pending = ""
        try:
            async for ev in events:
                usage[1] += 1
                finish = ev.finish_reason
                if finish == "stop" and ev.token_id in stop_ids:
                    break
                delta = text.add(ev.token_id)
                if text.stopped:
                    finish = "stop"
                if finish is not None:
                    pending = delta
                    break
                if delta or usage[1] == 1:
                    yield delta, None
        finally:
            await events.aclose()  # leaving early (stop string, disconnect) aborts the engine's request
        if finish is None:
            raise RuntimeError(f"engine ended request {rid} without a finish reason")
        yield pending + text.finish(), finish

    async def respond(self, request: Request, req: protocol.CompletionRequest | protocol.ChatCompletionRequest,
                      kind: Literal["text_completion", "chat.completion"]) -> Response:
        self._check_model(req.model)
        ids = self._prompt_ids(req)
        params = await self._params(req, ids)
        rid = protocol.new_id("cmpl" if kind == "text_completion" else "chatcmpl")
        created = int(time.time())
        pos = self._position(request, req, kind, ids, params, rid, created)
        usage = [len(ids), 0]  # prompt, completion tokens
        engine_rid = rid  # a resumed stream is a new request to the engine (the first may still be running there)
        if pos is not None:  # the response's id and created are the first response's
            params, rid, created = dataclasses.replace(params, seed=pos.seed), pos.rid, pos.created
        events = await _admitted(self.engine.generate(engine_rid, ids, params, req.cache_salt))
        text = self._text(engine_rid, events, req.stop_strings, params, usage)
        if req.stream:
            chunks = self._chunks(kind, rid, created, text, usage, req.include_usage, req.continuous_usage)
            sse = _sse_events(chunks) if pos is None else _numbered(chunks, pos)
            return StreamingResponse(_in_band_errors(sse), media_type="text/event-stream", headers=SSE_HEADERS)
        build = protocol.completion_response if kind == "text_completion" else protocol.chat_response
        return await _unless_disconnected(request, _collect(text), lambda t, f: build(
            rid, self.model, t, f, protocol.usage(*usage), created))

    @staticmethod
    def _position(request: Request, req: protocol.CompletionRequest | protocol.ChatCompletionRequest, kind: str,
                  ids: list[int], params: Any, rid: str, created: int) -> resume.StreamPosition | None:
        """A resumable stream's position (its seed picked here, so its event ids can name it), or the one a
        `Last-Event-ID` resumes (deployment/ingress/resume.py); None for other requests."""
        cut = last_event_id(request.headers)
        if not req.resumable:
            if cut is not None:
                raise APIError(400, "Last-Event-ID resumes a resumable stream: send it with stream=true and "
                               "stream_options.resumable=true", code="invalid_last_event_id", param="Last-Event-ID")
            return None
        extra = (tuple(req.stop_strings), req.include_usage, req.continuous_usage)
        if cut is None:
            params = with_seed(params)
            return resume.StreamPosition(rid, created, params.seed, resume.request_digest(kind, ids, params, extra))
        pos = resume.parse(cut, kind)
        if resume.request_digest(kind, ids, resume.resumed_params(pos, params), extra) != pos.digest:
            raise APIError(400, "Last-Event-ID names a stream of another request: resume with its body unchanged",
                           code="invalid_last_event_id", param="Last-Event-ID")
        return pos

    async def _chunks(self, kind: str, rid: str, created: int, text: AsyncIterator[tuple[str, str | None]],
                      usage: list[int], include_usage: bool, continuous: bool = False) -> AsyncIterator[dict]:
        """The stream's chunks; `continuous` (vLLM's continuous_usage_stats): each with the usage so far."""
        async for chunk in self._content_chunks(kind, rid, created, text, usage, include_usage):
            if continuous and "usage" not in chunk:
                chunk["usage"] = protocol.usage(*usage)
            yield chunk

    async def _content_chunks(self, kind: str, rid: str, created: int, text: AsyncIterator[tuple[str, str | None]],
                              usage: list[int], include_usage: bool) -> AsyncIterator[dict]:
        m = self.model
        role = kind == "chat.completion"
        async for delta, finish in text:
            if role:  # with the first token, not at admission: what TTFT clients time is the first chunk
                role = False
                yield protocol.chat_chunk(rid, m, created, {"role": "assistant", "content": ""}, None)
            if kind == "text_completion":
                if delta or finish:
                    yield protocol.completion_chunk(rid, m, created, delta, finish)
                continue
            if delta:
                yield protocol.chat_chunk(rid, m, created, {"content": delta}, None)
            if finish:
                yield protocol.chat_chunk(rid, m, created, {}, finish)
        if include_usage:
            obj = "text_completion" if kind == "text_completion" else "chat.completion.chunk"
            yield protocol.usage_chunk(rid, m, created, obj, protocol.usage(*usage))


async def _sse_events(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield _sse(chunk)


async def _numbered(chunks: AsyncIterator[dict], pos: resume.StreamPosition) -> AsyncIterator[str]:
    """The chunks as SSE events with their ids; a resumed stream sends only those after the client's last. The
    chunks before it are made again, not sent: the same tokens make the same chunks, which the hash checks.
    Meanwhile a comment a second keeps proxies and the client's read timeout from taking the quiet for a dead
    stream (a resume that is cut again for that would start over, and never get anywhere)."""
    n, sent, said = -1, "", time.monotonic()
    async for chunk in chunks:
        n += 1
        data = json.dumps(chunk, separators=(",", ":"))
        sent = resume.running_hash(sent, data)
        if n == pos.chunk and sent != pos.sent:
            raise _diverged(pos)
        if n > pos.chunk:
            yield format_event(data, id=pos.event_id(n, sent))
        elif time.monotonic() - said >= RESUME_COMMENT_S:
            said = time.monotonic()
            yield format_comment(f"resuming: chunk {n} of {pos.chunk} made again")
    if n < pos.chunk:  # fewer chunks this time than the client has read
        raise _diverged(pos)


def _diverged(pos: resume.StreamPosition) -> APIError:
    return APIError(500, f"stream {pos.rid} made other chunks this time than the client read: it cannot be "
                    "resumed; send the request again without Last-Event-ID", code="stream_diverged")


async def _collect(text: AsyncIterator[tuple[str, str | None]]) -> tuple[str, str]:
    parts, finish = [], "length"
    try:
        async for delta, reason in text:
            parts.append(delta)
            finish = reason or finish
    except Exception as exc:
        raise engine_error(exc) from None
    return "".join(parts), finish


async def _unless_disconnected(request: Request, work_coro: Any, build: Callable[[str, str], dict]) -> Response:
    """A non-streamed answer; a client that leaves first aborts the engine's request (as a stream does)."""
    work = asyncio.ensure_future(work_coro)
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # closes the token stream, whose finally aborts the engine's request
    if not work.done() or work.cancelled():
        return Response(status_code=499)  # nobody is there to read it
    text, finish = work.result()
    return JSONResponse(build(text, finish))


async def _in_band_errors(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # the response has started: report in-band, as OpenAI does
        err = engine_error(exc)
        yield _sse(error_body(err.message, err.type, err.code))
    yield "data: [DONE]\n\n"


def openai_router(engine: EngineProtocol, settings: Settings) -> APIRouter:
    gen = _Generation(engine, settings)
    router = APIRouter(tags=["openai"])

    @router.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(req: protocol.CompletionRequest, request: Request) -> Response:
        return await gen.respond(request, req, "text_completion")

    @router.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(req: protocol.ChatCompletionRequest, request: Request) -> Response:
        return await gen.respond(request, req, "chat.completion")

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": gen.model, "object": "model", "created": gen.created,
                                            "owned_by": "kvfleet", "max_model_len": engine.max_model_len}]}

    return router


_JSON_OR_SSE = {"application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": SSE_EVENT}}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "the completion (JSON), or its chunks as Server-Sent Events with stream=true",
          "content": _JSON_OR_SSE},
    404: {"description": "the model is not the served one"},
    429: {"description": "the engine's waiting queue is full; retry after Retry-After seconds"},
    499: {"description": "the client went away before the answer (nothing is sent)"},
    500: {"description": "the request failed on its ranks"},
    503: {"description": "the engine cannot serve now (no dp group up, or restarting); retry after Retry-After"},
}
