"""API keys: optional bearer-token authentication of the data routes.

`api_keys` (a comma-separated list, or `@path` to a file with one key per line, `#` comments allowed) guards
every route but /health and the dashboard page; `/metrics` also accepts `metrics_api_key`, so Prometheus can
scrape with its own bearer token. With no keys set every route is open. Keys are compared in constant time
(`hmac.compare_digest`, against every key) and never logged. FastAPI's `HTTPBearer` reads the header, so the
OpenAPI document states the scheme.
"""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from deployment.errors import APIError

_BEARER = HTTPBearer(auto_error=False, description="one of the API keys (`KVFLEET_API_KEYS`)")
_CREDENTIALS = Security(_BEARER)
_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def load_keys(spec: str) -> tuple[str, ...]:
    """The keys a setting names: `a,b,c`, or `@/path/file` (one per line); empty = none."""
    spec = spec.strip()
    if not spec.startswith("@"):
        return tuple(k.strip() for k in spec.split(",") if k.strip())
    path = Path(spec[1:]).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"API keys file {path}: {e.strerror or e}") from None
    keys = tuple(line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise ValueError(f"API keys file {path} holds no key")
    return keys


class KeyCheck:
    """A FastAPI dependency: passes when the request's bearer token is one of the keys (routes.py installs it
    only when keys are set)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = [k.encode() for k in keys]

    def accepts(self, token: str) -> bool:
        given = token.encode()
        ok = False
        for key in self._keys:  # every key, so the time does not say which one nearly matched
            ok |= hmac.compare_digest(key, given)
        return ok

    async def __call__(self, creds: HTTPAuthorizationCredentials | None = _CREDENTIALS) -> None:
        if creds is None:
            raise APIError(401, "this server needs an API key: send 'Authorization: Bearer <key>'",
                           code="missing_api_key", headers=_CHALLENGE)
        if not self.accepts(creds.credentials):
            raise APIError(401, "the API key is not valid", code="invalid_api_key", headers=_CHALLENGE)
