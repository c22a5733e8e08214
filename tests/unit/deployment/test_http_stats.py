"""The statistics routes over the replica's stats mirror of an in-memory aggregator, served by real uvicorn.

Covers stats paging (reading removes nothing), bad input, SSE resume with Last-Event-ID and keepalives, the
Python client, a real Prometheus scraping /metrics, and the load generator's report.
"""

import json
import shutil
import threading
import time

import httpx
import pytest

from deployment.clients.client import StatsClient, StatsError
from deployment.ingress.sse import SSEDecoder
from tests.support.e2e_fixtures import prometheus_query
from tests.support.http_support import _assert_openai_error, all_stats, caught_up, read_chunks, read_events

BAD_STATS = [
    ("/stats?since=-2", 400), ("/stats?since=abc", 400), ("/stats?limit=-1", 400),
    ("/stats?limit=1001", 400), ("/stats?ranks=perhaps", 400), ("/stats/ranks/2", 404),
    ("/stats/ranks/-1", 404), ("/stats/ranks/x", 400), ("/stats/stream?since=-5", 400), ("/nowhere", 404),
    ("/stats/stream?interval_ms=-1", 400), ("/stats/stream?interval_ms=10001", 400),
    ("/stats/stream?interval_ms=0.5", 400),
]


def _refused(http, path: str, status: int, **kw) -> dict:
    """The error of a refused GET; a stream that opened instead fails at once (it would never end)."""
    with http.stream("GET", path, **kw) as resp:
        assert resp.status_code == status, f"{path}: {resp.status_code}"
        resp.read()
    return _assert_openai_error(resp, status)


@pytest.mark.parametrize("path,status", BAD_STATS)
def test_bad_stats_input_is_4xx(server, http, path, status):
    server.stats.add(1, 0)
    before = caught_up(server, http)
    _refused(http, path, status)
    assert all_stats(http) == before, "a bad request changed the records"


def test_bad_last_event_id_and_interval(http):
    assert _refused(http, "/stats/stream", 400, headers={"Last-Event-ID": "seven"})["code"] == "invalid_last_event_id"
    assert _refused(http, "/stats/stream?interval_ms=fast", 400)["param"] == "interval_ms"
    assert "10000" in _refused(http, "/stats/stream?interval_ms=20000", 400)["message"]


def test_stats_paging_and_readers_see_the_same(server, http):
    for i in range(5):
        server.stats.add(2, i)
    everything = caught_up(server, http)
    assert everything == all_stats(http), "reading removed records"
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


def test_stats_pages_hold_100_records_and_name_the_next(server, http):
    while len(server.stats.records) < 250:
        server.stats.add(1, 0)
    everything = caught_up(server, http)
    first = http.get("/stats")
    assert first.json() == everything[:100]
    nxt = httpx.URL(first.links["next"]["url"])
    assert nxt.path == "/stats" and nxt.params["since"] == str(everything[99]["iter"]) and nxt.params["limit"] == "100"
    last = http.get("/stats", params={"since": everything[-3]["iter"], "limit": 2, "ranks": "true"})
    assert [r["iter"] for r in last.json()] == [r["iter"] for r in everything[-2:]] and "link" not in last.headers
    ranked = http.get("/stats", params={"limit": 1, "ranks": "true"})
    assert httpx.URL(ranked.links["next"]["url"]).params["ranks"] == "true"  # the next page keeps the query
    with StatsClient(server.url) as c:
        assert c.get_all_stats(page=7) == everything


def test_metrics_health_ranks(http):
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "kvfleet_reused_blocks_total" in r.text
    assert http.get("/health").json()["status"] == "ok"
    assert set(http.get("/stats/ranks").json()) == {"0", "1"}


def _read_events(resp: httpx.Response, n: int) -> list[tuple[str, dict]]:
    return read_events(resp, n, "stats")


@pytest.mark.parametrize("interval_ms", [0, 500])
def test_sse_resume_with_last_event_id(server, interval_ms):
    for _ in range(3):
        server.stats.add(1, 1)
    all_iters = [r["iter"] for r in server.stats.records]
    q = {"interval_ms": interval_ms}
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("GET", "/stats/stream", params=q) as resp:
            first = _read_events(resp, 3)
        assert [int(i) for i, _ in first] == all_iters[:3]
        assert all(int(i) == rec["iter"] for i, rec in first)
        with c.stream("GET", "/stats/stream", params=q, headers={"Last-Event-ID": first[-1][0]}) as resp:
            rest = _read_events(resp, len(all_iters) - 3)
        assert [r["iter"] for _, r in rest] == all_iters[3:], "resume skipped or repeated a record"


@pytest.mark.parametrize("interval_ms", [0, 200])
def test_sse_delivers_new_records_and_keepalives(server, interval_ms):
    last = server.stats.records[-1]["iter"] if server.stats.records else -1
    with httpx.Client(base_url=server.url, timeout=10) as c:
        with c.stream("GET", "/stats/stream", params={"since": last, "interval_ms": interval_ms}) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith(": keepalive")  # nothing new yet: a comment after keepalive_s
            server.stats.add(3, 0)
            dec = SSEDecoder()
            for line in lines:
                ev = dec.feed(line)
                if ev is not None:
                    assert json.loads(ev.data)["iter"] == last + 1
                    break


def _writes_while_publishing(server, interval_ms: int, n: int = 10, every_s: float = 0.05):
    """The writes (HTTP chunks) of records on /stats/stream?interval_ms=N while n records are published
    `every_s` apart, each (arrival, iters); and how long publishing took."""
    base = server.stats.records[-1]["iter"] if server.stats.records else -1
    took = []

    def publish() -> None:
        time.sleep(0.2)  # the stream is open
        t0 = time.monotonic()
        for _ in range(n):
            server.stats.add(1, 0)
            time.sleep(every_s)
        took.append(time.monotonic() - t0)

    def ids(text: str) -> list[int]:
        return [int(line[4:]) for line in text.split("\n") if line.startswith("id: ")]

    publisher = threading.Thread(target=publish)
    publisher.start()
    chunks = read_chunks(server.url, f"/stats/stream?since={base}&interval_ms={interval_ms}",
                         lambda texts: sum(len(ids(t)) for t in texts) >= n)
    publisher.join()
    dec = SSEDecoder()
    events = [ev for _, text in chunks for line in text.split("\n") if (ev := dec.feed(line)) is not None]
    assert [int(ev.id) for ev in events] == [json.loads(ev.data)["iter"] for ev in events] == list(
        range(base + 1, base + 1 + n)), "each event keeps its own id and record"
    return [(t, ids(text)) for t, text in chunks if ids(text)], took[0]


def test_sse_interval_writes_the_records_of_each_interval_in_one_chunk(server):
    each, _ = _writes_while_publishing(server, 0)
    assert len(each) >= 5, "50 ms apart, the records should come about one write each"
    windowed, took = _writes_while_publishing(server, 400)
    assert len(windowed[0][1]) == 1, "the first record after a quiet spell waits for nothing"
    assert 2 <= len(windowed) <= took / 0.4 + 2, [w for _, w in windowed]
    assert all(b - a > 0.25 for (a, _), (b, _) in zip(windowed, windowed[1:], strict=False)), "writes too close"


def test_client_iter_stats_follows_stream(server):
    base = server.stats.records[-1]["iter"] if server.stats.records else -1
    server.stats.add(1, 0)
    server.stats.add(1, 0)
    with StatsClient(server.url) as c:
        it = c.iter_stats(since=base)
        got = [next(it)["iter"], next(it)["iter"]]
        it.close()
    assert got == [base + 1, base + 2]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (make tools)")
def test_real_prometheus_scrapes_metrics_route(server, tmp_path):
    result = prometheus_query(server.url.removeprefix("http://"), "kvfleet_reused_blocks_total", tmp_path)
    assert float(result[0]["value"][1]) == 0.0 and result[0]["metric"]["job"] == "kvfleet"


def test_loadgen_reports_the_run(server, capsys):
    from deployment.clients.loadgen import main

    before = len(server.stats.records)
    assert main(["--url", server.url, "--requests", "6", "--concurrency", "3", "--prefixes", "2",
                 "--prefix-words", "5", "--max-tokens", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "6 requests (0 failed), 12 tokens" in out
    # every request finished one fake step of 3 allocated / 1 reused / 1 offloaded block
    assert "hit rate over the run: 33.3% (blocks reused 6, missed 12)" in out
    assert f"blocks offloaded to the host tier: 6 (over {len(server.stats.records) - before} iteration" in out


def test_trtllm_layout_serves_the_records_as_a_json_list_and_prometheus_at_its_paths(server, http):
    for _ in range(3):
        server.stats.add(1, 0)
    everything = caught_up(server, http)
    iters = [r["iter"] for r in everything]
    newest = http.get("/trtllm/metrics", params={"limit": 2})
    assert newest.headers["content-type"] == "application/json"
    assert newest.json() == everything[-2:], "not the newest records, oldest first"
    assert http.get("/trtllm/metrics").json() == everything[-100:]
    assert http.get("/trtllm/metrics").json() == http.get("/trtllm/metrics").json(), "reading removed records"
    page = http.get("/trtllm/metrics", params={"since": iters[-3], "limit": 1}).json()
    assert [r["iter"] for r in page] == [iters[-2]]
    assert http.get("/trtllm/metrics", params={"limit": 0}).json() == []
    _assert_openai_error(http.get("/trtllm/metrics", params={"since": -2}), 400)
    _assert_openai_error(http.get("/trtllm/metrics", params={"limit": 10_001}), 400)
    prom = http.get("/trtllm/prometheus/metrics")
    assert prom.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "kvfleet_reused_blocks_total" in prom.text
