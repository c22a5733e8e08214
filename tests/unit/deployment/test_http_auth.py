"""API keys and refusals at the HTTP level (fake engine, real uvicorn): 401s before the body is read, the open
routes, the /metrics scrape key, and the engine's refusals answered with their status and Retry-After,
streamed or not."""

from pathlib import Path

import httpx
import pytest

from deployment.ingress.api.auth import OPEN_ROUTES, KeyCheck, load_keys
from deployment.settings import Settings
from tests.support.http_support import _assert_openai_error, serve_fake

KEYS = "key-one, key-two, café-clé"
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


@pytest.mark.parametrize("path", ["/metrics", "/trtllm/prometheus/metrics"])
def test_both_prometheus_paths_take_the_scrape_key(keyed, path):
    """The trtllm-serve path serves the same text, so a scrape job may use either (it once took data keys only)."""
    with httpx.Client(base_url=keyed.url, timeout=10) as c:
        assert _call(c, "GET", path, None, SCRAPE).status_code == 200
        assert _call(c, "GET", path, None, "key-one").status_code == 200
        _assert_openai_error(_call(c, "GET", path, None, None), 401, "missing_api_key")
        _assert_openai_error(_call(c, "GET", path, None, "nope"), 401, "invalid_api_key")
        records = _call(c, "GET", "/trtllm/metrics", None, SCRAPE)  # the records stay behind the data keys
        _assert_openai_error(records, 401, "invalid_api_key")


def test_a_keyless_request_is_refused_before_its_body_is_read(keyed):
    """A bad body is a 401 without a key (it learns nothing of the body), a 400 with one."""
    with httpx.Client(base_url=keyed.url, timeout=10) as c:
        bad = {"content": b"{not json", "headers": {"content-type": "application/json"}}
        _assert_openai_error(c.post("/v1/completions", **bad), 401, "missing_api_key")
        bad["headers"]["Authorization"] = "Bearer key-one"
        _assert_openai_error(c.post("/v1/completions", **bad), 400, "invalid_json")


def test_only_the_open_routes_answer_without_a_key(keyed):
    open_paths = [p.replace("{name}", "dashboard.js") for p in OPEN_ROUTES]
    with httpx.Client(base_url=keyed.url, timeout=10) as c:
        for path in open_paths:
            assert c.get(path).status_code == 200, path
        for path in ("/openapi.json", "/docs", "/nowhere", "/dashboard/other", "/health/x"):
            _assert_openai_error(c.get(path), 401, "missing_api_key")
        doc = _call(c, "GET", "/openapi.json", None, "key-one").json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for path, ops in doc["paths"].items():
        keyed_route = path not in OPEN_ROUTES
        assert ("security" in ops["get" if "get" in ops else "post"]) == keyed_route, path


def test_the_docs_list_the_open_routes_as_the_code_does():
    root = Path(__file__).resolve().parents[3]
    said = "open routes: " + ", ".join(f"`{p}`" for p in OPEN_ROUTES)
    assert said in Settings.model_fields["api_keys"].description  # and so in the README's settings table
    for doc in ("README.md", "docs/http-api.md", "k8s/README.md"):
        assert said in " ".join(root.joinpath(doc).read_text().split()), doc


def test_a_non_ascii_key_is_matched_on_its_utf8_bytes(keyed):
    with httpx.Client(base_url=keyed.url, timeout=10) as c:
        good = c.get("/v1/models", headers={"Authorization": "Bearer café-clé".encode()})
        assert good.status_code == 200
        latin1 = c.get("/v1/models", headers={"Authorization": "Bearer café-clé".encode("latin-1")})
        _assert_openai_error(latin1, 401, "invalid_api_key")


def test_an_unkeyed_server_is_open(http):
    assert http.get("/kv_cache_stats").status_code == 200
    assert http.get("/metrics").status_code == 200


def test_keys_come_from_a_list_or_a_file(tmp_path):
    assert load_keys("") == () and load_keys(" a , b,,") == ("a", "b")
    f = tmp_path / "keys"
    f.write_text("# operators\nalpha\n\n beta \n")
    assert load_keys(f"@{f}") == ("alpha", "beta")
    f.write_text("alpha\nbeta\n", encoding="utf-8-sig")  # a BOM, as Windows editors save
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
