"""vLLM's own Grafana dashboards (k8s/monitoring/vllm_*.json) against a real Prometheus server scraping the
session's app under traffic: every query of every panel returns data, except exactly the queries of the series
kvfleet cannot have (aggregator.vllm_names.UNFILLED, which docs/stats.md repeats)."""

import json
import math
import pathlib
import shutil
import time
import urllib.parse

import httpx
import pytest

from aggregator.vllm_names import unfilled_reason
from deployment.clients.loadgen import run_load
from tests.support.e2e_fixtures import instant_query, prometheus_server

pytestmark = pytest.mark.slow

DASHBOARDS = sorted((pathlib.Path(__file__).resolve().parents[2] / "k8s" / "monitoring").glob("vllm_*.json"))
# what Grafana puts in for the dashboards' variables: every job, model, instance and engine; the SLO defaults
VARIABLES = {"${datasource}": "", "$__rate_interval": "1m", "$__range": "5m", "$job": ".*", "$model_name": ".*",
             "$instance": ".*", "$engine": ".*", "$ttft_slo": "1.0", "$tpot_slo": "0.1"}


def panel_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) of every target, collapsed rows' panels included."""
    out = []
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            for t in p.get("targets", []):
                expr = t["expr"]
                for var, value in VARIABLES.items():
                    expr = expr.replace(var, value)
                out.append((p["title"], t["refId"], expr))
    return out


def _has_data(result: list[dict] | None) -> bool:
    return bool(result) and any(math.isfinite(float(r["value"][1])) for r in result)


def test_dashboards_are_vllms_two():
    assert [d.name for d in DASHBOARDS] == ["vllm_kv_cache.json", "vllm_overview.json"]
    for d in DASHBOARDS:
        assert all("$" not in q for _, _, q in panel_queries(json.loads(d.read_text()))), d  # every variable known


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus not installed (make tools)")
def test_every_panel_kvfleet_can_fill_has_data(serve_app, tmp_path):
    queries = [(d.stem, *q) for d in DASHBOARDS for q in panel_queries(json.loads(d.read_text()))]
    with prometheus_server(urllib.parse.urlparse(serve_app).netloc, tmp_path) as (base, proc):
        deadline = time.monotonic() + 30
        while not _has_data(instant_query(base, proc, 'up{job="kvfleet"} == 1')):
            assert time.monotonic() < deadline, "Prometheus never scraped the app"
            time.sleep(1.0)  # one scrape interval
        for seed in (11, 12):  # two rounds while it scrapes: shared prefixes reused, evicted and onboarded
            result = run_load(serve_app, requests=24, concurrency=8, prefixes=6, prefix_words=30, max_tokens=4,
                              seed=seed, progress=False, settle_s=3.0)
            assert result.failures == 0
        with httpx.Client(base_url=serve_app, timeout=30) as http:  # a client that leaves: an abort
            with http.stream("POST", "/v1/completions", json={"prompt": "tell me", "max_tokens": 8,
                                                              "stream": True}) as r:
                next(r.iter_lines())
        missing, deadline = queries, time.monotonic() + 30
        while True:
            missing = [q for q in missing
                       if not unfilled_reason(q[3]) and not _has_data(instant_query(base, proc, q[3]))]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(2.0)  # a few more scrapes
        assert not missing, "without data:\n" + "\n".join(f"{d} / {t} / {ref}: {q}" for d, t, ref, q in missing)
        filled = [q for q in queries if unfilled_reason(q[3]) and _has_data(instant_query(base, proc, q[3]))]
        assert not filled, f"UNFILLED lists series kvfleet has: {filled}"
