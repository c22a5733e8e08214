"""The nodes that hold the statistics aggregator and the engine's Serve replica, lost under streaming traffic, on a
real multi-node Ray cluster (tests/support/multinode_support.py). On KubeRay both run on the head (`engine_resource`);
here they are put on worker nodes on purpose, to prove what happens when a node that holds them goes:

    head (0 CPUs, kvfleet_control: the ingress)   a (2 CPUs, kvfleet_engine: the engine replica)
                                                  b (2 CPUs, kvfleet_agg: the aggregator, made here first)

Ordered: the aggregator's node first (the engine lives on and replays what was not acknowledged), then the
engine replica's (the ingress re-sends its requests, prompt + tokens so far, to the replica Serve starts).
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from tests.multinode.test_multinode import BODY, COUNTERS, SAMPLINGS
from tests.support import multinode_support as mns
from tests.support.e2e_fixtures import summed_counters
from tests.support.http_support import all_stats

pytestmark = pytest.mark.slow

ENGINE_ID = "mnf"
ENGINE_RES, AGG_RES = "kvfleet_engine", "kvfleet_agg"
SETTINGS = {"model": "random", "engine_id": ENGINE_ID, "dp": "2", "tp": "2", "num_cpus_per_rank": "1",
            "max_seq_len": "256", "restart_backoff_s": "0.2", "placement_timeout_s": "180",
            "ingress_resource": mns.CONTROL, "engine_resource": ENGINE_RES}
RECOVERY_S = 180


@pytest.fixture(scope="module")
def mn():
    cluster = mns.start({"a": (2, {ENGINE_RES: 1}), "b": (2, {AGG_RES: 1})})
    try:
        from aggregator import get_or_create_aggregator

        # the engine attaches to an aggregator of its id if one runs: this one on node b, apart from the engine
        get_or_create_aggregator(ENGINE_ID, 4, 2, resource=AGG_RES, lifetime="detached")
        mns.serve(cluster, "mnf", SETTINGS)
        httpx.get(f"{cluster.url}/stats", timeout=30)  # the ingress's mirror follows from the first record on
        yield cluster
    finally:
        mns.shutdown(cluster)


def _cases() -> list[tuple[str, int, bool]]:
    return [(f"tenant {t} streams through a fault", s, stream) for t in range(2) for s in range(2)
            for stream in (0, 1)]


def _run(url: str, case: tuple[str, int, bool]) -> str:
    prompt, s, stream = case
    return mns.complete(url, prompt, bool(stream), **{**BODY, "max_tokens": 160, **SAMPLINGS[s]})[0]


def _cumulative(url: str) -> dict:
    return httpx.get(f"{url}/kv_cache_stats", timeout=10).json()


def _lose_under_traffic(mn, node: str) -> float:
    """Node `node` removed while every case streams; every answer as before the loss. Seconds from the loss to
    every request served."""
    expected = {c: _run(mn.url, c) for c in _cases()}
    with cf.ThreadPoolExecutor(len(expected)) as pool:
        runs = {c: pool.submit(_run, mn.url, c) for c in expected}
        mns.until("requests running", lambda: mns.health(mn.url)["engine"]["running"] >= 4, 60)
        t_loss = mn.remove(node)
        in_flight = sum(not r.done() for r in runs.values())
        got = {c: r.result() for c, r in runs.items()}
        served = time.monotonic() - t_loss
    assert in_flight >= 4, "the requests finished before the loss: make them longer"
    assert got == expected  # no gap, no repeat: greedy and seeded, streamed and not
    return served


def _exact(url: str) -> list[dict]:
    """Every record the ingress's mirror holds (the whole run), in order, each iteration once, no tp divergence,
    and the conservation law against the cumulative counters."""
    with httpx.Client(base_url=url, timeout=30) as http:
        want = mns.health(url)["engine"]["iteration"] - 1
        records = mns.until("the mirror caught up", lambda: (r := all_stats(http)) and r[-1]["iter"] >= want and r,
                            60)
        cumulative = http.get("/kv_cache_stats").json()
    iters = [r["iter"] for r in records]
    assert iters == sorted(set(iters))  # no iteration counted twice
    assert all(not r["tpDivergence"] for r in records)
    assert iters == list(range(iters[0], iters[-1] + 1)) and iters[0] <= 1  # the whole run, no gap
    assert summed_counters(records, COUNTERS) == {k: cumulative[k] for k in COUNTERS.values()}
    return records


def test_the_aggregators_node_lost_under_traffic_restarts_it_from_its_checkpoint_with_exact_counts(mn):
    assert set(mns.actor_nodes("kvfleet-stats-").values()) == {mn.node_id("b")}
    before = _cumulative(mn.url)
    mn.add("c", 2, {AGG_RES: 1})  # room for the aggregator and for node b's group
    served = _lose_under_traffic(mn, "b")
    h = mns.until("the aggregator back, a new epoch", lambda: (h := mns.health(mn.url))["code"] == 200
                  and h["aggregator"]["epoch"] == 2 and h, RECOVERY_S)
    assert set(mns.actor_nodes("kvfleet-stats-").values()) == {mn.node_id("c")}
    mns.until("every group up", lambda: not mns.health(mn.url)["engine"]["down_groups"], RECOVERY_S)
    print(f"node b (aggregator + a group) lost under 8 requests: all served {served:.1f} s later")
    after = _cumulative(mn.url)
    assert all(after[k] >= before[k] for k in COUNTERS.values())  # never backwards
    records = _exact(mn.url)
    assert {r["aggregatorEpoch"] for r in records} == {1, h["aggregator"]["epoch"]}


def test_the_engine_replica_killed_under_traffic_takes_its_ranks_over_and_serves_every_request(mn):
    """40 requests from 4 clients, the engine's only replica killed after the first 8: the replica Serve starts
    takes the dead one's ranks over (the same actors, their caches: no model load), the requests in flight are
    re-sent and those that arrive meanwhile wait for it (placement_timeout_s), so all 40 are served."""
    import ray

    ranks_before = set(mns.actor_nodes("kvfleet-rank-mnf-"))
    cases = [(f"tenant {i % 4} asks question {i}", i % 2, i % 2) for i in range(40)]
    body = {**BODY, "max_tokens": 24}
    with cf.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(mns.complete, mn.url, p, bool(stream), **{**body, **SAMPLINGS[s]}) for p, s, stream
                in cases]
        mns.until("8 requests served", lambda: sum(r.done() for r in runs) >= 8, 120)
        replica = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith("SERVE_REPLICA::mnf#KVFleetEngine"))
        t_kill = time.monotonic()
        ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
        errors = [r.exception() for r in runs]
        served = time.monotonic() - t_kill
    print(f"engine replica killed under 4 clients: {errors.count(None)} of {len(runs)} requests served, the last "
          f"{served:.1f} s after the kill")
    assert errors == [None] * len(runs)
    assert set(mns.actor_nodes("kvfleet-rank-mnf-")) == ranks_before  # taken over, not started anew
    _exact(mn.url)


def test_the_engine_replicas_node_lost_under_traffic_loses_no_request(mn):
    assert set(mns.actor_nodes("SERVE_REPLICA::mnf#KVFleetEngine").values()) == {mn.node_id("a")}
    before = _cumulative(mn.url)
    mn.add("d", 2, {ENGINE_RES: 1})  # where Serve can start the replica again
    served = _lose_under_traffic(mn, "a")
    print(f"node a (the engine replica + a group) lost under 8 requests: all re-sent and served {served:.1f} s "
          "later")
    assert set(mns.actor_nodes("SERVE_REPLICA::mnf#KVFleetEngine").values()) == {mn.node_id("d")}
    after = _cumulative(mn.url)
    assert all(after[k] >= before[k] for k in COUNTERS.values())  # never backwards
    _exact(mn.url)
