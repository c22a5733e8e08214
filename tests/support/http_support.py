"""The fake engine and in-memory stats source that the HTTP route tests serve with real uvicorn (no Ray)."""

import asyncio
import json
import socket
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn

from aggregator.messages import AggregatorHealth, RankHealth
from deployment.ingress.api.routes import create_api
from deployment.ingress.stats.mirror import StatsMirror
from deployment.settings import Settings
from engine.errors import EngineError, Overloaded, RequestError, RequestFailed, check_request
from engine.kv_stream import KVEventStream, vllm_events
from engine.messages import ADMITTED, EngineHealth
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
        self.salts: list = []  # the cache_salt of every request, in order
        self.seeds: list = []  # the sampling seed of every request, in order
        self.params: list = []  # the SamplingParams of every request, in order
        self.hold = threading.Event()  # 'HOLD' in the prompt: admitted (None, as the real engine announces it),
        # then the first token waits for it
        # the engine's real KV event stream over a fake index (dp 0 holds block 7 on the GPU)
        self.kv_stream = KVEventStream(4, 16, types.SimpleNamespace(blocks=[{7: 0}, {}]), buffer_always=True)

    vocab_size = ByteTokenizer.vocab_size

    async def validate(self, ids: list[int], params) -> None:
        self.validated += 1
        check_request(ids, params.max_tokens, self.vocab_size, self.max_model_len, self.max_seq_len)
        if "REJECT" in self.tokenizer.decode(ids):
            raise RequestError("the engine refuses this prompt", "engine_rejected")

    async def health(self) -> EngineHealth:
        return EngineHealth(True, 2, 0, 0, 0, 0, {}, {})

    async def kv_events(self, after: str | None, timeout_s: float) -> list:
        return vllm_events(await self.kv_stream.wait(after, min(timeout_s, 0.3)), self.kv_stream.block_size)

    async def generate(self, request_id: str, ids: list[int], params, cache_salt=None):
        self.started.append(request_id)
        self.salts.append(cache_salt)
        self.seeds.append(params.seed)
        self.params.append(params)
        prompt = self.tokenizer.decode(ids)
        reply = list(REPLY.encode())
        done = False
        try:
            if "BUSY" in prompt:
                raise Overloaded("300 requests are waiting already (max_waiting_requests); retry later")
            if "UNAVAILABLE" in prompt:
                raise EngineError("no dp group is up: group 0: rank 0 is gone", 5.0)
            if "HOLD" in prompt:
                yield ADMITTED
                await asyncio.to_thread(self.hold.wait, 30)
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
    """The aggregator's query semantics over an in-memory list (records appended from the test thread);
    `restart()` is a fresh aggregator (numbering from 0 again): a long poll in flight fails, as an actor's."""

    def __init__(self, engine_id: str = "engine-0") -> None:
        self._lock = threading.Lock()
        self.engine_id = engine_id
        self.records: list[dict] = []
        self.cumulative = {"allocTotalBlocks": 0, "reusedBlocks": 0, "missedBlocks": 0}
        self.epoch = 0
        self.down: str | None = None  # health() raises this while set

    def restart(self) -> None:
        with self._lock:
            self.records, self.epoch = [], self.epoch + 1
            self.cumulative = {"allocTotalBlocks": 0, "reusedBlocks": 0, "missedBlocks": 0}

    def add(self, alloc: int, reused: int) -> None:
        with self._lock:
            c = self.cumulative
            self.cumulative = {"allocTotalBlocks": c["allocTotalBlocks"] + alloc,
                               "reusedBlocks": c["reusedBlocks"] + reused,
                               "missedBlocks": c["missedBlocks"] + alloc - reused}
            it = len(self.records)
            self.records.append({"iter": it, "engineId": self.engine_id,
                                 "timestamp": f"{time.time():.6f}-{self.epoch}", "kvCacheStats": dict(self.cumulative),
                                 "kvCacheIterationStats": {"128": {"iterAllocTotalBlocks": alloc,
                                                                   "iterReusedBlocks": reused,
                                                                   "iterOffloadBlocks": 1}}})

    async def query(self, since: int, limit: int | None, ranks: bool) -> list[dict]:
        with self._lock:
            out = [r for r in self.records if r["iter"] > since]
        return out[:limit] if limit is not None else out

    async def wait_records(self, since: int, timeout_s: float) -> list[dict]:
        deadline, epoch = time.monotonic() + timeout_s, self.epoch
        while True:
            if self.epoch != epoch:
                raise ConnectionError("the aggregator restarted")
            out = await self.query(since, None, False)
            if out or time.monotonic() >= deadline:
                return out
            await asyncio.sleep(0.01)

    async def ranks(self) -> dict[str, RankHealth]:
        return {str(r): RankHealth(r, r, 0, None, None, None, True, None, None, None) for r in range(2)}

    async def kv_cache_stats(self) -> dict:
        with self._lock:
            return dict(self.cumulative)

    async def metrics_text(self) -> str:
        return "# TYPE kvfleet_reused_blocks_total counter\nkvfleet_reused_blocks_total 0\n"

    async def health(self) -> AggregatorHealth:
        if self.down:
            raise ConnectionError(self.down)
        n = len(self.records)
        return AggregatorHealth(True, self.engine_id, self.epoch, 2, 1, n - 1 if n else None, n, 0 if n else None, n,
                                2, {"records": n}, 0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    engine: FakeEngine
    stats: FakeStats
    fleet: dict[str, FakeStats] | None = None  # serve_fleet's engines, by id


def run_uvicorn(api, port: int):
    """Serve `api` on 127.0.0.1:port in a thread; returns a function that stops it."""
    # an open SSE stream never finishes by itself: shutting down cuts it after 2 s
    uv = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                                       timeout_graceful_shutdown=2))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)

    def stop() -> None:
        uv.should_exit = True
        thread.join(timeout=10)
        assert not thread.is_alive(), "uvicorn did not stop"
    return stop


def serve_fake(**settings_overrides):
    """The routes over a FakeEngine and FakeStats under real uvicorn, until the generator is closed."""
    engine, stats = FakeEngine(), FakeStats()
    engine.on_finish = lambda: stats.add(3, 1)
    settings = Settings(**{**dict(model="random", dp=2, tp=1, served_model_name="fake-model", max_tokens_default=8),
                           **settings_overrides})
    api = create_api(engine, StatsMirror(stats, keepalive_s=0.3), settings)
    port = _free_port()
    stop = run_uvicorn(api, port)
    yield Server(f"http://127.0.0.1:{port}", engine, stats)
    stop()


def serve_fleet(engines: int = 2):
    """The routes over FakeStats per engine of an `engine_replicas: engines` fleet (one FakeEngine answers)."""
    from deployment.ingress.stats.fleet import FleetStats

    engine = FakeEngine()
    settings = Settings(model="random", dp=2, tp=1, served_model_name="fake-model", max_tokens_default=8,
                        engine_replicas=engines)
    fakes = {eid: FakeStats(eid) for eid in settings.engine_ids()}
    engine.on_finish = lambda: fakes[settings.engine_ids()[0]].add(3, 1)
    api = create_api(engine, FleetStats.over(fakes, keepalive_s=0.3), settings)
    port = _free_port()
    stop = run_uvicorn(api, port)
    yield Server(f"http://127.0.0.1:{port}", engine, fakes[settings.engine_ids()[0]], fakes)
    stop()


@pytest.fixture(scope="module")
def server():
    yield from serve_fake()


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


def read_events(resp: httpx.Response, n: int, event: str) -> list[tuple[str, dict]]:
    """The first `n` SSE events of a streamed response as (id, decoded data); each must be an `event`."""
    from deployment.ingress.sse import SSEDecoder

    dec, out = SSEDecoder(), []
    for line in resp.iter_lines():
        ev = dec.feed(line)
        if ev is not None:
            assert ev.event == event
            out.append((ev.id, json.loads(ev.data)))
            if len(out) == n:
                break
    return out


def all_stats(http, since: int = -1) -> list[dict]:
    """Every record /stats holds after `since`, page after page (each names the next in `Link: ...; rel="next"`)."""
    out, resp = [], http.get("/stats", params={"since": since})
    while True:
        out.extend(resp.json())
        if "next" not in resp.links:
            return out
        resp = http.get(resp.links["next"]["url"])


def caught_up(server, http) -> list[dict]:
    """/stats once the replica's mirror holds every record the fake aggregator emitted (within a long-poll)."""
    want = server.stats.records[-1]["iter"]
    deadline = time.monotonic() + 10
    while (got := all_stats(http)) == [] or got[-1]["iter"] < want:
        assert time.monotonic() < deadline, "the stats mirror never caught up"
        time.sleep(0.01)
    return got


def read_chunks(url: str, path: str, done: Callable[[list[str]], bool],
                timeout_s: float = 10) -> list[tuple[float, str]]:
    """The HTTP/1.1 chunks of a streamed GET, each with when it arrived (time.monotonic()), until
    `done(texts so far)`: one chunk is one write of the server's (httpx would merge and split them)."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=timeout_s) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {where.netloc}\r\nAccept: text/event-stream\r\n\r\n".encode())
        f = sock.makefile("rb")
        status = f.readline()
        assert b" 200 " in status, status
        headers = {}
        while (line := f.readline().strip()) != b"":
            k, _, v = line.decode().partition(":")
            headers[k.lower()] = v.strip()
        assert headers.get("transfer-encoding") == "chunked", headers
        out: list[tuple[float, str]] = []
        while not done([text for _, text in out]):
            size = int(f.readline().split(b";")[0], 16)
            assert size > 0, "the stream ended"
            out.append((time.monotonic(), f.read(size).decode()))
            assert f.read(2) == b"\r\n"
        return out
