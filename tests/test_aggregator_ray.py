"""Fault tests on the real local Ray cluster: a rank actor killed mid-stream, the aggregator actor killed
mid-stream (Ray restarts it; ranks re-send what was not acknowledged), directly and through a node relay,
and the relay itself killed mid-stream."""

import sys
import time

import pytest
import ray
import test_aggregator_support
from test_aggregator_support import SimRank

from aggregator import RankOutbox, StatsRelay, aggregator_name, get_or_create_aggregator, relay_name
from aggregator.merge import WINDOW_VIEW

pytestmark = pytest.mark.ray

# rank actors run this module's code in worker processes, which cannot import tests/
ray.cloudpickle.register_pickle_by_value(test_aggregator_support)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class FakeRank:
    """A rank that only produces stats: SimRank's consistent stream through a real RankOutbox."""

    def __init__(self, engine_id: str, rank: int, seed: int, via_relay: bool = False) -> None:
        self.sim = SimRank(rank, tp=1, seed=seed, engine_id=engine_id)
        # connect before the stream starts, as a real rank does during setup: a first call that is still
        # connecting must not look like a missing rank to the aggregator's timeout
        node = ray.get_runtime_context().get_node_id()
        handle = ray.get_actor(relay_name(engine_id, node) if via_relay else aggregator_name(engine_id))
        ray.get(handle.health.remote())
        self.box = RankOutbox(engine_id, resend_after_s=0.1, handle=handle)

    def step(self, iteration: int) -> str:
        self.box.put(self.sim.step(iteration))
        return self.sim.incarnation

    def flush(self, timeout_s: float) -> bool:
        return self.box.flush(timeout_s)

    def sent(self) -> dict:
        return dict(self.sim.cum)


def wait_for(fn, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def records_through(agg, it: int, since: int = -1) -> list[dict]:
    return wait_for(lambda: (lambda rs: rs if rs and rs[-1]["iter"] >= it else None)(
        ray.get(agg.query.remote(since))), what=f"records through iteration {it}")


def alloc(rec: dict) -> int:
    return sum(b["iterAllocTotalBlocks"] for b in rec[WINDOW_VIEW].values())


def test_rank_killed_gives_incomplete_records_then_complete_again(ray_cluster):
    eng = "t-rank-kill"
    agg = get_or_create_aggregator(eng, world_size=2, tp=1, stats_timeout_s=1.0)
    r0, r1 = FakeRank.remote(eng, 0, 0), FakeRank.remote(eng, 1, 0)
    ray.get([r0.__ray_ready__.remote(), r1.__ray_ready__.remote()])
    stats_seen = []
    for it in range(3):
        ray.get([r0.step.remote(it), r1.step.remote(it)])
    recs = records_through(agg, 2)
    assert all(r["complete"] for r in recs)
    stats_seen.append(ray.get(agg.kv_cache_stats.remote()))
    ray.kill(r1)  # mid-stream
    for it in range(3, 6):
        ray.get(r0.step.remote(it))
    recs = records_through(agg, 5, since=2)
    assert [(r["iter"], r["complete"], r["missingRanks"]) for r in recs] == [(i, False, [1]) for i in (3, 4, 5)]
    health = ray.get(agg.ranks.remote())
    stats_seen.append(ray.get(agg.kv_cache_stats.remote()))
    assert not health["1"]["healthy"] and health["0"]["healthy"]
    r1b = FakeRank.remote(eng, 1, 1)  # the rank comes back: a new incarnation, counters from zero
    ray.get(r1b.__ray_ready__.remote())
    for it in range(6, 9):
        incs = ray.get([r1b.step.remote(it), r0.step.remote(it)])
    recs = records_through(agg, 8, since=5)
    # a loaded machine may still time out the first iteration while the new rank's outbox connects
    assert [r["iter"] for r in recs] == [6, 7, 8] and recs[-1]["complete"] and recs[-2]["complete"]
    assert all(r["complete"] or r["missingRanks"] == [1] for r in recs)
    health = ray.get(agg.ranks.remote())
    assert health["1"]["healthy"] and health["1"]["incarnation"] == incs[0]
    assert ray.get([r0.flush.remote(10), r1b.flush.remote(10)]) == [True, True]
    assert ray.get(agg.health.remote())["counts"]["duplicates"] == 0, "acks are polled, never re-sent"
    stats_seen.append(ray.get(agg.kv_cache_stats.remote()))
    for k in ("allocTotalBlocks", "reusedBlocks", "missedBlocks"):
        assert [s[k] for s in stats_seen] == sorted(s[k] for s in stats_seen)  # never backwards
    text = ray.get(agg.metrics_text.remote())
    assert "kvfleet_stats_incomplete_records_total 3.0" in text
    for a in (r0, r1b, agg):
        ray.kill(a, no_restart=True)


def start_relay(eng: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    relay = StatsRelay.options(name=relay_name(eng, node), num_cpus=0,
                               scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(eng)
    ray.get(relay.health.remote())
    return relay


@pytest.mark.parametrize("via_relay", [False, True], ids=["direct", "relay"])
def test_aggregator_killed_comes_back_without_losing_counts(ray_cluster, via_relay):
    eng = f"t-agg-kill-{via_relay}"
    agg = get_or_create_aggregator(eng, world_size=2, tp=1, stats_timeout_s=5.0)
    relay = start_relay(eng) if via_relay else None
    r0, r1 = FakeRank.remote(eng, 0, 2, via_relay), FakeRank.remote(eng, 1, 3, via_relay)
    ray.get([r0.__ray_ready__.remote(), r1.__ray_ready__.remote()])
    for it in range(5):
        ray.get([r0.step.remote(it), r1.step.remote(it)])
    seen = {(r["aggregatorEpoch"], r["iter"]): r for r in records_through(agg, 4)}
    before = ray.get(agg.kv_cache_stats.remote())
    # rank 0 runs ahead: iterations 5 and 6 are pending (not emitted, not acknowledged) when the actor dies
    for it in (5, 6):
        ray.get(r0.step.remote(it))
    wait_for(lambda: ray.get(agg.health.remote())["pending_iterations"] == 2, what="pending iterations")
    ray.kill(agg, no_restart=False)
    for it in (5, 6):
        ray.get(r1.step.remote(it))
    for it in (7, 8):
        ray.get([r0.step.remote(it), r1.step.remote(it)])
    assert ray.get_actor(aggregator_name(eng))._actor_id == agg._actor_id  # same actor, restarted
    health = wait_for(lambda: (lambda h: h if h["last_iter"] >= 8 else None)(ray.get(agg.health.remote())),
                      what="restarted aggregator emitting")
    assert health["epoch"] == 2
    after_restart = ray.get(agg.kv_cache_stats.remote())
    assert ray.get([r0.flush.remote(10), r1.flush.remote(10)]) == [True, True]
    new = records_through(agg, 8)
    assert {r["aggregatorEpoch"] for r in new} == {2} and [r["iter"] for r in new] == [5, 6, 7, 8]
    seen.update({(r["aggregatorEpoch"], r["iter"]): r for r in new})
    sent = ray.get([r0.sent.remote(), r1.sent.remote()])
    # no iteration's counts lost, none counted twice, across the restart
    assert sum(alloc(r) for r in seen.values()) == sum(s["allocTotalBlocks"] for s in sent)
    final = ray.get(agg.kv_cache_stats.remote())
    for k in ("allocTotalBlocks", "reusedBlocks", "missedBlocks"):
        assert before[k] <= after_restart[k] <= final[k] == sum(s[k] for s in sent)
    for a in (r0, r1, agg, *([relay] if relay else [])):
        ray.kill(a, no_restart=True)


def test_relay_killed_mid_stream_loses_and_doubles_nothing(ray_cluster):
    eng = "t-relay-kill"
    agg = get_or_create_aggregator(eng, world_size=2, tp=1, stats_timeout_s=5.0)
    relay = start_relay(eng)
    r0, r1 = FakeRank.remote(eng, 0, 4, True), FakeRank.remote(eng, 1, 5, True)
    for it in range(4):
        ray.get([r0.step.remote(it), r1.step.remote(it)])
    ray.get(r0.step.remote(4))  # iteration 4 half sent when the relay dies (Ray restarts it)
    ray.kill(relay, no_restart=False)
    ray.get(r1.step.remote(4))
    for it in range(5, 8):
        ray.get([r0.step.remote(it), r1.step.remote(it)])
    assert ray.get([r0.flush.remote(20), r1.flush.remote(20)]) == [True, True]
    recs = records_through(agg, 7)
    assert [r["iter"] for r in recs] == list(range(8)) and all(r["complete"] for r in recs)
    sent = ray.get([r0.sent.remote(), r1.sent.remote()])
    assert sum(alloc(r) for r in recs) == sum(s["allocTotalBlocks"] for s in sent)
    assert ray.get(agg.kv_cache_stats.remote())["allocTotalBlocks"] == sum(s["allocTotalBlocks"] for s in sent)
    assert ray.get(relay.health.remote())["ok"]  # the same handle reaches the restarted relay
    for a in (r0, r1, agg, relay):
        ray.kill(a, no_restart=True)
