"""cache_salt on completions and chat, and GET /kv_events over the engine's event stream (fake engine, no Ray)."""


import httpx

from engine.kv_stream import KVEventStream
from kvcache.events import STORED, KVEvent
from tests.support.http_support import _assert_openai_error, read_events


def _events(resp, n: int) -> list[tuple[str, dict]]:
    return read_events(resp, n, "kv_event")


def test_cache_salt_reaches_the_engine_on_completions_and_chat(server, http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "cache_salt": "tenant-a"})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                "cache_salt": "tenant-b"})
    assert r.status_code == 200, r.text
    assert server.engine.salts[-2:] == ["tenant-a", "tenant-b"]
    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert server.engine.salts[-1] is None
    _assert_openai_error(http.post("/v1/completions", json={"prompt": "hi", "cache_salt": ""}), 400)
    _assert_openai_error(http.post("/v1/completions", json={"prompt": "hi", "cache_salt": 5}), 400)


def test_kv_events_resync_then_resume_without_a_gap(server):
    stream = server.engine.kv_stream
    eid = f"{stream.incarnation}-{{}}".format
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("GET", "/kv_events") as resp:  # a new client: the index's snapshot first
            assert resp.headers["content-type"].startswith("text/event-stream")
            snap = _events(resp, 3)
        assert [e["type"] for _, e in snap] == ["AllBlocksCleared", "BlockStored", "AllBlocksCleared"]
        assert snap[0][1]["resync"] and snap[1][1]["block_hashes"] == [7] and snap[1][1]["medium"] == "GPU"
        start = stream.seq
        assert snap[-1][0] == eid(start)
        stream.publish(1, [KVEvent(STORED, k, None, tuple(range(16)), 0) for k in (21, 22, 23)])
        with c.stream("GET", "/kv_events", headers={"Last-Event-ID": eid(start + 1)}) as resp:
            rest = _events(resp, 2)
        assert [i for i, _ in rest] == [eid(start + 2), eid(start + 3)]  # exactly what came after the id it had
        assert [e["block_hashes"] for _, e in rest] == [[22], [23]] and rest[0][1]["dp_rank"] == 1
        assert rest[0][1]["token_ids"] == list(range(16)) and rest[0][1]["block_size"] == 16
        stream.publish(1, [KVEvent(STORED, k) for k in range(30, 36)])  # the buffer keeps 4: start+2.. are gone
        with c.stream("GET", "/kv_events", headers={"Last-Event-ID": eid(start + 2)}) as resp:
            again = _events(resp, 1)
        assert again[0][1]["type"] == "AllBlocksCleared" and again[0][1]["resync"]


def test_an_id_from_a_replaced_engine_resyncs_even_once_the_new_one_passed_it(server):
    """An engine replica restarts with a new stream: a client's Last-Event-ID from the old one must not
    resume "exactly" in the new id space (it would miss the new engine's first events, keep the old blocks)."""
    old = server.engine.kv_stream
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("GET", "/kv_events") as resp:
            last = _events(resp, 3)[-1][0]
        old.publish(0, [KVEvent(STORED, k) for k in (100, 101)])
        with c.stream("GET", "/kv_events", headers={"Last-Event-ID": last}) as resp:
            last = _events(resp, 2)[-1][0]  # followed the old engine up to here
        server.engine.kv_stream = new = KVEventStream(4, 16, old.index, buffer_always=True)
        try:
            new.publish(0, [KVEvent(STORED, k) for k in range(200, 200 + old.seq + 2)])  # past the old ids
            with c.stream("GET", "/kv_events", headers={"Last-Event-ID": last}) as resp:
                got = _events(resp, 1)
        finally:
            server.engine.kv_stream = old
    assert got[0][1]["type"] == "AllBlocksCleared" and got[0][1]["resync"]


def test_kv_events_resyncs_an_id_it_cannot_resume_from(server):
    """Another engine's id (a replaced replica's), an integer id, garbage, or this incarnation's with a seq of
    5,000 digits (past what int() converts): a resync, as for a new client."""
    stream = server.engine.kv_stream
    stream.publish(0, [KVEvent(STORED, 40)])
    with httpx.Client(base_url=server.url, timeout=10) as c:
        for stale in ("0123456789ab-1", str(stream.seq - 1), "seven", f"{stream.incarnation}-{'9' * 5000}"):
            with c.stream("GET", "/kv_events", headers={"Last-Event-ID": stale}) as resp:
                assert resp.status_code == 200
                got = _events(resp, 1)
            assert got[0][1]["type"] == "AllBlocksCleared" and got[0][1]["resync"]
            assert got[0][0] == f"{stream.incarnation}-{stream.seq}"


def test_a_stream_whose_engine_goes_away_ends_cleanly_at_its_last_event():
    import asyncio

    from deployment.ingress.api.kv_events import _stream

    class Gone:
        async def kv_events(self, after, timeout_s):
            raise ConnectionError("the engine replica is being replaced")

    async def read() -> list[str]:
        return [chunk async for chunk in _stream(Gone().kv_events, None, [("a1-7", {"type": "AllBlocksCleared"})])]

    chunks = asyncio.run(read())  # ends instead of raising into the server (a traceback and a cut connection)
    assert len(chunks) == 1 and "id: a1-7" in chunks[0]


def test_an_engine_that_cannot_answer_is_a_status_before_the_stream():
    """A refusal before the stream is its HTTP status (several engines and none named: 400; the named one has no
    replica up: 503 + Retry-After; a name that is no engine: 404), never a 500."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from deployment.ingress.api.errors import install_error_handlers
    from deployment.ingress.api.kv_events import kv_events_router
    from engine.errors import EngineError, RequestError

    class Fleet:
        engines = ["e-0", "e-1"]

        async def kv_events(self, after, timeout_s, engine=None):
            if engine is None:
                raise RequestError("name one with ?engine=", "engine_required")
            raise EngineError(f"engine {engine!r} has no replica up now", 2.0)

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(kv_events_router(Fleet()))
    with TestClient(app) as client:
        r = client.get("/kv_events")
        assert (r.status_code, r.json()["error"]["code"]) == (400, "engine_required")
        r = client.get("/kv_events", params={"engine": "e-1"})
        assert (r.status_code, r.headers["retry-after"]) == (503, "2")
        assert client.get("/kv_events", params={"engine": "e-9"}).status_code == 404
