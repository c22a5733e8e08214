"""GET /dashboard: one HTML page of live charts over /stats/stream, and the two scripts it loads.

The charting library is plotly.js exactly as the `plotly` wheel ships it, read from the installed package (no
CDN: machines may be offline; no copy in this repository). Our own page is `deployment/ingress/api/dashboard/index.html`
and `dashboard.js`, package data. These routes carry no statistics, so they stay open when API keys are set:
the page sends the key with its own data requests. Scripts are named with a hash of their bytes in the page,
so a browser may keep them for a year and still never runs a stale one after an upgrade.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import hashlib
from dataclasses import dataclass
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from deployment.ingress.api.errors import APIError

JS_MEDIA_TYPE = "text/javascript; charset=utf-8"
ASSET_CACHE = "public, max-age=31536000, immutable"
# asset name -> (package, file inside it)
ASSETS = {
    "dashboard.js": ("deployment.ingress.api", "dashboard/dashboard.js"),
    "plotly.min.js": ("plotly", "package_data/plotly.min.js"),
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    gzipped: bytes  # plotly.min.js is 4.8 MB, 1.4 MB gzipped: compressed once per replica
    etag: str


@functools.cache
def load_asset(name: str) -> Asset:
    package, path = ASSETS[name]
    body = resources.files(package).joinpath(path).read_bytes()
    return Asset(body, gzip.compress(body, 6, mtime=0), f'"{hashlib.sha256(body).hexdigest()[:16]}"')


@functools.cache
def page_html() -> str:
    """index.html with each script's URL versioned by its ETag."""
    html = resources.files("deployment.ingress.api").joinpath("dashboard/index.html").read_text()
    for name in ASSETS:
        html = html.replace("{{" + name + "}}", f"dashboard/assets/{name}?v={load_asset(name).etag.strip(chr(34))}")
    return html


def dashboard_router() -> APIRouter:
    router = APIRouter(tags=["dashboard"])

    @router.get("/dashboard", response_class=HTMLResponse, responses={200: {
        "description": "the live dashboard page", "content": {"text/html": {"schema": {"type": "string"}}}}})
    async def dashboard() -> Response:
        html = await asyncio.to_thread(page_html)  # the first call reads and hashes plotly.min.js
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/assets/{name}", response_class=Response, responses={
        200: {"description": "a script of the page", "content": {"text/javascript": {"schema": {"type": "string"}}}},
        304: {"description": "the browser's copy is current (If-None-Match)"},
        404: {"description": "no such asset"}})
    async def asset(name: str, request: Request) -> Response:
        if name not in ASSETS:
            raise APIError(404, f"no dashboard asset {name!r}; there are {sorted(ASSETS)}", code="unknown_asset",
                           param="name")
        a = await asyncio.to_thread(load_asset, name)
        headers = {"Cache-Control": ASSET_CACHE, "ETag": a.etag, "Vary": "Accept-Encoding"}
        if request.headers.get("if-none-match") == a.etag:
            return Response(status_code=304, headers=headers)
        if "gzip" in request.headers.get("accept-encoding", ""):
            return Response(a.gzipped, media_type=JS_MEDIA_TYPE, headers={**headers, "Content-Encoding": "gzip"})
        return Response(a.body, media_type=JS_MEDIA_TYPE, headers=headers)

    return router
