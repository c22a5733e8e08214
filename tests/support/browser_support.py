"""Headless Chromium for the dashboard tests: Debian's chromium (`make tools`) driven by Playwright.

Playwright launches the system browser by path; it never downloads one of its own. Tests that ask for the
`browser` fixture are skipped, with the reason, when Playwright or chromium is missing.
"""

import os
import shutil

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    found = os.environ.get("KVFLEET_CHROMIUM")
    return found or next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip package playwright is not installed")
    path = chromium_path()
    if path is None:
        pytest.skip("no chromium on PATH (`make tools` installs Debian's chromium)")
    with sync_api.sync_playwright() as p:
        # --no-sandbox: the tests run as root in CI, where Chromium's sandbox refuses to start
        b = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.js_errors = errors  # the test asserts none happened
    yield pg
    context.close()


def dashboard_state(page) -> dict:
    """What the page's script holds (window.kvDashboard), without the records themselves."""
    return page.evaluate("""() => { const s = window.kvDashboard;
        return {received: s.received, firstIter: s.firstIter, lastId: s.lastId, duplicates: s.duplicates,
                connects: s.connects, resets: s.resets, live: s.live,
                records: s.records.length, redraws: s.redraws, incomplete: s.incomplete, views: [...s.views]}; }""")


def chart_points(page, chart_id: str) -> list[int]:
    """How many points each trace of a Plotly chart holds (from the library's own graph div)."""
    return page.evaluate("(id) => (document.getElementById(id).data || []).map(t => (t.x || []).length)", chart_id)
