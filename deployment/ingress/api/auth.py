"""API keys: optional bearer-token authentication of every route but the open ones.

`api_keys` (a comma-separated list, or `@path` to a file with one key per line, `#` comments allowed, a UTF-8
BOM ignored) guards every route but OPEN_ROUTES: /health and the dashboard page and its scripts, which carry no
data (the page sends the key with its own data requests). /docs, /openapi.json and unknown paths need a key
too. The Prometheus paths (METRICS_ROUTES: `/metrics` and trtllm-serve's `/trtllm/prometheus/metrics`) also
accept `metrics_api_key`, so Prometheus can scrape with its own bearer token. With no keys set every route is
open.

KeyGuard is ASGI middleware, so the key is checked before anything reads the body: a request without a valid
key learns nothing of its body's validity. The token is taken as the bytes the client sent (Starlette would
decode them as latin-1) and compared with each key's UTF-8 bytes in constant time, against every key. Keys
are never logged.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from deployment.ingress.api.errors import APIError, error_response

OPEN_ROUTES = ("/health", "/dashboard", "/dashboard/assets/{name}")
METRICS_ROUTES = ("/metrics", "/trtllm/prometheus/metrics")  # the same Prometheus text: both take the scrape key
BEARER_SCHEME = {"type": "http", "scheme": "bearer", "description": "one of the API keys (`KVFLEET_API_KEYS`)"}
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def load_keys(spec: str) -> tuple[str, ...]:
    """The keys a setting names: `a,b,c`, or `@/path/file` (one per line); empty = none."""
    spec = spec.strip()
    if not spec.startswith("@"):
        return tuple(k.strip() for k in spec.split(",") if k.strip())
    path = Path(spec[1:]).expanduser()
    try:
        text = path.read_text(encoding="utf-8-sig")  # editors on Windows save a BOM before the first key
    except OSError as e:
        raise ValueError(f"API keys file {path}: {e.strerror or e}") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise ValueError(f"API keys file {path} holds no key")
    return keys


def is_open(path: str) -> bool:
    """Whether a route (a request path, or a path template of the OpenAPI document) needs no key."""
    return path in OPEN_ROUTES or path.startswith("/dashboard/assets/")


class KeyCheck:
    """Whether a bearer token is one of the keys (with none, `refusal` lets every request pass)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = [k.encode() for k in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def accepts(self, token: str | bytes) -> bool:
        given = token.encode() if isinstance(token, str) else token
        ok = False
        for key in self._keys:  # every key, so the time does not say which one nearly matched
            ok |= hmac.compare_digest(key, given)
        return ok

    def refusal(self, headers: list[tuple[bytes, bytes]]) -> APIError | None:
        """The 401 for a request with these (raw ASGI) headers, or None when it may pass."""
        if not self._keys:
            return None
        token = _bearer_token(headers)
        if token is None:
            return APIError(401, "this server needs an API key: send 'Authorization: Bearer <key>'",
                            code="missing_api_key", headers=_CHALLENGE)
        if not self.accepts(token):
            return APIError(401, "the API key is not valid", code="invalid_api_key", headers=_CHALLENGE)
        return None


def _bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of `Authorization: Bearer <token>` as the client's bytes; None without one."""
    value = next((v for k, v in headers if k.lower() == b"authorization"), b"")
    scheme, _, token = value.strip().partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


class KeyGuard:
    """Which keys each route takes; `wrap` is the ASGI middleware that answers 401 before any route runs."""

    def __init__(self, keys: tuple[str, ...], metrics_keys: tuple[str, ...]) -> None:
        self._data = KeyCheck(keys)
        self._metrics = KeyCheck(keys + metrics_keys)

    def __bool__(self) -> bool:
        return bool(self._metrics)

    def check_for(self, path: str) -> KeyCheck:
        """The keys a route takes (an empty KeyCheck when it is open)."""
        if is_open(path):
            return KeyCheck(())
        return self._metrics if path in METRICS_ROUTES else self._data

    def wrap(self, app: ASGIApp) -> ASGIApp:
        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                refusal = self.check_for(_route_path(scope)).refusal(scope["headers"])
                if refusal is not None:
                    await error_response(refusal)(scope, receive, send)
                    return
            await app(scope, receive, send)
        return guarded


def _route_path(scope: Scope) -> str:
    """The path below the app's mount point (Serve's route prefix is the ASGI root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path
