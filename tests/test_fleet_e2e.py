"""The fleet view on the real Serve app with two engine replicas (its own app and engine id): every engine's
records reach the ingress's mirrors, and each engine's statistics are exactly conserved, as are the fleet's."""

import concurrent.futures as cf
import time

import httpx
import pytest

from deployment.client import StatsClient
from tests.e2e_fixtures import module_app, summed_counters

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.slow]

APP = "kvfleet-fleet"
ENGINE_ID = "fleete2e"
ENGINES = [f"{ENGINE_ID}-0", f"{ENGINE_ID}-1"]
SETTINGS = {"model": "random", "engine_id": ENGINE_ID, "engine_replicas": "2", "dp": "1", "tp": "1",
            "num_cpus_per_rank": "0.5", "max_seq_len": "256", "max_tokens_default": "8"}
COUNTERS = {"iterAllocTotalBlocks": "allocTotalBlocks", "iterReusedBlocks": "reusedBlocks",
            "iterMissedBlocks": "missedBlocks"}
DEADLINE_S = 120


app = module_app(APP, SETTINGS, "/fleet")


def _complete(url: str, i: int) -> None:
    body = {"prompt": f"tenant {i} warms the fleet's caches", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


def _summed(records: list[dict]) -> dict[str, int]:
    return summed_counters(records, COUNTERS)


def test_every_engine_serves_and_is_conserved(app):
    deadline = time.monotonic() + DEADLINE_S
    with StatsClient(app) as c:
        assert set(c.health()["engines"]) == set(ENGINES)
        served = 0
        # concurrent rounds until both replicas have stepped (Serve's router picks the replica)
        while not all(c.get_stats(engine=e, limit=1) for e in ENGINES):
            assert time.monotonic() < deadline, "an engine replica never stepped"
            with cf.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: _complete(app, i), range(served, served + 8)))
            served += 8
        # the requests are done: once each engine's cumulative stats are its newest record's, every record
        # has been mirrored (the mirror serves kv_cache_stats from its newest record)
        while True:
            fleet = c.kv_cache_stats()
            per = {e: _all(c, e) for e in ENGINES}
            if all(per[e] and per[e][-1]["kvCacheStats"] == fleet["engines"][e] for e in ENGINES):
                break
            assert time.monotonic() < deadline, "the mirrors never caught up"
            time.sleep(0.2)  # poll interval
        for e in ENGINES:
            assert {r["engineId"] for r in per[e]} == {e}
            assert [r["iter"] for r in per[e]] == list(range(per[e][0]["iter"], per[e][-1]["iter"] + 1))
            summed = _summed(per[e])
            assert summed == {k: fleet["engines"][e][k] for k in summed}, e  # exact, per engine
        merged = c.get_all_stats()
        assert sorted((r["engineId"], r["iter"]) for r in merged) == \
            sorted((e, r["iter"]) for e in ENGINES for r in per[e])
        fleet_sum = _summed(merged)
        assert fleet_sum == {k: fleet["fleet"][k] for k in fleet_sum}  # exact, for the fleet
        text = httpx.get(f"{app}/metrics", timeout=30).text
        for e in ENGINES:
            assert f'kvfleet_kv_cache_alloc_total_blocks_total{{engine="{e}"}}' in text
        assert "kvfleet_fleet_kv_cache_alloc_total_blocks_total" in text


def _all(c: StatsClient, engine: str) -> list[dict]:
    out, since = [], -1
    while page := c.get_stats(since=since, limit=1000, engine=engine):
        out.extend(page)
        since = page[-1]["iter"]
    return out
