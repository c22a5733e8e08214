"""The engine on a real multi-node Ray cluster (tests/support/multinode_support.py): tp groups packed on a node,
dp groups
spread over nodes, and nodes lost under streaming traffic, with every request finished exactly and the records
exact. One cluster for the module, its nodes changed test after test (ordered):

    head (0 CPUs, kvfleet_control: the Serve replicas and the aggregator)   a (4 CPUs)   b (2 CPUs)

dp 2 x tp 2 at 1 CPU per rank: node a could hold both groups, so their spread is the engine's doing.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from datetime import datetime

import httpx
import pytest

from tests.support import multinode_support as mns
from tests.support.e2e_fixtures import summed_counters
from tests.support.http_support import all_stats

ENGINE_ID = "mn"
SETTINGS = {"model": "random", "engine_id": ENGINE_ID, "dp": "2", "tp": "2", "num_cpus_per_rank": "1",
            "max_seq_len": "256", "restart_backoff_s": "0.2", "placement_timeout_s": "120",
            "ingress_resource": mns.CONTROL, "engine_resource": mns.CONTROL}
COUNTERS = {"iterAllocTotalBlocks": "allocTotalBlocks", "iterAllocNewBlocks": "allocNewBlocks",
            "iterReusedBlocks": "reusedBlocks", "iterMissedBlocks": "missedBlocks"}
BODY = {"max_tokens": 100, "temperature": 0, "ignore_eos": True}
SAMPLINGS = [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 11}]  # greedy (BODY's), seeded
RECOVERY_S = 120


@pytest.fixture(scope="module")
def mn():
    cluster = mns.start({"a": (4, {}), "b": (2, {})})
    try:
        mns.serve(cluster, "mn", SETTINGS)
        yield cluster
    finally:
        mns.shutdown(cluster)


def _group_nodes(url: str) -> dict[str, str | None]:
    return {dp: g["node_id"] for dp, g in mns.health(url)["engine"]["groups"].items()}


def _rank_nodes() -> dict[int, str]:
    return {int(name.split("-")[3]): node for name, node in mns.actor_nodes(f"kvfleet-rank-{ENGINE_ID}-").items()}


def _cases() -> list[tuple[str, int, bool]]:
    return [(f"tenant {t} asks about node loss", s, stream) for t in range(2) for s in range(2) for stream in (0, 1)]


def _run(url: str, case: tuple[str, int, bool]) -> str:
    prompt, s, stream = case
    return mns.complete(url, prompt, bool(stream), **{**BODY, **SAMPLINGS[s]})[0]


def _exact(url: str) -> list[dict]:
    """Every record so far, checked: the conservation law over the whole run, no tp divergence, in order."""
    with httpx.Client(base_url=url, timeout=30) as http:
        want = mns.health(url)["engine"]["iteration"] - 1
        records = mns.until("the mirror caught up", lambda: (r := all_stats(http)) and r[-1]["iter"] >= want and r,
                            30)
        cumulative = http.get("/kv_cache_stats").json()
    iters = [r["iter"] for r in records]
    assert iters == sorted(set(iters))
    assert all(not r["tpDivergence"] for r in records)
    assert summed_counters(records, COUNTERS) == {k: cumulative[k] for k in COUNTERS.values()}
    return records


def test_tp_groups_are_packed_on_a_node_and_dp_groups_spread_over_nodes(mn):
    ranks = _rank_nodes()
    assert ranks[0] == ranks[1] and ranks[2] == ranks[3]  # STRICT_PACK: a tp group never spans nodes
    assert ranks[0] != ranks[2]  # spread, though node a alone has room for both groups
    assert {ranks[0], ranks[2]} == {mn.node_id("a"), mn.node_id("b")}
    assert _group_nodes(mn.url) == {"0": ranks[0], "1": ranks[2]}
    control = set(mns.actor_nodes("SERVE_REPLICA::mn#").values()) | set(mns.actor_nodes("kvfleet-stats-").values())
    assert control == {mn.head_id}  # ingress_resource / engine_resource: the control plane on the head
    with cf.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(lambda c: _run(mn.url, c), _cases()))
    shown = httpx.get(f"{mn.url}/stats/ranks", timeout=10).json()
    assert {int(r): v["node_id"] for r, v in shown.items()} == ranks
    assert all(v["node_ip"] for v in shown.values())
    records = _exact(mn.url)
    assert all(r["complete"] and not r["missingRanks"] for r in records)


def _under_traffic(mn, lose: str, after_loss=None) -> tuple[dict, float, float]:
    """Every case's text when node `lose` is removed while they stream (each compared with its run before),
    the time of the loss, and how long until every request was served."""
    expected = {c: _run(mn.url, c) for c in _cases()}
    with cf.ThreadPoolExecutor(len(expected)) as pool:
        runs = {c: pool.submit(_run, mn.url, c) for c in expected}
        mns.until("requests running", lambda: mns.health(mn.url)["engine"]["running"] >= 4, 60)
        t_loss = mn.remove(lose)
        in_flight = sum(not r.done() for r in runs.values())
        if after_loss is not None:
            after_loss()
        got = {c: r.result() for c, r in runs.items()}
        served = time.monotonic() - t_loss
    assert in_flight >= 4, "the requests finished before the loss: make them longer"
    assert got == expected  # no gap, no repeat: greedy and seeded, streamed and not
    return got, t_loss, served


def test_a_node_lost_under_traffic_loses_no_request_and_its_group_restarts_where_there_is_room(mn):
    b_group = next(dp for dp, node in _group_nodes(mn.url).items() if node == mn.node_id("b"))
    b_ranks = [int(b_group) * 2, int(b_group) * 2 + 1]
    last = mns.health(mn.url)["engine"]["iteration"] - 1
    _, t_loss, served = _under_traffic(mn, "b")
    back = mns.until("the group back on node a", lambda: mns.health(mn.url)["engine"]["groups"][b_group]["up"],
                     RECOVERY_S)
    print(f"node b lost under 8 requests: all served {served:.1f} s later, its group back "
          f"{time.monotonic() - t_loss:.1f} s after the loss")
    assert back and _group_nodes(mn.url)[b_group] == mn.node_id("a")
    records = [r for r in _exact(mn.url) if r["iter"] > last]
    outage = [r for r in records if r["missingRanks"]]
    # the iterations in flight at the loss name the ranks that did not answer them (a rank may have answered just
    # before its node went): the step being run and, with async scheduling, the one sent ahead of it (engine/core.py).
    # The next one names the whole group. Each arrives whole: no record waits out a timeout
    whole = next(i for i, r in enumerate(outage) if set(r["missingRanks"]) == set(b_ranks))
    assert len(outage) >= 2 and whole <= 2 and all(set(r["missingRanks"]) < set(b_ranks) for r in outage[:whole])
    assert [r["iter"] for r in outage[:whole + 1]] == list(range(outage[0]["iter"], outage[0]["iter"] + whole + 1))
    assert set(outage[whole]["reportedRanks"]) == set(range(4)) - set(b_ranks)
    named = datetime.fromisoformat(outage[0]["timestamp"].replace("Z", "+00:00")).timestamp()
    print(f"the first record naming ranks {b_ranks} missing was stepped {named - mn.lost_at:.2f} s after the loss")


def test_groups_wait_pending_while_no_node_has_room_and_come_back_when_one_joins(mn):
    """Node a holds both groups now. Node c joins with room for one, then a is lost: one group restarts on c,
    the other is pending (not failed) until node d joins. Every request in flight finishes meanwhile."""
    mn.add("c", 2)
    seen = {}

    def watch() -> None:
        def one_back() -> dict | None:
            h = mns.health(mn.url)
            groups = h.get("engine", {}).get("groups", {})
            up = [g for g in groups.values() if g["up"]]
            down = [g for g in groups.values() if not g["up"]]
            # one back on c, the other pending: right after the loss both are down and neither pending yet
            # (a restart first waits for the GCS to mark the node dead)
            return groups if h["code"] == 200 and len(up) == 1 and len(down) == 1 and down[0]["pending"] else None

        seen.update(mns.until("one group back, one still down", one_back, RECOVERY_S))

    _, t_loss, served = _under_traffic(mn, "a", watch)
    pending = [dp for dp, g in seen.items() if not g["up"]]
    assert len(pending) == 1 and seen[pending[0]]["pending"] and not seen[pending[0]]["stays_down"]
    assert mns.health(mn.url)["engine"]["groups"][pending[0]]["pending"]  # still: no node has room
    print(f"node a (both groups) lost under 8 requests: all served {served:.1f} s later on node c")
    t_join = time.monotonic()
    mn.add("d", 2)
    mns.until("the pending group back", lambda: not mns.health(mn.url)["engine"]["down_groups"], RECOVERY_S)
    print(f"node d joined: the pending group served {time.monotonic() - t_join:.1f} s later")
    assert set(_group_nodes(mn.url).values()) == {mn.node_id("c"), mn.node_id("d")}
    assert all(_run(mn.url, c) for c in _cases()[:2])
    _exact(mn.url)
