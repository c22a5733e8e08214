"""The dashboard in headless Chromium against the real Serve app, with traffic flowing.

The page's big number must equal /kv_cache_stats by docs/stats.md's formula, the numbers must move while
completions run, and the page must come back by itself after the app's HTTP replica is killed (Serve starts
a new one, whose stats mirror starts empty): it resumes after Last-Event-ID, losing and doubling nothing.
"""

import threading
import time

import httpx
import pytest

from deployment.clients.loadgen import make_prompts
from tests.support.browser_support import browser, chart_points, dashboard_state, page  # noqa: F401  (fixtures)
from tests.support.e2e_fixtures import E2E_APP_NAME, wait_healthy
from tests.support.http_support import all_stats

pytestmark = pytest.mark.slow

MODEL = "kvfleet-tiny"
WAIT_MS = 120_000
CHARTS = ("chart-hit", "chart-blocks", "chart-reuse", "chart-bytes", "chart-requests")


def hit_rate_text(stats: dict) -> str:
    reused, missed = stats["reusedBlocks"], stats["missedBlocks"]
    rate = 0.0 if reused == 0 or reused + missed == 0 else reused / (reused + missed)
    return f"{100 * rate:.1f}%"


class Traffic:
    """Completions over shared prefixes, one after another in a thread, until stopped."""

    def __init__(self, url: str) -> None:
        self.url, self.sent, self.failed = url, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        prompts = make_prompts(10_000, prefixes=3, prefix_words=15, seed=7)
        with httpx.Client(base_url=self.url, timeout=60) as c:
            for p in prompts:
                if self._stop.is_set():
                    return
                try:
                    r = c.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 4})
                    self.sent += 1
                    self.failed += r.status_code != 200
                except httpx.HTTPError:  # the ingress replica is being replaced
                    self.failed += 1


def page_numbers(page) -> dict:  # noqa: F811
    return page.evaluate("() => { const d = document.getElementById('hit-rate').dataset;"
                         "return {iter: Number(d.iter), reused: Number(d.reused), missed: Number(d.missed),"
                         "text: document.getElementById('hit-rate').textContent}; }")


def settled(url: str, page, timeout_s: float = 120) -> dict:  # noqa: F811
    """/kv_cache_stats and the page once no more records come: both must show the newest record."""
    deadline = time.monotonic() + timeout_s
    while True:
        cum = httpx.get(f"{url}/kv_cache_stats", timeout=10).json()
        with httpx.Client(base_url=url, timeout=30) as http:
            latest = all_stats(http)[-1]["iter"]
        shown = page_numbers(page)
        if shown["iter"] == latest and shown["reused"] == cum["reusedBlocks"]:
            return {"cum": cum, "shown": shown, "latest": latest}
        assert time.monotonic() < deadline, f"the page never caught up: {shown} vs {cum} at iter {latest}"
        time.sleep(0.5)  # poll interval


def kill_ingress_replica() -> str:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if E2E_APP_NAME in a["name"] and "KVFleetIngress" in a["name"] and a["name"].startswith("SERVE_REPLICA")]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def test_dashboard_follows_the_live_app_and_comes_back_after_a_restart(serve_app, page, tmp_path):  # noqa: F811
    page.goto(f"{serve_app}/dashboard")
    with Traffic(serve_app) as traffic:
        page.wait_for_function("() => window.kvDashboard.records.length > 0 && window.kvDashboard.redraws > 0",
                               timeout=WAIT_MS)
        before = page_numbers(page)
        # the numbers move as traffic flows: newer iterations, more blocks counted
        page.wait_for_function("(b) => { const d = document.getElementById('hit-rate').dataset;"
                               "return Number(d.iter) > b.iter && Number(d.reused) + Number(d.missed) > "
                               "b.reused + b.missed; }", arg=before, timeout=WAIT_MS)
        for chart in CHARTS:
            assert page.locator(f"#{chart} .main-svg").count() > 0, f"{chart}: plotly drew nothing"
            points = chart_points(page, chart)
            assert points and min(points) > 0, (chart, points)
    assert traffic.sent > 0 and traffic.failed == 0
    first = settled(serve_app, page)
    assert first["shown"]["text"] == hit_rate_text(first["cum"])
    assert first["cum"]["reusedBlocks"] > 0, "shared prefixes were never reused"
    # the strip follows /stats/ranks (polled every 2 s): both ranks reported, neither down
    page.wait_for_function("() => { const cells = [...document.querySelectorAll('.rank')]; return cells.length === 2"
                           " && cells.every(c => c.dataset.reported === 'true' && !c.classList.contains('down')); }",
                           timeout=WAIT_MS)

    killed = kill_ingress_replica()
    page.wait_for_function("() => !window.kvDashboard.live", timeout=WAIT_MS)
    wait_healthy(serve_app, 300)  # Serve's new ingress replica answers
    with Traffic(serve_app) as traffic:
        page.wait_for_function("(it) => window.kvDashboard.live && window.kvDashboard.lastId > it",
                               arg=first["latest"], timeout=WAIT_MS)
        deadline = time.monotonic() + 120
        while traffic.sent < 5:
            assert time.monotonic() < deadline, "fewer than 5 completions on the new replica in 120 s"
            time.sleep(0.2)  # a few completions on the new replica
    second = settled(serve_app, page)
    assert second["latest"] > first["latest"]
    assert second["shown"]["text"] == hit_rate_text(second["cum"])
    st = dashboard_state(page)
    assert st["connects"] >= 2 and st["resets"] == 0 and st["duplicates"] == 0, (killed, st)
    with httpx.Client(base_url=serve_app, timeout=30) as http:
        server_iters = [r["iter"] for r in all_stats(http, since=st["firstIter"] - 1) if r["iter"] <= st["lastId"]]
    # every record the server holds up to the page's newest, none missed across the reconnect (the server may
    # hold newer ones by now: the engine steps once more to close the last request)
    page_iters = page.evaluate("() => window.kvDashboard.records.map(r => r.iter)")
    assert st["received"] == len(page_iters) and page_iters == server_iters, "records lost across the reconnect"
    page.screenshot(path=str(tmp_path / "dashboard-e2e.png"), full_page=True)
    assert page.js_errors == []
