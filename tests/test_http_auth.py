"""API keys and refusals at the HTTP level (fake engine, real uvicorn): 401s, an open /health, the /metrics
scrape key, and the engine's refusals answered with their status and Retry-After, streamed or not."""

import httpx
import pytest

from deployment.auth import KeyCheck, load_keys
from deployment.settings import Settings
from tests.http_support import _assert_openai_error, serve_fake

KEYS = "key-one, key-two"
SCRAPE = "scrape-key"
DATA_ROUTES = [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
               ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
               ("GET", "/v1/models", None), ("GET", "/stats", None), ("GET", "/stats/ranks", None),
               ("GET", "/stats/ranks/0", None), ("GET", "/kv_cache_stats", None)]


@pytest.fixture(scope="module")
def keyed():
    yield from serve_fake(api_keys=KEYS, metrics_api_key=SCRAPE)


def _call(c: httpx.Client, method: str, path: str, body, key: str | None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return c.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize(("method", "path", "body"), DATA_ROUTES, ids=[p for _, p, _ in DATA_ROUTES])
def test_data_routes_need_one_of_the_keys(keyed, method, path, body):
    with httpx.Client(base_url=keyed.url, timeout=10) as c:
        err = _assert_openai_error(_call(c, method, path, body, None), 401, "missing_api_key")
        assert err["type"] == "authentication_error"
        assert _call(c, method, path, body, None).headers["www-authenticate"] == "Bearer"
        _assert_openai_error(_call(c, method, path, body, "key-three"), 401, "invalid_api_key")
        _assert_openai_error(_call(c, method, path, body, SCRAPE), 401, "invalid_api_key")
        wrong_scheme = c.request(method, path, json=body, headers={"Authorization": "Basic a2V5LW9uZQ=="})
        _assert_openai_error(wrong_scheme, 401, "missing_api_key")
        for key in ("key-one", "key-two"):
            assert _call(c, method, path, body, key).status_code == 200


def test_health_stays_open_and_metrics_take_the_scrape_key(keyed):
    with httpx.Client(base_url=keyed.url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        _assert_openai_error(c.get("/metrics"), 401, "missing_api_key")
        assert _call(c, "GET", "/metrics", None, SCRAPE).status_code == 200
        assert _call(c, "GET", "/metrics", None, "key-one").status_code == 200
        _assert_openai_error(_call(c, "GET", "/metrics", None, "nope"), 401, "invalid_api_key")
        with c.stream("GET", "/stats/stream") as resp:
            assert resp.status_code == 401
        doc = c.get("/openapi.json").json()
        assert "HTTPBearer" in doc["components"]["securitySchemes"]


def test_an_unkeyed_server_is_open(http):
    assert http.get("/kv_cache_stats").status_code == 200
    assert http.get("/metrics").status_code == 200


def test_keys_come_from_a_list_or_a_file(tmp_path):
    assert load_keys("") == () and load_keys(" a , b,,") == ("a", "b")
    f = tmp_path / "keys"
    f.write_text("# operators\nalpha\n\n beta \n")
    assert load_keys(f"@{f}") == ("alpha", "beta")
    (tmp_path / "empty").write_text("# none yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_keys(f"@{tmp_path / 'empty'}")
    with pytest.raises(ValueError, match="invalid kvfleet settings|No such file"):
        Settings(api_keys=f"@{tmp_path / 'missing'}")
    check = KeyCheck(("alpha", "beta"))
    assert check.accepts("beta") and not check.accepts("alph") and not check.accepts("")
    assert "alpha" not in repr(Settings(api_keys="alpha"))  # never in a log line


@pytest.mark.parametrize("stream", [False, True])
def test_refusals_are_status_codes_with_retry_after(http, stream):
    """Overload is 429 and no group up is 503, both with Retry-After, even for a stream (nothing started)."""
    for word, status, code in (("BUSY", 429, "overloaded"), ("UNAVAILABLE", 503, "engine_unavailable")):
        resp = http.post("/v1/completions", json={"prompt": f"{word} now", "max_tokens": 3, "stream": stream})
        _assert_openai_error(resp, status, code)
        assert int(resp.headers["retry-after"]) >= 1
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
