"""End to end on one Serve app: the official openai client, /stats invariants, SSE resume, Prometheus, bad input.

The app runs the built-in model with dp=2, tp=1 on CPU (e2e_fixtures.E2E_SETTINGS); requests are few and
short. Stats arrive asynchronously (ranks -> aggregator), so checks poll with a deadline.
"""

import json
import shutil
import subprocess
import time
import urllib.parse

import httpx
import pytest

from deployment.clients.client import StatsClient
from deployment.clients.loadgen import run_load
from deployment.ingress.sse import SSEDecoder
from tests.support.e2e_fixtures import prometheus_query, summed_counters

pytestmark = pytest.mark.slow

MODEL = "kvfleet-tiny"
COUNTERS = {"iterAllocTotalBlocks": "allocTotalBlocks", "iterAllocNewBlocks": "allocNewBlocks",
            "iterReusedBlocks": "reusedBlocks", "iterMissedBlocks": "missedBlocks"}
REUSED_METRIC = "kvfleet_kv_cache_reused_blocks_total"


def _poll(check, timeout_s: float, what: str, interval_s: float = 0.3):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        ok, last = check()
        if ok:
            return last
        time.sleep(interval_s)  # poll interval
    raise AssertionError(f"{what} not reached in {timeout_s}s; last: {last}")


def _summed(records: list[dict]) -> dict[str, int]:
    return summed_counters(records, COUNTERS)


def _consistent(url: str) -> tuple[bool, tuple]:
    with StatsClient(url) as c:
        cum = c.kv_cache_stats()
        records = c.get_all_stats()
    summed = _summed(records)
    ok = bool(records) and all(summed[k] == cum[k] for k in summed) and records[-1]["kvCacheStats"] == cum
    return ok, (summed, {k: cum[k] for k in summed}, records[-1]["kvCacheStats"] if records else None)


@pytest.fixture(scope="module")
def oai(serve_app):  # noqa: F811
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{serve_app}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_completion(oai):
    r = oai.completions.create(model=MODEL, prompt="The KV cache", max_tokens=4, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert isinstance(r.choices[0].text, str) and r.choices[0].finish_reason in ("length", "stop")
    assert 1 <= r.usage.completion_tokens <= 4 and r.usage.prompt_tokens > 0
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_openai_chat_completion(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                    max_tokens=4, temperature=0)
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 4


def test_openai_streaming_matches_non_streaming(oai):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "stream me"}], max_tokens=5,
                  temperature=0)
    whole = oai.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(oai.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert text == whole, "greedy streaming and non-streaming disagree"
    pieces = list(oai.completions.create(model=MODEL, prompt="abc", max_tokens=3, temperature=0, stream=True))
    assert pieces[-1].choices[0].finish_reason in ("length", "stop")


def test_stats_counters_sum_to_cumulative_and_readers_agree(serve_app):
    # byte tokenizer: ~100-token prompts (max_seq_len 256) sharing 2 prefixes of ~5 blocks
    result = run_load(serve_app, requests=12, concurrency=4, prefixes=2, prefix_words=12, max_tokens=4,
                      progress=False)
    assert result.failures == 0
    assert result.reused_blocks > 0, "a shared-prefix workload produced no reuse"
    _poll(lambda: _consistent(serve_app), 60, "sum of iteration counters == cumulative kv_cache_stats")
    with StatsClient(serve_app) as a, StatsClient(serve_app) as b:
        ra, rb = a.get_all_stats(), b.get_all_stats()
    n = min(len(ra), len(rb))
    assert n > 0 and ra[:n] == rb[:n], "two readers saw different records"
    iters = [r["iter"] for r in ra]
    assert iters == sorted(set(iters))
    rec = ra[-1]
    assert rec["numRanks"] == 2 and rec["engineId"]


def test_default_cache_shows_reuse_and_offload_under_loadgen_traffic(serve_app):
    # 8 shared prefixes of ~13 blocks: more than one rank's demo-sized primary tier holds, so blocks are
    # evicted to the host tier; the shared prefixes are reused.
    result = run_load(serve_app, requests=32, concurrency=8, prefixes=8, prefix_words=30, max_tokens=4,
                      seed=1, progress=False)
    assert result.failures == 0
    assert result.reused_blocks > 0 and 0 < result.hit_rate < 1
    assert result.offloaded_blocks > 0, result


def test_sse_resumes_after_last_event_id_without_gap(serve_app):
    with StatsClient(serve_app) as c:
        if len(c.get_all_stats()) < 4:
            run_load(serve_app, requests=4, concurrency=2, prefixes=1, prefix_words=10, max_tokens=3,
                     progress=False)
        records = _poll(lambda: ((r := c.get_all_stats()), len(r) >= 4)[::-1], 60, "4 records")
    iters = [r["iter"] for r in records]
    with httpx.Client(base_url=serve_app, timeout=30) as http:
        first = _read_stats_events(http, {}, 2)
        assert [int(e.id) for e in first] == iters[:2]
        resumed = _read_stats_events(http, {"Last-Event-ID": first[-1].id}, 2)
    assert [json.loads(e.data)["iter"] for e in resumed] == iters[2:4], "resume skipped or repeated records"
    assert [int(e.id) for e in resumed] == iters[2:4]


def _read_stats_events(http: httpx.Client, headers: dict, n: int) -> list:
    out, dec = [], SSEDecoder()
    with http.stream("GET", "/stats/stream", headers=headers) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            ev = dec.feed(line)
            if ev is not None and ev.event == "stats":
                out.append(ev)
                if len(out) == n:
                    break
    return out


def test_iter_stats_client_follows_new_records(serve_app):
    with StatsClient(serve_app) as c:
        start = c.latest_iter()
        it = c.iter_stats(since=start)
        httpx.post(f"{serve_app}/v1/completions", json={"prompt": "follow", "max_tokens": 2}, timeout=60)
        first = next(it)
        it.close()
    assert first["iter"] > start


def test_ranks_health_and_kv_cache_stats(serve_app):
    with StatsClient(serve_app) as c:
        assert c.health()["status"] == "ok"
        ranks = _poll(lambda: ((r := c.ranks()), all(r[k]["record"] for k in ("0", "1")))[::-1], 30,
                      "both ranks reported")
        assert c.rank(1)["dp_rank"] == 1 and ranks["0"]["tp_rank"] == 0
        assert set(c.kv_cache_stats()) >= {"maxNumBlocks", "reusedBlocks", "missedBlocks", "cacheHitRate"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (make tools)")
def test_metrics_pass_promtool(serve_app):
    r = httpx.get(f"{serve_app}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert REUSED_METRIC in r.text
    check = subprocess.run(["promtool", "check", "metrics"], input=r.text, capture_output=True, text=True,
                           timeout=60)
    # the one lint promtool has against vLLM's own names (kept exactly, for vLLM's dashboards): their colons,
    # and vllm:iteration_tokens_total, a histogram named like a counter. Anything else (or a parse error) fails.
    problems = [line for line in (check.stdout + check.stderr).splitlines() if line.strip()]
    vllm_lint = ("metric names should not contain ':'", 'non-counter metrics should not have "_total" suffix')
    assert all(line.startswith("vllm:") and line.endswith(vllm_lint) for line in problems), problems
    assert check.returncode in (0, 3), check.stdout + check.stderr  # 3: lint problems only


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (make tools)")
def test_prometheus_scrapes_and_answers_promql(serve_app, tmp_path):
    target = urllib.parse.urlparse(serve_app).netloc
    result = prometheus_query(target, f"sum({REUSED_METRIC})", tmp_path)
    value = float(result[0]["value"][1])
    with StatsClient(serve_app) as c:
        assert 0 <= value <= c.kv_cache_stats()["reusedBlocks"]


BAD = [
    ("invalid json", "POST", "/v1/completions", b'{"prompt": ', 400),
    ("prompt too long", "POST", "/v1/completions", {"prompt": "x" * 400, "max_tokens": 2}, 400),
    ("negative max_tokens", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400),
    ("absurd max_tokens", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400),
    ("token id out of vocab", "POST", "/v1/completions", {"prompt": [1, 10**9], "max_tokens": 2}, 400),
    ("unknown model", "POST", "/v1/chat/completions",
     {"model": "/models/other", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("bad since", "GET", "/stats?since=-9", None, 400),
    ("bad limit", "GET", "/stats?limit=abc", None, 400),
    ("unknown rank", "GET", "/stats/ranks/99", None, 404),
]


def _send(http: httpx.Client, method: str, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.request(method, path, content=body, headers={"content-type": "application/json"})
    return http.request(method, path, json=body)


def test_bad_input_is_rejected_before_any_rank_and_loses_nothing(serve_app):
    with httpx.Client(base_url=serve_app, timeout=60) as http, StatsClient(serve_app) as c:
        _poll(lambda: _consistent(serve_app), 60, "stats settled before the bad requests")
        before_iter, before_stats = c.latest_iter(), c.kv_cache_stats()
        for name, method, path, body, status in BAD:
            r = _send(http, method, path, body)
            assert r.status_code == status, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert err["message"] and "type" in err and "code" in err, (name, err)
        # no bad request ran an engine step: no new record, no counter moved
        assert c.latest_iter() == before_iter and c.kv_cache_stats() == before_stats
        for name, method, path, body, status in BAD:
            assert _send(http, method, path, body).status_code == status, name
            ok = http.post("/v1/completions", json={"prompt": f"fine after {name}", "max_tokens": 2})
            assert ok.status_code == 200, (name, ok.text)
        assert http.get("/health").status_code == 200
    _poll(lambda: _consistent(serve_app), 60, "sum of counters == cumulative after the bad requests")
