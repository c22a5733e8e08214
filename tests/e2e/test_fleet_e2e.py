"""The fleet view on the real Serve app with two engine replicas (its own app and engine id): every engine's
records reach the ingress's mirrors, and each engine's statistics are exactly conserved, as are the fleet's."""

import concurrent.futures as cf
import time

import httpx
import pytest

from deployment.clients.client import StatsClient
from tests.support.e2e_fixtures import completion_text, engine_records, module_app, summed_counters

pytestmark = pytest.mark.slow

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
        fleet, per, merged = _mirrored(c, deadline)
        for e in ENGINES:
            assert {r["engineId"] for r in per[e]} == {e}
            assert [r["iter"] for r in per[e]] == list(range(per[e][0]["iter"], per[e][-1]["iter"] + 1))
            summed = _summed(per[e])
            assert summed == {k: fleet["engines"][e][k] for k in summed}, e  # exact, per engine
        assert sorted((r["engineId"], r["iter"]) for r in merged) == \
            sorted((e, r["iter"]) for e in ENGINES for r in per[e])
        fleet_sum = _summed(merged)
        assert fleet_sum == {k: fleet["fleet"][k] for k in fleet_sum}  # exact, for the fleet
        text = httpx.get(f"{app}/metrics", timeout=30).text
        for e in ENGINES:
            assert f'kvfleet_kv_cache_alloc_total_blocks_total{{engine="{e}"}}' in text
        assert "kvfleet_fleet_kv_cache_alloc_total_blocks_total" in text


def _mirrored(c: StatsClient, deadline: float) -> tuple[dict, dict[str, list[dict]], list[dict]]:
    """(/kv_cache_stats, each engine's records, the merged stream) read as one consistent snapshot: every record
    is mirrored (each engine's cumulative stats are its newest record's) and no record came between the reads
    (the merged stream ends where each engine's does; the cumulative stats did not move). A record may come
    after the last response: the step that finished a request is recorded after its tokens are sent."""
    while True:
        fleet = c.kv_cache_stats()
        per = {e: engine_records(c, e) for e in ENGINES}
        merged = c.get_all_stats()
        newest = {e: max((r["iter"] for r in merged if r["engineId"] == e), default=None) for e in ENGINES}
        if c.kv_cache_stats() == fleet and all(
                per[e] and per[e][-1]["kvCacheStats"] == fleet["engines"][e] and per[e][-1]["iter"] == newest[e]
                for e in ENGINES):
            return fleet, per, merged
        assert time.monotonic() < deadline, "the mirrors never caught up"
        time.sleep(0.2)  # poll interval


def _fleet_routed(c: StatsClient) -> dict[str, list[int]]:
    """Per engine: the `routing.fleet` sums of every record (requests, predicted, realized), then the engine's
    own prediction for the same requests (`routing.predictedReusedBlocks`: every request here is the fleet's)."""
    out = {}
    for e in ENGINES:
        sums = [0, 0, 0, 0]
        for r in engine_records(c, e):
            f = r["routing"]["fleet"]
            for i, k in enumerate(("requests", "predictedReusedBlocks", "realizedReusedBlocks")):
                sums[i] += f[k]
            sums[3] += r["routing"]["predictedReusedBlocks"]
        out[e] = sums
    return out


def test_kv_routing_sends_a_shared_prefix_to_the_replica_holding_it(app):
    """fleet_routing=kv (the default with two replicas): once the router has seen a replica's blocks in its
    KV event stream, every request with that prefix goes there, with the dp group and the reuse it predicted."""
    prefix = "You are the billing assistant of tenant 42; answer briefly and politely. " * 2
    deadline = time.monotonic() + DEADLINE_S
    with StatsClient(app) as c:
        def ask(i: int) -> None:
            r = httpx.post(f"{app}/v1/completions", json={"prompt": prefix + f"question {i}?", "max_tokens": 4,
                                                          "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text

        def settled(n: int) -> dict[str, list[int]]:
            """The sums once the records of all `n` requests asked so far have reached the mirrors: a record
            that comes late would otherwise count in the wrong window."""
            routed = _fleet_routed(c)
            while sum(v[0] for v in routed.values()) < n:
                assert time.monotonic() < deadline, "the requests' records never came"
                time.sleep(0.2)  # poll interval: records reach the mirror after the request's first commit
                routed = _fleet_routed(c)
            return routed

        start = sum(v[0] for v in _fleet_routed(c).values())
        ask(0)
        before, i = settled(start + 1), 1
        while not any(after[1] > before[e][1] for e, after in settled(start + i).items()):  # a predicted hit
            assert time.monotonic() < deadline, "the router never predicted a hit"
            ask(i)
            i += 1
        before = settled(start + i)
        for j in range(i, i + 4):
            ask(j)
        after = settled(start + i + 4)
    gained = {e: [a - b for a, b in zip(after[e], before[e], strict=True)] for e in ENGINES}
    holder = max(gained, key=lambda e: gained[e][0])
    assert gained[holder][0] == 4 and all(gained[e][0] == 0 for e in ENGINES if e != holder), gained
    # the router's view one level up is the engine's own: the same prediction; the rank realizes at least that
    # (more: it also reuses the partial block past the last full one the prediction counts)
    assert gained[holder][1] == gained[holder][3] > 0, gained
    assert gained[holder][2] >= gained[holder][1], gained


def test_a_replica_killed_under_streaming_traffic_loses_no_request_and_the_fleet_is_conserved(app):
    import threading

    import ray

    prompts = [f"tenant {i} streams a long answer" for i in range(4)]
    body = {"max_tokens": 120, "temperature": 0, "ignore_eos": True}

    def complete(prompt: str, stream: bool, started: threading.Event | None = None) -> str:
        return completion_text(app, {**body, "prompt": prompt}, stream, started, timeout=240)

    expected = {p: complete(p, False) for p in prompts}
    with StatsClient(app) as c:
        before = c.kv_cache_stats()
    started = {p: threading.Event() for p in prompts}
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        runs = {p: pool.submit(complete, p, True, started[p]) for p in prompts}
        deadline = time.monotonic() + DEADLINE_S
        while not all(e.is_set() for e in started.values()):
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.1)  # poll interval
        victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith(f"SERVE_REPLICA::{APP}#KVFleetEngine"))
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
        got = {p: r.result() for p, r in runs.items()}
    assert got == expected  # every stream complete: no gap, no repeat (greedy), wherever it was
    deadline = time.monotonic() + 240
    with StatsClient(app) as c:
        last = {e: engine_records(c, e)[-1]["iter"] for e in ENGINES}
        served = 1000
        # the replaced replica serves again, as the same engine (its aggregator, its iterations going on)
        while not all(c.get_stats(engine=e, since=last[e], limit=1) for e in ENGINES):
            assert time.monotonic() < deadline, "the killed replica's engine never served again"
            with cf.ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda i: _complete(app, i), range(served, served + 4)))
            served += 4
        after = c.kv_cache_stats()
        for e in ENGINES:
            for k in ("allocTotalBlocks", "reusedBlocks", "missedBlocks"):
                assert after["engines"][e][k] >= before["engines"][e][k], (e, k)  # never backwards
        fleet, per, _ = _mirrored(c, deadline)  # conserved per engine once every record is mirrored
        for e in ENGINES:
            summed = _summed(per[e])
            assert summed == {k: fleet["engines"][e][k] for k in summed}, e


def _first_kv_event_id(url: str, engine: str) -> str:
    with httpx.stream("GET", f"{url}/kv_events", params={"engine": engine}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("id: "):
                return line[4:]
    raise AssertionError("no event")


def test_kv_events_serve_the_engine_named(app):
    """Several engines: /kv_events is one engine's stream, the one `?engine=` names, on every connect."""
    url = app
    r = httpx.get(f"{url}/kv_events", timeout=30)
    assert r.status_code == 400 and "engine" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/kv_events", params={"engine": "nope"}, timeout=30).status_code == 404
    for e in ENGINES:
        incarnations = {_first_kv_event_id(url, e).partition("-")[0] for _ in range(4)}
        assert len(incarnations) == 1, (e, incarnations)  # the same engine's stream each time
    first, second = (_first_kv_event_id(url, e).partition("-")[0] for e in ENGINES)
    assert first != second
