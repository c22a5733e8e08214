"""cache_salt on completions and chat, and GET /kv_events over the engine's event stream (fake engine, no Ray)."""

import json

import httpx

from deployment.sse import SSEDecoder
from kvcache.events import STORED, KVEvent
from tests.http_support import _assert_openai_error


def _events(resp, n: int) -> list[tuple[int, dict]]:
    dec, out = SSEDecoder(), []
    for line in resp.iter_lines():
        ev = dec.feed(line)
        if ev is not None:
            assert ev.event == "kv_event"
            out.append((int(ev.id), json.loads(ev.data)))
            if len(out) == n:
                break
    return out


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
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("GET", "/kv_events") as resp:  # a new client: the index's snapshot first
            assert resp.headers["content-type"].startswith("text/event-stream")
            snap = _events(resp, 3)
        assert [e["type"] for _, e in snap] == ["AllBlocksCleared", "BlockStored", "AllBlocksCleared"]
        assert snap[0][1]["resync"] and snap[1][1]["block_hashes"] == [7] and snap[1][1]["medium"] == "GPU"
        start = snap[-1][0]
        stream.publish(1, [KVEvent(STORED, k, None, tuple(range(16)), 0) for k in (21, 22, 23)])
        with c.stream("GET", "/kv_events", headers={"Last-Event-ID": str(start + 1)}) as resp:
            rest = _events(resp, 2)
        assert [i for i, _ in rest] == [start + 2, start + 3]  # exactly what came after the id it had
        assert [e["block_hashes"] for _, e in rest] == [[22], [23]] and rest[0][1]["dp_rank"] == 1
        assert rest[0][1]["token_ids"] == list(range(16)) and rest[0][1]["block_size"] == 16
        stream.publish(1, [KVEvent(STORED, k) for k in range(30, 36)])  # the buffer keeps 4: start+2.. are gone
        with c.stream("GET", "/kv_events", headers={"Last-Event-ID": str(start + 2)}) as resp:
            again = _events(resp, 1)
        assert again[0][1]["type"] == "AllBlocksCleared" and again[0][1]["resync"]


def test_kv_events_refuses_a_bad_last_event_id(http):
    _assert_openai_error(http.get("/kv_events", headers={"Last-Event-ID": "seven"}), 400, "invalid_last_event_id")


def test_a_stream_whose_engine_goes_away_ends_cleanly_at_its_last_event():
    import asyncio

    from deployment.kv_events import _stream

    class Gone:
        async def kv_events(self, after, timeout_s):
            raise ConnectionError("the engine replica is being replaced")

    async def read() -> list[str]:
        return [chunk async for chunk in _stream(Gone(), -1, [(7, {"type": "AllBlocksCleared"})])]

    chunks = asyncio.run(read())  # ends instead of raising into the server (a traceback and a cut connection)
    assert len(chunks) == 1 and "id: 7" in chunks[0]
