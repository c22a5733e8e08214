"""The fleet view over two fake engines (each its own fake aggregator and mirror) behind the real routes: the
merged /stats pages and /stats/stream under the vector cursor, ?engine=, a restarted aggregator, the summed
/kv_cache_stats, /metrics and /health."""

import time
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from deployment.ingress.sse import SSEDecoder
from deployment.ingress.stats.fleet import parse_cursor
from tests.support.http_support import _assert_openai_error, serve_fleet

A, B = "engine-0-0", "engine-0-1"


@pytest.fixture
def fleet():
    yield from serve_fleet(2)


@pytest.fixture
def http(fleet):
    with httpx.Client(base_url=fleet.url, timeout=10) as c:
        yield c


def _fill(fleet, a: int, b: int) -> None:
    """a records on engine A and b on B, interleaved."""
    for i in range(max(a, b)):
        if i < a:
            fleet.fleet[A].add(2, 1)
        if i < b:
            fleet.fleet[B].add(3, 0)


def _merged(http, since: str = "-1", limit: int = 100) -> tuple[list[dict], list[str]]:
    """Every merged record after `since`, page after page, and each page's `since`."""
    out, cursors = [], [since]
    resp = http.get("/stats", params={"since": since, "limit": limit})
    while True:
        assert resp.status_code == 200, resp.text
        out.extend(resp.json())
        if "next" not in resp.links:
            return out, cursors
        cursors.append(parse_qs(urlsplit(resp.links["next"]["url"]).query)["since"][0])
        resp = http.get(resp.links["next"]["url"])


def _caught_up(fleet, http) -> list[dict]:
    want = {eid: len(f.records) for eid, f in fleet.fleet.items()}
    deadline = time.monotonic() + 10
    while True:
        got, _ = _merged(http)
        if {eid: sum(r["engineId"] == eid for r in got) for eid in want} == want:
            return got
        assert time.monotonic() < deadline, "the mirrors never caught up"
        time.sleep(0.01)


def _per_engine(records: list[dict]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in records:
        out.setdefault(r["engineId"], []).append(r["iter"])
    return out


def test_merged_pages_follow_the_vector_cursor(fleet, http):
    _fill(fleet, 7, 5)
    _caught_up(fleet, http)
    got, cursors = _merged(http, limit=3)
    assert _per_engine(got) == {A: list(range(7)), B: list(range(5))}  # each engine: every record once, in order
    assert len(cursors) == 4 and all(parse_cursor(c, [A, B]) for c in cursors[1:])
    # a page's cursor names each engine's last iteration delivered: resuming from it repeats nothing
    mid = parse_cursor(cursors[2], [A, B])
    rest, _ = _merged(http, cursors[2])
    assert _per_engine(rest) == {e: list(range(mid[e] + 1, n)) for e, n in ((A, 7), (B, 5)) if mid[e] + 1 < n}
    partial = http.get("/stats", params={"since": f"{A}:5"}).json()  # B not named: from its oldest record
    assert _per_engine(partial) == {A: [6], B: list(range(5))}
    for bad in ("12", f"{A}:x", f"{A}:-2", ":3"):
        err = _assert_openai_error(http.get("/stats", params={"since": bad}), 400, "invalid_cursor")
        assert "engine-0-0:812" in err["message"] or "cursor" in err["message"]


def test_an_empty_merged_page_names_no_next_page(fleet, http):
    """limit=0 once linked to its own position: a client following rel="next" looped forever."""
    _fill(fleet, 3, 3)
    _caught_up(fleet, http)
    for params in ({"limit": 0}, {"limit": 0, "since": f"{A}:1,{B}:0"}, {"limit": 0, "engine": A}):
        resp = http.get("/stats", params=params)
        assert resp.status_code == 200 and resp.json() == [] and "link" not in resp.headers, params


def test_engine_filter_reads_one_engine_as_today(fleet, http):
    _fill(fleet, 4, 3)
    _caught_up(fleet, http)
    page = http.get("/stats", params={"engine": B, "since": 0, "limit": 1})
    assert [r["iter"] for r in page.json()] == [1] and {r["engineId"] for r in page.json()} == {B}
    assert parse_qs(urlsplit(page.links["next"]["url"]).query)["since"] == ["1"]
    _assert_openai_error(http.get("/stats", params={"engine": "engine-9"}), 404, "unknown_engine")
    _assert_openai_error(http.get("/stats", params={"engine": A, "since": f"{A}:1"}), 400)
    assert set(http.get("/stats/ranks").json()) == {A, B}
    assert http.get("/stats/ranks", params={"engine": A}).json()["0"]["rank"] == 0
    _assert_openai_error(http.get("/stats/ranks/0"), 400, "engine_required")
    assert http.get("/stats/ranks/1", params={"engine": B}).json()["rank"] == 1


def _read(url: str, headers: dict, n: int) -> list[tuple[str, dict]]:
    import json

    out = []
    with httpx.Client(timeout=10) as c, c.stream("GET", f"{url}/stats/stream", headers=headers) as resp:
        assert resp.status_code == 200
        dec = SSEDecoder()
        for line in resp.iter_lines():
            ev = dec.feed(line)
            if ev is not None:
                out.append((ev.id, json.loads(ev.data)))
                if len(out) == n:
                    return out
    return out


def test_stream_resumes_with_the_vector_last_event_id(fleet, http):
    _fill(fleet, 5, 4)
    _caught_up(fleet, http)
    first = _read(fleet.url, {}, 6)
    _fill(fleet, 3, 4)  # more of both while the client is away
    rest = _read(fleet.url, {"Last-Event-ID": first[-1][0]}, 16 - 6)
    seen = [rec for _, rec in first + rest]
    assert _per_engine(seen) == {A: list(range(8)), B: list(range(8))}  # no gap, no duplicate
    for ev_id, rec in first + rest:  # each id is the vector after its event
        assert parse_cursor(ev_id, [A, B])[rec["engineId"]] == rec["iter"]
    with http.stream("GET", "/stats/stream", headers={"Last-Event-ID": "3"}) as resp:
        resp.read()
    _assert_openai_error(resp, 400, "invalid_cursor")


def test_a_restarted_aggregator_resyncs_only_its_engine(fleet, http):
    _fill(fleet, 3, 3)
    _caught_up(fleet, http)
    fleet.fleet[B].restart()  # a fresh aggregator: iterations from 0 again
    fleet.fleet[B].add(5, 5)
    deadline = time.monotonic() + 10
    while [r["timestamp"] for r in http.get("/stats", params={"engine": B}).json()] != \
            [r["timestamp"] for r in fleet.fleet[B].records]:
        assert time.monotonic() < deadline, "the mirror kept the old history"
        time.sleep(0.02)
    got = _per_engine(_merged(http)[0])
    assert got == {A: [0, 1, 2], B: [0]}
    assert http.get("/kv_cache_stats", params={"engine": B}).json()["allocTotalBlocks"] == 5


def test_kv_cache_stats_is_the_exact_sum(fleet, http):
    _fill(fleet, 6, 4)
    _caught_up(fleet, http)
    body = http.get("/kv_cache_stats").json()
    engines = {eid: f.cumulative for eid, f in fleet.fleet.items()}
    assert body["engines"] == engines
    for k in ("allocTotalBlocks", "reusedBlocks", "missedBlocks"):
        assert body["fleet"][k] == sum(e[k] for e in engines.values())
    reused, missed = body["fleet"]["reusedBlocks"], body["fleet"]["missedBlocks"]
    assert body["fleet"]["cacheHitRate"] == reused / (reused + missed)
    assert http.get("/kv_cache_stats", params={"engine": A}).json() == engines[A]


def test_metrics_label_each_engine_and_keep_fleet_totals(fleet, http):
    _fill(fleet, 2, 2)
    _caught_up(fleet, http)
    text = http.get("/metrics").text
    assert f'kvfleet_reused_blocks_total{{engine="{A}"}} 0.0' in text
    assert f'kvfleet_reused_blocks_total{{engine="{B}"}} 0.0' in text
    assert text.count("# TYPE kvfleet_reused_blocks_total counter") == 1
    assert "kvfleet_fleet_kv_cache_reused_blocks_total 2.0" in text  # A reused 1 block twice
    assert "kvfleet_fleet_engines 2.0" in text


def test_health_names_the_engines_up(fleet, http):
    body = http.get("/health").json()
    assert body["status"] == "ok" and {e: v["up"] for e, v in body["engines"].items()} == {A: True, B: True}
    fleet.fleet[B].down = "aggregator restarting"
    body = http.get("/health").json()
    assert body["engines"][B]["up"] is False and "aggregator restarting" in body["engines"][B]["why"]
    assert body["engines"][A]["up"] is True
    fleet.fleet[A].down = "gone too"
    resp = http.get("/health")
    assert resp.status_code == 503 and set(resp.json()["engines"]) == {A, B}


def test_client_follows_the_merged_stream(fleet, http):
    from deployment.clients.client import StatsClient

    _fill(fleet, 3, 2)
    _caught_up(fleet, http)
    with StatsClient(fleet.url, timeout_s=10) as c:
        stream = c.iter_stats()
        got = [next(stream) for _ in range(5)]
        stream.close()
        assert c.same_history(got[-1], got[-1]["engineId"])
    assert _per_engine(got) == {A: [0, 1, 2], B: [0, 1]}
