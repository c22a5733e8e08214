"""The dashboard in headless Chromium against the app's routes over an in-memory aggregator (no Ray).

Records here are built to the shape of docs/stats.md (two windows in two pool groups, the scheduler figures,
`routing`), so every chart has something to draw: 10,000 of them on one page, a restart of the server with
the same history (the page resumes after Last-Event-ID) and with a fresh one (the page starts again).
"""

import random
import time

import pytest

from aggregator.messages import RankHealth
from deployment.ingress.api.routes import create_api
from deployment.ingress.stats.fleet import FleetStats
from deployment.ingress.stats.mirror import StatsMirror
from deployment.settings import Settings
from tests.support.browser_support import browser, chart_points, dashboard_state, page  # noqa: F401  (fixtures)
from tests.support.http_support import FakeEngine, FakeStats, _free_port, run_uvicorn

pytestmark = pytest.mark.slow  # a real browser

MAX_RECORDS = 2000  # dashboard.js's window
WAIT_MS = 30_000
ENGINES_MS = 10_000  # dashboard.js's ENGINES_MS: how often the page asks for the engine list again
COUNTERS = ("iterReusedBlocks", "iterFullReusedBlocks", "iterPartialReusedBlocks", "iterMissedBlocks")
BYTES = ("iterOnboardBytes", "iterOffloadBytes", "iterHostDroppedBytes")


def hit_rate_text(stats: dict) -> str:
    """The page's big number, by docs/stats.md's formula."""
    reused, missed = stats["reusedBlocks"], stats["missedBlocks"]
    rate = 0.0 if reused == 0 or reused + missed == 0 else reused / (reused + missed)
    return f"{100 * rate:.1f}%"


class RecordStats(FakeStats):
    """FakeStats that serves whole cluster records as the aggregator builds them."""

    def __init__(self, seed: int = 0, engine_id: str = "engine-0") -> None:
        super().__init__(engine_id)
        self.rng = random.Random(seed)
        self.cum = {"maxNumBlocks": 64, "freeNumBlocks": 64, "usedNumBlocks": 0, "tokensPerBlock": 16,
                    "allocTotalBlocks": 0, "allocNewBlocks": 0, "reusedBlocks": 0, "missedBlocks": 0,
                    "cacheHitRate": 0.0}

    def push(self, n: int, missing_every: int = 0) -> None:
        with self._lock:
            for _ in range(n):
                self.records.append(self._record(len(self.records), missing_every))
            self.cumulative = dict(self.cum)

    async def ranks(self) -> dict[str, RankHealth]:
        last = self.records[-1] if self.records else {"missingRanks": []}
        return {str(r): RankHealth(r, r, 0, None, None, None, r not in last["missingRanks"], None, None,
                                   {"kvCacheStats": {"maxNumBlocks": 32, "usedNumBlocks": 8 * (r + 1)}})
                for r in range(2)}

    def _record(self, it: int, missing_every: int) -> dict:
        rng, windows, groups, lcs = self.rng, {}, {}, {}
        for lc, (w, size) in enumerate([("256", 2048), ("64", 1024)]):
            c = {"iterFullReusedBlocks": rng.randint(0, 4), "iterPartialReusedBlocks": rng.randint(0, 1),
                 "iterMissedBlocks": rng.randint(1, 3)}  # >= 1: every record draws reuse
            c["iterReusedBlocks"] = c["iterFullReusedBlocks"] + c["iterPartialReusedBlocks"]
            used, evictable = rng.randint(0, 16), rng.randint(0, 8)
            gauges = {"primaryMaxNumBlocks": 32, "primaryUsedNumBlocks": used, "primaryEvictableNumBlocks": evictable,
                      "primaryFreeNumBlocks": 32 - used, "secondaryUsedNumBlocks": rng.randint(0, 8),
                      **{b: rng.choice([0, 0, size * rng.randint(1, 4)]) for b in BYTES}}
            windows[w] = {**c, **gauges}
            groups[str(lc)] = {"poolGroupId": lc, "slotSize": size, "windowSizes": [int(w)], **gauges}
            lcs[str(lc)] = {"lifeCycleId": lc, "poolGroupId": lc, "windowSize": int(w), **c}
            self.cum["reusedBlocks"] += c["iterReusedBlocks"]
            self.cum["missedBlocks"] += c["iterMissedBlocks"]
        missing = [1] if missing_every and it % missing_every == missing_every - 1 else []
        s = it // 20  # 20 iterations a second
        return {"iter": it, "timestamp": f"2026-12-01T12:{s // 60 % 60:02d}:{s % 60:02d}.{it % 20 * 50:03d}Z",
                "engineId": self.engine_id, "aggregatorEpoch": 1, "numRanks": 2,
                "reportedRanks": [0, 1][:2 - len(missing)],
                "missingRanks": missing, "complete": not missing, "lateDeltas": 0,
                "tpDivergence": [{"dpRank": 0, "tpRank": 1, "referenceTpRank": 0, "view": "window", "lifeCycle": 0,
                                  "field": "iterMissedBlocks", "expected": 1, "got": 2}] if it == 7 else [],
                "errors": [], "kvCacheStats": dict(self.cum), "kvCacheIterationStats": windows,
                "kvCacheIterationStatsByPoolGroup": groups, "kvCacheIterationStatsByLifecycle": lcs,
                "iterLatencyMS": rng.uniform(1, 5), "numActiveRequests": rng.randint(0, 8),
                "numQueuedRequests": rng.randint(0, 3),
                "routing": {"policy": "kv", "requests": 2, "predictedReusedBlocks": 3, "realizedReusedBlocks": 2,
                            "perGroupRequests": [1, 1]}}


class FakeApp:
    """The app's routes over RecordStats on one port, stopped and started again as a test asks; over a dict
    of them (engine id -> RecordStats), a fleet of that many engines."""

    def __init__(self, stats: RecordStats | dict[str, RecordStats], settings: Settings | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        replicas = len(stats) if isinstance(stats, dict) else 1
        self.settings = settings or Settings(model="random", dp=2, tp=1, engine_replicas=replicas)
        self._stop = None
        self.start(stats)

    def start(self, stats: RecordStats | dict[str, RecordStats]) -> None:
        self.stats = stats
        source = (FleetStats.over(stats, keepalive_s=0.5) if isinstance(stats, dict)
                  else StatsMirror(stats, keepalive_s=0.5))
        self._stop = run_uvicorn(create_api(FakeEngine(), source, self.settings), self.port)

    def stop(self) -> None:
        self._stop()


@pytest.fixture
def app():
    a = FakeApp(RecordStats())
    yield a
    a.stop()


def wait_for_iter(page, it: int) -> None:  # noqa: F811
    page.wait_for_function("(it) => window.kvDashboard.lastId === it && window.kvDashboard.redraws > 0 && "
                           "document.getElementById('hit-rate').dataset.iter == String(it)", arg=it, timeout=WAIT_MS)


def shown_then_away(app, page, last_iter: int) -> None:  # noqa: F811  (page: the fixture's page)
    """The page has drawn up to `last_iter`, then the server goes away and the page sees it gone."""
    page.goto(f"{app.url}/dashboard")
    wait_for_iter(page, last_iter)
    app.stop()
    page.wait_for_function("() => !window.kvDashboard.live", timeout=WAIT_MS)


def test_ten_thousand_records_in_a_bounded_window(app, page, tmp_path):  # noqa: F811
    app.stats.push(10_000, missing_every=1000)  # iteration 9999, the newest, is incomplete
    streams = []
    page.on("request", lambda r: streams.append(r.url) if "/stats/stream" in r.url else None)
    page.goto(f"{app.url}/dashboard")
    wait_for_iter(page, 9999)
    assert streams == [f"{app.url}/stats/stream?interval_ms=500"], "the page redraws twice a second"
    st = dashboard_state(page)
    assert st["received"] == 10_000 and st["records"] == MAX_RECORDS and st["incomplete"] == 10
    for chart in ("chart-hit", "chart-blocks", "chart-reuse", "chart-requests", "chart-routing-reuse"):
        assert set(chart_points(page, chart)) == {MAX_RECORDS}, chart
        assert page.locator(f"#{chart} .main-svg").count() > 0, f"{chart}: plotly drew nothing"
    assert page.locator("#hit-rate").inner_text() == hit_rate_text(app.stats.records[-1]["kvCacheStats"])
    assert page.locator("#sec-routing-groups").is_visible()
    groups = page.evaluate("() => document.getElementById('chart-routing-groups').data[0].y")
    assert groups == [MAX_RECORDS, MAX_RECORDS]  # one request per group per record in the window
    assert page.locator('.rank.down[data-rank="1"]').count() == 1 and page.locator(".rank").count() == 2
    page.wait_for_function("() => document.querySelector('.rank[data-rank=\"0\"]').innerText.includes('25% used')")
    flags = page.locator("#flags").inner_text()
    assert "tp divergence (1): dp 0 tp 1 window iterMissedBlocks: expected 1, got 2" in flags
    assert "iter 9999: incomplete: ranks 1 missing" in flags
    assert sorted(st["views"]) == ["g:0", "g:1", "w:256", "w:64"]
    page.screenshot(path=str(tmp_path / "dashboard-10k.png"), full_page=True)
    assert page.js_errors == []


def test_views_pick_one_window_or_one_pool_group(app, page):  # noqa: F811
    app.stats.push(50)
    page.goto(f"{app.url}/dashboard")
    wait_for_iter(page, 49)
    last = app.stats.records[-1]
    for view, bucket, gauges in [("w:64", "64", "64"), ("g:0", "256", "256")]:
        page.select_option("#view", view)
        page.wait_for_function("() => !window.kvDashboard.dirty")
        drawn = page.evaluate("() => Object.fromEntries(document.getElementById('chart-reuse').data.map("
                              "t => [t.name, t.y[t.y.length - 1]]))")
        b = last["kvCacheIterationStats"][bucket]
        assert drawn == {"full reused": b["iterFullReusedBlocks"], "partial reused": b["iterPartialReusedBlocks"],
                         "missed": b["iterMissedBlocks"]}, view
        used = page.evaluate("() => document.getElementById('chart-blocks').data[0].y.at(-1)")
        assert used == last["kvCacheIterationStats"][gauges]["primaryUsedNumBlocks"]
    page.select_option("#view", "all")
    page.wait_for_function("() => !window.kvDashboard.dirty")
    used = page.evaluate("() => document.getElementById('chart-blocks').data[0].y.at(-1)")
    assert used == sum(g["primaryUsedNumBlocks"] for g in last["kvCacheIterationStatsByPoolGroup"].values())
    per_second: dict[str, list[int]] = {}  # 50 records at 20 a second: 3 seconds, summed over pool groups
    for r in app.stats.records:
        groups = r["kvCacheIterationStatsByPoolGroup"].values()
        per_second.setdefault(r["timestamp"][:19], [0, 0, 0])
        per_second[r["timestamp"][:19]] = [a + sum(g[f] for g in groups)
                                           for a, f in zip(per_second[r["timestamp"][:19]], BYTES, strict=True)]
    drawn = page.evaluate("() => document.getElementById('chart-bytes').data.map(t => t.y)")
    assert drawn == [list(col) for col in zip(*per_second.values(), strict=True)]


def test_shows_every_record_of_a_live_100_per_second_source(app, page):  # noqa: F811
    app.stats.push(5)
    page.goto(f"{app.url}/dashboard")
    wait_for_iter(page, 4)
    for _ in range(100):  # a GPU's rate: the server writes them 500 ms at a time
        app.stats.push(1)
        time.sleep(0.01)
    wait_for_iter(page, 104)
    st = dashboard_state(page)
    assert st["received"] == 105 and st["duplicates"] == 0 and st["connects"] == 1
    assert set(chart_points(page, "chart-hit")) == {105}
    assert page.js_errors == []


def test_resumes_after_last_event_id_when_the_server_comes_back(app, page):  # noqa: F811
    app.stats.push(30)
    shown_then_away(app, page, 29)
    app.stats.push(20)  # written while the page was away
    app.start(app.stats)
    wait_for_iter(page, 49)
    st = dashboard_state(page)
    assert st["connects"] >= 2 and st["resets"] == 0
    assert st["received"] == 50, "records were lost or delivered twice across the reconnect"
    assert page.js_errors == []


def test_starts_again_when_a_fresh_app_has_another_history(app, page):  # noqa: F811
    app.stats.push(300)
    shown_then_away(app, page, 299)
    fresh = RecordStats(seed=1)
    fresh.push(5)  # a fresh app numbers from 0 again: resuming after 299 would wait forever
    app.start(fresh)
    wait_for_iter(page, 4)
    st = dashboard_state(page)
    assert st["resets"] == 1 and st["records"] == 5
    assert page.locator("#hit-rate").inner_text() == hit_rate_text(fresh.records[-1]["kvCacheStats"])
    assert "another history" in page.locator("#flags").inner_text()


def test_asks_for_the_api_key_and_keeps_it_for_the_tab(page):  # noqa: F811
    a = FakeApp(RecordStats(), Settings(model="random", dp=2, tp=1, api_keys="sesame"))
    try:
        a.stats.push(10)
        page.goto(f"{a.url}/dashboard")  # the page and its scripts are open; its data requests get 401
        page.locator("#auth-key").wait_for(state="visible", timeout=WAIT_MS)
        page.fill("#auth-key", "wrong")
        page.click("#auth-form button")
        page.wait_for_function("() => document.getElementById('auth-msg').textContent.includes('refused') && "
                               "!document.getElementById('auth').hidden", timeout=WAIT_MS)
        page.fill("#auth-key", "sesame")
        page.click("#auth-form button")
        wait_for_iter(page, 9)
        assert page.evaluate("() => sessionStorage.getItem('kvfleet.apiKey')") == "sesame"
        page.reload()
        wait_for_iter(page, 9)
        assert page.locator("#auth").is_hidden()
    finally:
        a.stop()


# ---- several engines: the picker, the fleet view, one engine's stream

FLEET_IDS = ["engine-0-0", "engine-0-1"]


@pytest.fixture
def fleet_app():
    a = FakeApp({eid: RecordStats(seed=n, engine_id=eid) for n, eid in enumerate(FLEET_IDS)})
    yield a
    a.stop()


def stream_requests(page) -> list[tuple[str, str | None]]:  # noqa: F811
    """Every /stats/stream request the page makes, as (url, its Last-Event-ID)."""
    got: list[tuple[str, str | None]] = []
    page.on("request", lambda r: got.append((r.url, r.headers.get("last-event-id")))
            if "/stats/stream" in r.url else None)
    return got


def wait_for_cursor(page, cursor: str) -> None:  # noqa: F811
    """The fleet view has drawn up to `cursor` (its big number names the vector it drew)."""
    page.wait_for_function("(c) => window.kvDashboard.lastId === c && "
                           "document.getElementById('hit-rate').dataset.iter === c", arg=cursor, timeout=WAIT_MS)


def traces(page, chart: str) -> dict[str, int]:  # noqa: F811
    return page.evaluate("(id) => Object.fromEntries((document.getElementById(id).data || []).map("
                         "t => [t.name, t.x.length]))", chart)


def fleet_hit_rate_text(stats: dict[str, RecordStats]) -> str:
    last = [s.records[-1]["kvCacheStats"] for s in stats.values()]
    return hit_rate_text({k: sum(c[k] for c in last) for k in ("reusedBlocks", "missedBlocks")})


def test_one_engine_has_no_picker(app, page):  # noqa: F811
    app.stats.push(3)
    page.goto(f"{app.url}/dashboard")
    wait_for_iter(page, 2)
    assert page.locator("#engine-picker").is_hidden()


def test_fleet_view_draws_every_engine_and_one_engine_is_its_own_stream(fleet_app, page):  # noqa: F811
    a, b = (fleet_app.stats[eid] for eid in FLEET_IDS)
    a.push(30)
    b.push(20, missing_every=20)  # b's iteration 19 is incomplete
    streams = stream_requests(page)
    page.goto(f"{fleet_app.url}/dashboard")
    page.locator("#engine-picker").wait_for(state="visible", timeout=WAIT_MS)
    options = page.evaluate("() => [...document.getElementById('engine').options].map(o => [o.value, o.text])")
    assert options == [["", "all engines (fleet)"], *[[eid, eid] for eid in FLEET_IDS]]
    wait_for_cursor(page, "engine-0-0:29,engine-0-1:19")
    st = dashboard_state(page)
    assert st["received"] == 50 and st["duplicates"] == 0 and st["records"] == 50
    assert streams == [(f"{fleet_app.url}/stats/stream?interval_ms=500", None)]
    assert traces(page, "chart-hit") == {"hit rate % · engine-0-0": 30, "hit rate % · engine-0-1": 20}
    assert traces(page, "chart-reuse")["missed · engine-0-1"] == 20
    assert page.locator("#hit-rate").inner_text() == fleet_hit_rate_text(fleet_app.stats)
    page.wait_for_function("() => document.querySelectorAll('.rank').length === 4", timeout=WAIT_MS)
    assert page.locator('.rank.down[data-engine="engine-0-1"][data-rank="1"]').count() == 1
    assert page.locator('.rank.down[data-engine="engine-0-0"]').count() == 0
    assert "engine-0-1 iter 19: incomplete: ranks 1 missing" in page.locator("#flags").inner_text()

    page.select_option("#engine", "engine-0-1")  # one engine: today's page over its own stream
    wait_for_iter(page, 19)
    st = dashboard_state(page)
    assert st["received"] == 20 and st["records"] == 20 and st["connects"] == 2
    assert streams[-1] == (f"{fleet_app.url}/stats/stream?engine=engine-0-1&interval_ms=500", None)
    assert traces(page, "chart-hit") == {"hit rate %": 20}
    assert page.locator("#hit-rate").inner_text() == hit_rate_text(b.records[-1]["kvCacheStats"])
    page.wait_for_function("() => document.querySelectorAll('.rank').length === 2 && "
                           "!document.querySelector('.rank[data-engine]')", timeout=WAIT_MS)
    b.push(5)  # it follows that engine live
    wait_for_iter(page, 24)
    assert dashboard_state(page)["received"] == 25

    page.select_option("#engine", "")  # back to the fleet: every record again
    wait_for_cursor(page, "engine-0-0:29,engine-0-1:24")
    assert dashboard_state(page)["received"] == 55
    assert streams[-1] == (f"{fleet_app.url}/stats/stream?interval_ms=500", None)
    assert page.js_errors == []


def test_fleet_view_resumes_with_the_vector_and_restarts_a_fresh_engine_alone(fleet_app, page):  # noqa: F811
    a, b = (fleet_app.stats[eid] for eid in FLEET_IDS)
    a.push(30)
    b.push(20)
    streams = stream_requests(page)
    page.goto(f"{fleet_app.url}/dashboard")
    wait_for_cursor(page, "engine-0-0:29,engine-0-1:19")
    fleet_app.stop()
    page.wait_for_function("() => !window.kvDashboard.live", timeout=WAIT_MS)
    a.push(10)  # written while the page was away
    fresh = RecordStats(seed=7, engine_id="engine-0-1")
    fresh.push(5)  # engine-0-1's aggregator came back numbering from 0: the page starts it again alone
    fleet_app.start({"engine-0-0": a, "engine-0-1": fresh})
    wait_for_cursor(page, "engine-0-0:39,engine-0-1:4")
    st = dashboard_state(page)
    assert st["resets"] == 1 and st["duplicates"] == 0
    assert st["records"] == 40 + 5, "engine-0-0's records were lost or repeated, or engine-0-1's old ones kept"
    assert streams[-1][1] == "engine-0-0:29", "the cursor sent back names the fresh engine from its oldest record"
    assert "engine-0-1: this engine has another history" in page.locator("#flags").inner_text()
    assert page.locator("#hit-rate").inner_text() == fleet_hit_rate_text({"a": a, "b": fresh})
    assert page.js_errors == []


# ---- autoscaling: engines join and leave

class ScriptedFleet(FleetStats):
    """An autoscaled fleet whose registry table is the test's, applied on the server's loop whenever /health is
    asked (as the ingress's member follower does every second)."""

    sources: dict[str, RecordStats] = {}
    table: dict[str, dict] = {}

    async def engines_health(self, timeout_s: float) -> dict[str, dict]:
        self.apply({"engines": dict(self.table), "retired": {}}, self.sources.get)
        return await super().engines_health(timeout_s)


def test_the_picker_follows_engines_that_join_and_leave(page):  # noqa: F811
    live, gone = {"gone": False, "aggregator": True}, {"gone": True, "aggregator": False}
    fleet = ScriptedFleet.over({}, dynamic=True, keepalive_s=0.5)
    fleet.sources = {eid: RecordStats(seed=n, engine_id=eid) for n, eid in enumerate(("scale-0", "scale-1"))}
    fleet.table = {"scale-0": live}
    fleet.sources["scale-0"].push(10)
    port = _free_port()
    stop = run_uvicorn(create_api(FakeEngine(), fleet, Settings(model="random", dp=2, tp=1, engine_replicas_max=3)),
                       port)
    try:
        page.clock.install()  # time flows as usual; fast_forward stands for the picker's 10 s wait
        page.goto(f"http://127.0.0.1:{port}/dashboard")
        wait_for_cursor(page, "scale-0:9")  # a fleet of one keeps the fleet's shape
        fleet.table = {"scale-0": live, "scale-1": live}  # a scale-up
        fleet.sources["scale-1"].push(5)
        page.clock.fast_forward(ENGINES_MS)
        wait_for_cursor(page, "scale-0:9,scale-1:4")  # the merged stream brings the new engine's records
        options = "() => [...document.getElementById('engine').options].map(o => o.text).join('|')"
        page.wait_for_function(f"() => ({options})() === 'all engines (fleet)|scale-0|scale-1'", timeout=WAIT_MS)
        assert traces(page, "chart-hit") == {"hit rate % · scale-0": 10, "hit rate % · scale-1": 5}
        fleet.table = {"scale-0": live, "scale-1": gone}  # a scale-down: still drawn, marked in the picker
        page.clock.fast_forward(ENGINES_MS)
        page.wait_for_function(f"() => ({options})() === 'all engines (fleet)|scale-0|scale-1 (gone)'",
                               timeout=WAIT_MS)
        assert traces(page, "chart-hit") == {"hit rate % · scale-0": 10, "hit rate % · scale-1": 5}
        assert page.js_errors == []
    finally:
        stop()
