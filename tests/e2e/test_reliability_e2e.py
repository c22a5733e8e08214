"""Faults on the real Serve app (its own app and engine id, so the shared e2e app is never disturbed): a rank
killed mid-generation, the engine's only replica killed under streaming traffic (every request re-sent by the
ingress) and killed idle, an ingress replica killed mid-stream (every stream resumed by the client), and a
graceful shutdown that leaves no rank or placement group behind. Ordered: the last test deletes the app."""

import concurrent.futures as cf
import threading
import time

import httpx
import pytest
import ray

from deployment.clients.client import stream_completion
from tests.support.e2e_fixtures import completion_text, module_app
from tests.support.http_support import all_stats

pytestmark = pytest.mark.slow

APP = "kvfleet-rel"
ENGINE_ID = "rel"
SETTINGS = {"model": "random", "engine_id": ENGINE_ID, "dp": "2", "num_cpus_per_rank": "0.5", "max_seq_len": "512",
            "restart_backoff_s": "0.2",
            # a re-sent request waits this long for the new engine replica, whose start took 15-30 s on 2 shared cores
            "placement_timeout_s": "120"}
BODY = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
PROMPTS = [f"the cache of tenant {i} is warm" for i in range(4)]
RECOVERY_S = 180


app = module_app(APP, SETTINGS, "/rel")


def _named(prefix: str) -> list[dict]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def _actor(prefix: str):
    """The first live actor whose name starts with `prefix`. A test that kills it mid-stream looks it up before
    its requests start: listing the cluster's named actors can take seconds on 2 busy cores, long enough for the
    streams meant to be cut to end first."""
    actor = _named(prefix)[0]
    return ray.get_actor(actor["name"], namespace=actor["namespace"])


def _kill(prefix: str) -> None:
    ray.kill(_actor(prefix), no_restart=True)


def _complete(url: str, prompt: str, stream: bool, started: threading.Event | None = None, **extra) -> str:
    """The completion's text; `started` is set at its first streamed text chunk."""
    return completion_text(url, {**BODY, **extra, "prompt": prompt}, stream, started)


def _until(what: str, cond, timeout_s: float = RECOVERY_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)  # poll interval: the app recovers on its own time
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def test_a_rank_killed_mid_generation_leaves_every_answer_complete(app):
    expected = [_complete(app, p, stream=False) for p in PROMPTS]
    rank = _actor(f"kvfleet-rank-{ENGINE_ID}-1-")
    with cf.ThreadPoolExecutor(8) as pool:
        runs = [pool.submit(_complete, app, p, stream) for p in PROMPTS for stream in (False, True)]
        _until("a request running", lambda: _health(app)["engine"]["running"] >= 2, 60)
        ray.kill(rank, no_restart=True)
        got = [r.result() for r in runs]
    assert got == [e for e in expected for _ in (0, 1)]  # streamed and not: no gap, no repeat
    _until("group 1 back in service", lambda: _health(app)["engine"]["down_groups"] == {})
    groups = _health(app)["engine"]["groups"]
    assert groups["1"]["restarts"] == 1 and groups["1"]["up"]
    with httpx.Client(base_url=app, timeout=10) as http:
        records = all_stats(http)  # /stats pages: the group's outage may be past the first page
    assert any(r["missingRanks"] == [1] for r in records)
    assert records[-1]["complete"] or _complete(app, PROMPTS[0], stream=False) == expected[0]


def test_the_engine_replica_killed_under_streaming_traffic_loses_no_request(app):
    """ONE engine replica: its in-flight requests wait for the replica Serve starts in its place, and go on from
    prompt + tokens so far there (deployment/ingress/resend.py)."""
    samplings = [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}]  # greedy (BODY's temperature 0), seeded
    cases = [(p, i, stream) for p in PROMPTS[:2] for i in range(len(samplings)) for stream in (False, True)]
    extra = {"max_tokens": 160}  # long enough to be still streaming when the replica dies
    expected = {(p, i): _complete(app, p, False, **extra, **samplings[i]) for p, i, _ in cases}
    started = {c: threading.Event() for c in cases if c[2]}
    engine = _actor(f"SERVE_REPLICA::{APP}#KVFleetEngine")
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        runs = {c: pool.submit(_complete, app, c[0], c[2], started.get(c), **extra, **samplings[c[1]])
                for c in cases}
        _until("every stream's first tokens", lambda: all(e.is_set() for e in started.values()), 60)
        t_kill = time.monotonic()
        ray.kill(engine, no_restart=True)
        in_flight = sum(not r.done() for r in runs.values())
        got = {c: r.result() for c, r in runs.items()}
        took = time.monotonic() - t_kill
    print(f"engine replica killed with {in_flight}/{len(cases)} requests in flight: all done {took:.1f} s later")
    assert in_flight >= len(started), "the requests finished before the kill: make them longer"
    assert got == {c: expected[c[:2]] for c in cases}  # no gap, no repeat, seeded and greedy, streamed and not
    assert took < RECOVERY_S


def test_the_engine_replica_killed_is_replaced_and_the_counters_go_on(app):
    """The replica Serve starts in its place takes the dead one's rank actors over (engine/ranks.py): the same
    actors, their KV cache still holding what was served before the kill."""
    before = httpx.get(f"{app}/kv_cache_stats", timeout=10).json()
    with httpx.Client(base_url=app, timeout=10) as http:
        last_iter = all_stats(http)[-1]["iter"]
    ranks_before = {a["name"] for a in _named(f"kvfleet-rank-{ENGINE_ID}-")}
    t_kill = time.monotonic()
    _kill(f"SERVE_REPLICA::{APP}#KVFleetEngine")
    statuses = []

    def served() -> bool:
        r = httpx.post(f"{app}/v1/completions", json={**BODY, "prompt": PROMPTS[1], "max_tokens": 4}, timeout=60)
        statuses.append(r.status_code)
        if r.status_code != 200:
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
            assert httpx.get(f"{app}/stats?limit=1", timeout=10).status_code == 200  # statistics still served
        return r.status_code == 200

    _until("a new engine replica serving", served)
    print(f"engine replica killed idle: serving again {time.monotonic() - t_kill:.1f} s later ({statuses})")
    assert {a["name"] for a in _named(f"kvfleet-rank-{ENGINE_ID}-")} == ranks_before  # adopted, not restarted
    # the first request after it found its prompt cached (its record reaches the ingress's mirror a moment after
    # the answer: the aggregator's long poll gathers records for up to LINGER_S while they come fast)
    def reused() -> dict | None:
        now = httpx.get(f"{app}/kv_cache_stats", timeout=10).json()
        return now if now["reusedBlocks"] > before["reusedBlocks"] else None

    after = _until("the first request's reuse in /kv_cache_stats", reused, timeout_s=10)
    for key in ("allocTotalBlocks", "reusedBlocks", "missedBlocks"):
        assert after[key] >= before[key], key
    new = httpx.get(f"{app}/stats?since={last_iter}", timeout=10).json()
    assert new and new[0]["iter"] > last_iter
    assert _health(app)["aggregator"]["epoch"] == 1  # the detached aggregator lived through it
    # in its fixed namespace, so an operator's driver (or a new replica in any namespace) finds it by name
    assert ray.get(ray.get_actor(f"kvfleet-stats-{ENGINE_ID}", namespace="kvfleet").health.remote()).ok


def test_an_ingress_replica_killed_mid_stream_loses_no_stream_and_the_engine_goes_on(app):
    """The streams the ingress replica carried are cut (Serve's proxy relays its bytes); the client resumes each
    with Last-Event-ID on the replica Serve starts in its place and reads the stream it would have read."""
    samplings = [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 7}]  # greedy (BODY's temperature 0), seeded
    # long enough to be still streaming when the replica dies: at 160 tokens most streams had ended by then
    extra = {"max_tokens": 400}
    cases = [(p, i) for p in PROMPTS[2:] for i in range(len(samplings))]
    expected = {c: _complete(app, c[0], False, **extra, **samplings[c[1]]) for c in cases}
    steps = _health(app)["engine"]["steps"]
    ingress = _actor(f"SERVE_REPLICA::{APP}#KVFleetIngress")
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        runs = {c: pool.submit(stream_completion, app, {**BODY, **extra, **samplings[c[1]], "prompt": c[0]},
                               give_up_s=RECOVERY_S) for c in cases}
        _until("every stream running", lambda: _health(app)["engine"]["running"] >= len(cases), 60)
        t_kill = time.monotonic()
        ray.kill(ingress, no_restart=True)
        got = {c: r.result() for c, r in runs.items()}
        took = time.monotonic() - t_kill
    resumed = sum(g.resumed for g in got.values())
    print(f"ingress replica killed: {resumed} streams resumed, all done {took:.1f} s later")
    assert resumed >= 1, "no stream was cut: the requests finished before the kill"
    assert {c: g.text for c, g in got.items()} == expected  # no gap, no repeat, greedy and seeded
    assert all(len({ch["id"] for ch in g.chunks}) == 1 for g in got.values())  # one response each
    health = _health(app)["engine"]
    assert health["steps"] > steps and all(g["restarts"] <= 1 for g in health["groups"].values())


def test_a_graceful_shutdown_finishes_in_flight_requests_and_removes_every_rank(app):
    from ray import serve

    with cf.ThreadPoolExecutor(2) as pool:
        # long enough to be still running at a poll: 40 tokens of the random model can finish between two
        run = pool.submit(_complete, app, PROMPTS[3], False, max_tokens=160)
        _until("the request running", lambda: _health(app)["engine"]["running"] >= 1, 60)
        t0 = time.monotonic()
        serve.delete(APP)
        took = time.monotonic() - t0
        assert run.result()  # finished, not cut
    assert took < 60, took
    assert not _named(f"kvfleet-rank-{ENGINE_ID}-")
    left = [pg for pg in ray.util.placement_group_table().values()
            if (pg.get("name") or "").startswith(f"kvfleet-{ENGINE_ID}-dp") and pg["state"] != "REMOVED"]
    assert not left, left
