"""Simulated GPU ranks (`model=simulated`) behind the real Serve app: two engine replicas routed by `kv`, a
Mooncake-format trace replayed over HTTP, the same tokens wherever a prompt runs, the router on /metrics."""

import asyncio
import json

import httpx
import pytest

from deployment.clients.client import StatsClient
from deployment.clients.trace import read_trace, replay, summary
from tests.support.e2e_fixtures import module_app

pytestmark = pytest.mark.slow

SETTINGS = {"model": "simulated", "engine_id": "sime2e", "engine_replicas": "2", "dp": "1", "tp": "1",
            "fleet_routing": "kv", "num_cpus_per_rank": "0.1", "max_seq_len": "2048", "host_cache_bytes": "0",
            "simulated_speedup_ratio": "1.0",
            # Ray actor calls for the token streams: the other e2e apps take the default (Serve's gRPC transport)
            "token_transport": "actor_calls"}

app = module_app("kvfleet-simulated", SETTINGS, "/simulated")


def test_a_trace_replays_on_simulated_replicas(app, tmp_path):
    # 4 conversations of 4 turns: each turn's prompt extends its conversation's (Mooncake's hash ids)
    rows = [{"timestamp": 50 * (4 * turn + c), "input_length": 512 * (turn + 1), "output_length": 64,
             "hash_ids": [100 * c + k for k in range(turn + 1)]} for turn in range(4) for c in range(4)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    requests = read_trace(trace, scale=0.25)
    with StatsClient(app) as stats:
        before = stats.reuse_counts()
        got = asyncio.run(replay(app, requests, concurrency=4, progress=False))
        s = summary(got)
        assert s["failed"] == 0, [r.error for r in got.results if r.error]
        assert [r.output_tokens for r in got.results] == [16] * 16
        assert all(r.prompt_tokens >= len(q.prompt) for r, q in zip(got.results, requests, strict=True))
        reused = stats.reuse_counts()[0] - before[0]
        assert reused > 0  # later turns found their conversation's blocks
        per_engine, (predicted, realized) = stats.routing_summary()
    assert set(per_engine) == {"sime2e-0", "sime2e-1"}
    assert predicted > 0 and realized > 0
    text = httpx.get(f"{app}/metrics", timeout=30).text
    assert 'kvfleet_router_decision_seconds{ingress="' in text
    follows = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("kvfleet_router_follow_calls_total{")]
    assert follows and follows[0] > 0


def test_a_prompt_gets_the_same_tokens_whatever_the_sampler_or_salt(app):
    body = {"prompt": "the same prompt, wherever it runs", "max_tokens": 24, "ignore_eos": True}
    texts = set()
    for temperature in (0.0, 0.8, 1.5):  # the simulated logits have one clear maximum: any sampler picks it
        for salt in ("a", "b", "c"):  # salted apart: no shared blocks draw them to one replica
            r = httpx.post(f"{app}/v1/completions", json={**body, "temperature": temperature, "cache_salt": salt},
                           timeout=60)
            assert r.status_code == 200, r.text
            texts.add(r.json()["choices"][0]["text"])
    assert len(texts) == 1 and len(texts.pop()) == 24
