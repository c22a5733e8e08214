"""/dashboard and its scripts, served by the app from installed packages (no Ray, no browser)."""

import re
from importlib import resources

import pytest
from fastapi.testclient import TestClient

from deployment.ingress.api.dashboard_routes import ASSETS, JS_MEDIA_TYPE
from deployment.ingress.api.routes import create_api
from deployment.ingress.stats.mirror import StatsMirror
from deployment.settings import Settings
from tests.support.http_support import FakeEngine, FakeStats


@pytest.fixture(scope="module")
def client():
    api = create_api(FakeEngine(), StatsMirror(FakeStats()), Settings(model="random", dp=2, tp=1))
    with TestClient(api) as c:
        yield c


def _plotly_js() -> bytes:
    return resources.files("plotly").joinpath("package_data/plotly.min.js").read_bytes()


def test_dashboard_page_links_both_scripts_by_version(client):
    r = client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["cache-control"] == "no-cache"
    srcs = re.findall(r'<script src="([^"]+)"', r.text)
    assert [s.split("?")[0] for s in srcs] == ["dashboard/assets/plotly.min.js", "dashboard/assets/dashboard.js"]
    assert all(re.fullmatch(r"[^?]+\?v=[0-9a-f]{16}", s) for s in srcs), srcs
    assert "{{" not in r.text, "a placeholder was left in the page"
    for s in srcs:  # relative links: the page works under a route prefix too
        assert client.get("/" + s).status_code == 200


def test_plotly_is_served_from_the_installed_package(client):
    r = client.get("/dashboard/assets/plotly.min.js", headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200
    assert r.headers["content-type"] == JS_MEDIA_TYPE
    assert "immutable" in r.headers["cache-control"] and "max-age=31536000" in r.headers["cache-control"]
    assert "content-encoding" not in r.headers
    assert r.content == _plotly_js()
    assert b"plotly.js v" in r.content[:200]


def test_gzip_and_etag_revalidation(client):
    r = client.get("/dashboard/assets/plotly.min.js", headers={"Accept-Encoding": "gzip"})
    assert r.headers["content-encoding"] == "gzip" and r.headers["vary"] == "Accept-Encoding"
    assert r.content == _plotly_js()  # httpx decodes gzip
    assert int(r.headers["content-length"]) < len(_plotly_js()) / 2
    again = client.get("/dashboard/assets/plotly.min.js", headers={"If-None-Match": r.headers["etag"]})
    assert again.status_code == 304 and again.content == b""


def test_page_script_is_ours_and_unknown_assets_are_404(client):
    r = client.get("/dashboard/assets/dashboard.js")
    assert r.status_code == 200 and r.headers["content-type"] == JS_MEDIA_TYPE
    assert r.content == resources.files("deployment.ingress.api").joinpath("dashboard/dashboard.js").read_bytes()
    for name in ["nope.js", "..%2Froutes.py", "index.html"]:
        bad = client.get(f"/dashboard/assets/{name}")
        assert bad.status_code == 404 and bad.json()["error"]["code"] in ("unknown_asset", None), bad.text
    assert set(ASSETS) == {"dashboard.js", "plotly.min.js"}


def test_dashboard_routes_carry_no_data_and_are_documented(client):
    doc = client.get("/openapi.json").json()
    assert set(doc["paths"]["/dashboard"]["get"]["responses"]["200"]["content"]) == {"text/html"}
    assert set(doc["paths"]["/dashboard/assets/{name}"]["get"]["responses"]["200"]["content"]) == {"text/javascript"}
