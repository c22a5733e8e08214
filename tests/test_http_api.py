"""The HTTP routes over a fake engine and an in-memory stats source, served by real uvicorn (no Ray).

Covers the request checks (every bad input is a 4xx in OpenAI's shape, followed by a request that still
works), generation with stop strings and streaming, stats paging, SSE resume, and that a client that
goes away aborts its engine request.
"""

import asyncio
import json
import shutil
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from e2e_fixtures import prometheus_query

from deployment.client import StatsClient, StatsError
from deployment.mirror import StatsMirror
from deployment.routes import create_api
from deployment.settings import Settings
from deployment.sse import SSEDecoder
from workers.errors import EngineError, RequestError, RequestFailed, check_request
from workers.tokenizer import ByteTokenizer

EOS = ByteTokenizer.eos_token_id

REPLY = "The cache is warm. "


@dataclass
class TokenEvent:
    token_id: int
    finish_reason: str | None


class FakeEngine:
    """Replies REPLY over and over; 'EOS' in the prompt ends with eos after one reply; 'SLOW' is slow; 'DOWN'
    and 'FAIL' raise the engine's errors after one token (a dead dp group, a request that failed on a rank)."""

    tokenizer = ByteTokenizer()
    max_seq_len = 128
    max_model_len = 128

    def __init__(self) -> None:
        self.started: list[str] = []
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.validated = 0
        self.on_finish = lambda: None  # the fixture wires this to FakeStats, like ranks reporting a step

    vocab_size = ByteTokenizer.vocab_size

    async def validate(self, ids: list[int], params) -> None:
        self.validated += 1
        check_request(ids, params.max_tokens, self.vocab_size, self.max_model_len, self.max_seq_len)
        if "REJECT" in self.tokenizer.decode(ids):
            raise RequestError("the engine refuses this prompt", "engine_rejected")

    async def health(self) -> dict:
        return {"ranks": 2}

    async def generate(self, request_id: str, ids: list[int], params, cache_salt=None):
        self.started.append(request_id)
        prompt = self.tokenizer.decode(ids)
        reply = list(REPLY.encode())
        done = False
        try:
            for i in range(params.max_tokens):
                if "SLOW" in prompt:
                    await asyncio.sleep(0.05)
                else:
                    await asyncio.sleep(0)
                if "EOS" in prompt and i == len(reply):
                    done = True
                    yield TokenEvent(EOS, "stop")
                    return
                if i == 1 and "DOWN" in prompt:
                    raise EngineError("dp group 1 is down: rank 1 is gone (ActorDiedError)")
                if i == 1 and "FAIL" in prompt:
                    raise RequestFailed("request r failed: RuntimeError: \x1b[31mboom\x1b[0m\nTraceback (most recent")
                last = i == params.max_tokens - 1
                done = last
                yield TokenEvent(reply[i % len(reply)], "length" if last else None)
        finally:
            (self.finished if done else self.aborted).append(request_id)
            self.on_finish()


class FakeStats:
    """The aggregator's query semantics over an in-memory list (records appended from the test thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.records: list[dict] = []
        self.cumulative = {"allocTotalBlocks": 0, "reusedBlocks": 0, "missedBlocks": 0}

    def add(self, alloc: int, reused: int) -> None:
        with self._lock:
            c = self.cumulative
            self.cumulative = {"allocTotalBlocks": c["allocTotalBlocks"] + alloc,
                               "reusedBlocks": c["reusedBlocks"] + reused,
                               "missedBlocks": c["missedBlocks"] + alloc - reused}
            it = len(self.records)
            self.records.append({"iter": it, "kvCacheStats": dict(self.cumulative),
                                 "kvCacheIterationStats": {"128": {"iterAllocTotalBlocks": alloc,
                                                                   "iterReusedBlocks": reused,
                                                                   "iterOffloadBlocks": 1}}})

    async def query(self, since: int, limit: int | None, ranks: bool) -> list[dict]:
        with self._lock:
            out = [r for r in self.records if r["iter"] > since]
        return out[:limit] if limit is not None else out

    async def wait_records(self, since: int, timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while True:
            out = await self.query(since, None, False)
            if out or time.monotonic() >= deadline:
                return out
            await asyncio.sleep(0.01)

    async def ranks(self) -> dict:
        return {"0": {"rank": 0, "healthy": True}, "1": {"rank": 1, "healthy": True}}

    async def kv_cache_stats(self) -> dict:
        with self._lock:
            return dict(self.cumulative)

    async def metrics_text(self) -> str:
        return "# TYPE kvfleet_reused_blocks_total counter\nkvfleet_reused_blocks_total 0\n"

    async def health(self) -> dict:
        return {"records": len(self.records)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    engine: FakeEngine
    stats: FakeStats


@pytest.fixture(scope="module")
def server():
    engine, stats = FakeEngine(), FakeStats()
    engine.on_finish = lambda: stats.add(3, 1)
    settings = Settings(model="random", dp=2, tp=1, served_model_name="fake-model", max_tokens_default=8)
    api = create_api(engine, StatsMirror(stats, keepalive_s=0.3), settings)
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield Server(f"http://127.0.0.1:{port}", engine, stats)
    uv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


def _assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


def test_completion(http):
    r = http.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == REPLY[:5]
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}  # BOS + "hi"


def test_completion_token_ids_and_default_max_tokens(http):
    r = http.post("/v1/completions", json={"prompt": [104, 105]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8  # max_tokens_default


def test_eos_is_not_text(http):
    r = http.post("/v1/completions", json={"prompt": "EOS", "max_tokens": 50})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == REPLY


def test_stop_string_cuts_text_and_aborts_engine_request(server, http):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50, "stop": ["is w"]})
    body = r.json()
    assert body["choices"][0] == {"index": 0, "text": "The cache ", "logprobs": None, "finish_reason": "stop"}
    assert body["id"].removeprefix("cmpl-") and any(rid == body["id"] for rid in server.engine.aborted)


def test_chat_completion(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                "max_completion_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY[:3]}
    assert body["usage"]["prompt_tokens"] == 1 + len("<|user|>\nhi\n<|assistant|>\n")


def _sse_data(text: str) -> list[str]:
    dec, out = SSEDecoder(), []
    for line in text.split("\n"):
        ev = dec.feed(line)
        if ev is not None:
            out.append(ev.data)
    return out


def test_streaming_completion_and_chat(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "stream": True,
                                           "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    data = _sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == REPLY[:6]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6

    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 4, "stream": True})
    chunks = [json.loads(d) for d in _sse_data(r.text)[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY[:4]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_models(http):
    body = http.get("/v1/models").json()
    assert [m["id"] for m in body["data"]] == ["fake-model"]


BAD_INPUTS = [
    ("invalid json", "/v1/completions", b'{"prompt": "hi", ', 400, "invalid_json"),
    ("not an object", "/v1/completions", b'[1, 2]', 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "missing"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, None),
    ("batched prompt", "/v1/completions", {"prompt": ["a", "b"]}, 400, None),
    ("negative token id", "/v1/completions", {"prompt": [1, -3]}, 400, None),
    ("token id outside vocab", "/v1/completions", {"prompt": [1, 9999]}, 400, "invalid_token_id"),
    ("engine validation", "/v1/completions", {"prompt": "REJECT me"}, 400, "engine_rejected"),
    ("prompt too long", "/v1/completions", {"prompt": "x" * 200}, 400, "context_length_exceeded"),
    ("prompt fills the context", "/v1/completions", {"prompt": "x" * 128}, 400, "context_length_exceeded"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, None),
    ("zero max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, None),
    ("absurd max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 10**15}, 400,
     "context_length_exceeded"),
    ("string max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, None),
    ("unknown model", "/v1/completions", {"prompt": "hi", "model": "/etc/passwd"}, 404, "model_not_found"),
    ("n > 1", "/v1/completions", {"prompt": "hi", "n": 2}, 400, None),
    ("unknown field", "/v1/completions", {"prompt": "hi", "modle_path": "x"}, 400, None),
    ("temperature out of range", "/v1/completions", {"prompt": "hi", "temperature": 9}, 400, None),
    ("five stop strings", "/v1/completions", {"prompt": "hi", "stop": list("abcde")}, 400, None),
    ("chat without messages", "/v1/chat/completions", {"messages": []}, 400, None),
    ("chat bad role", "/v1/chat/completions", {"messages": [{"role": "god", "content": "x"}]}, 400, None),
    ("chat unknown model", "/v1/chat/completions",
     {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found"),
    ("prompt lone surrogate", "/v1/completions", b'{"prompt": "hi \\udfff"}', 400, None),
    ("model lone surrogate", "/v1/completions", b'{"prompt": "hi", "model": "\\udfff"}', 400, None),
    ("field named with a lone surrogate", "/v1/completions", b'{"prompt": "hi", "\\udfff": 1}', 400, None),
    ("stop lone surrogate", "/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}', 400, None),
    ("chat content lone surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', 400, None),
    ("chat max tokens disagree", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3}, 400, None),
]


@pytest.mark.parametrize("name,path,body,status,code", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_generation_input_is_4xx_then_service_continues(server, http, name, path, body, status, code):
    started = len(server.engine.started)
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    err = _assert_openai_error(r, status, code)
    assert err["type"] in ("invalid_request_error", "not_found_error")
    assert len(server.engine.started) == started, "a bad request reached the engine"
    ok = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == REPLY[:2]


BAD_STATS = [
    ("/stats?since=-2", 400), ("/stats?since=abc", 400), ("/stats?limit=-1", 400),
    ("/stats?limit=10001", 400), ("/stats?ranks=perhaps", 400), ("/stats/ranks/2", 404),
    ("/stats/ranks/-1", 404), ("/stats/ranks/x", 400), ("/stats/stream?since=-5", 400), ("/nowhere", 404),
]


def caught_up(server, http) -> list[dict]:
    """/stats once the replica's mirror holds every record the fake aggregator emitted (within a long-poll)."""
    want = server.stats.records[-1]["iter"]
    deadline = time.monotonic() + 10
    while (got := http.get("/stats").json()) == [] or got[-1]["iter"] < want:
        assert time.monotonic() < deadline, "the stats mirror never caught up"
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("path,status", BAD_STATS)
def test_bad_stats_input_is_4xx(server, http, path, status):
    server.stats.add(1, 0)
    before = caught_up(server, http)
    _assert_openai_error(http.get(path), status)
    assert http.get("/stats").json() == before, "a bad request changed the records"


def test_bad_last_event_id(http):
    _assert_openai_error(http.get("/stats/stream", headers={"Last-Event-ID": "seven"}), 400,
                         "invalid_last_event_id")


def test_stats_paging_and_readers_see_the_same(server, http):
    for i in range(5):
        server.stats.add(2, i)
    everything = caught_up(server, http)
    assert everything == http.get("/stats").json(), "reading removed records"
    iters = [r["iter"] for r in everything]
    assert iters == sorted(iters) and len(iters) >= 5
    page = http.get("/stats", params={"since": iters[1], "limit": 2}).json()
    assert [r["iter"] for r in page] == iters[2:4]
    assert http.get("/stats", params={"limit": 0}).json() == []
    with StatsClient(server.url) as c:
        assert c.get_all_stats(page=2) == everything
        assert c.kv_cache_stats() == http.get("/kv_cache_stats").json()
        assert c.rank(1)["rank"] == 1
        with pytest.raises(StatsError) as exc:
            c.rank(7)
        assert exc.value.status == 404 and exc.value.code == "unknown_rank"


def test_metrics_health_ranks(http):
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "kvfleet_reused_blocks_total" in r.text
    assert http.get("/health").json()["status"] == "ok"
    assert set(http.get("/stats/ranks").json()) == {"0", "1"}


def _read_events(resp: httpx.Response, n: int) -> list[tuple[str, dict]]:
    dec, out = SSEDecoder(), []
    for line in resp.iter_lines():
        ev = dec.feed(line)
        if ev is not None:
            assert ev.event == "stats"
            out.append((ev.id, json.loads(ev.data)))
            if len(out) == n:
                break
    return out


def test_sse_resume_with_last_event_id(server):
    for _ in range(3):
        server.stats.add(1, 1)
    all_iters = [r["iter"] for r in server.stats.records]
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("GET", "/stats/stream") as resp:
            first = _read_events(resp, 3)
        assert [int(i) for i, _ in first] == all_iters[:3]
        assert all(int(i) == rec["iter"] for i, rec in first)
        with c.stream("GET", "/stats/stream", headers={"Last-Event-ID": first[-1][0]}) as resp:
            rest = _read_events(resp, len(all_iters) - 3)
        assert [r["iter"] for _, r in rest] == all_iters[3:], "resume skipped or repeated a record"


def test_sse_delivers_new_records_and_keepalives(server):
    last = server.stats.records[-1]["iter"] if server.stats.records else -1
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("GET", "/stats/stream", params={"since": last}) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith(": keepalive")  # nothing new yet: a comment after keepalive_s
            server.stats.add(3, 0)
            dec = SSEDecoder()
            for line in lines:
                ev = dec.feed(line)
                if ev is not None:
                    assert json.loads(ev.data)["iter"] == last + 1
                    break


def test_client_iter_stats_follows_stream(server):
    base = server.stats.records[-1]["iter"] if server.stats.records else -1
    server.stats.add(1, 0)
    server.stats.add(1, 0)
    with StatsClient(server.url) as c:
        it = c.iter_stats(since=base)
        got = [next(it)["iter"], next(it)["iter"]]
        it.close()
    assert got == [base + 1, base + 2]


def test_disconnect_aborts_streaming_request(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("POST", "/v1/completions",
                      json={"prompt": "SLOW", "max_tokens": 100, "stream": True}) as resp:
            dec = SSEDecoder()
            for line in resp.iter_lines():
                ev = dec.feed(line)
                if ev is not None:
                    rid = json.loads(ev.data)["id"]
                    break
    deadline = time.monotonic() + 10
    while rid not in server.engine.aborted:
        assert time.monotonic() < deadline, "the engine request was not aborted after the client left"
        time.sleep(0.02)
    assert rid not in server.engine.finished


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (make tools)")
def test_real_prometheus_scrapes_metrics_route(server, tmp_path):
    result = prometheus_query(server.url.removeprefix("http://"), "kvfleet_reused_blocks_total", tmp_path)
    assert float(result[0]["value"][1]) == 0.0 and result[0]["metric"]["job"] == "kvfleet"


def test_loadgen_reports_the_run(server, capsys):
    from deployment.loadgen import main

    before = len(server.stats.records)
    assert main(["--url", server.url, "--requests", "6", "--concurrency", "3", "--prefixes", "2",
                 "--prefix-words", "5", "--max-tokens", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "6 requests (0 failed), 12 tokens" in out
    # every request finished one fake step of 3 allocated / 1 reused / 1 offloaded block
    assert "hit rate over the run: 33.3% (blocks reused 6, missed 12)" in out
    assert f"blocks offloaded to the host tier: 6 (over {len(server.stats.records) - before} iteration" in out


def test_models_advertise_the_limit_the_routes_enforce(http):
    (model,) = http.get("/v1/models").json()["data"]
    limit = model["max_model_len"]
    ok = http.post("/v1/completions", json={"prompt": [65] * (limit - 4), "max_tokens": 4})
    assert ok.status_code == 200, ok.text
    _assert_openai_error(http.post("/v1/completions", json={"prompt": [65] * (limit - 4), "max_tokens": 5}),
                         400, "context_length_exceeded")


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failures_are_clean_errors(http, stream):
    """A down group is 503 engine_unavailable, a failed request 500 request_failed: one line, no colour
    codes or traceback; in-band as an SSE error event once a stream has started."""
    expected = {"DOWN": (503, "engine_unavailable"), "FAIL": (500, "request_failed")}
    for word, (status, code) in expected.items():
        body = {"prompt": f"{word} now", "max_tokens": 5, "stream": stream}
        if not stream:
            err = _assert_openai_error(http.post("/v1/completions", json=body), status, code)
        else:
            with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                dec, events = SSEDecoder(), []
                for line in resp.iter_lines():
                    ev = dec.feed(line)
                    if ev is not None:
                        events.append(ev.data)
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == code
        assert "\x1b" not in err["message"] and "Traceback" not in err["message"], err
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_disconnect_aborts_non_streaming_request(server):
    started = len(server.engine.started)
    with httpx.Client(base_url=server.url, timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={"prompt": "SLOW", "max_tokens": 100})
    rid = server.engine.started[started]
    deadline = time.monotonic() + 10
    while rid not in server.engine.aborted:
        assert time.monotonic() < deadline, "the engine request was not aborted after the client left"
        time.sleep(0.02)
    assert rid not in server.engine.finished
