"""The iteration assembler without Ray: emission, timeouts, late deltas, dedupe, acks, restart, and the
'nothing lost, nothing counted twice' property under random delivery."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_aggregator_support import ENGINE, SimRank, make_report, message

from aggregator.assembler import IterationAssembler
from aggregator.layout import packed
from aggregator.merge import BLOCK_COUNTER_FIELDS, BYTE_FIELDS, VIEW_COUNTERS, VIEWS, WINDOW_VIEW, fold_rank_messages


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(world=2, tp=1, timeout=1.0):
    clock = Clock()
    return IterationAssembler(ENGINE, world, tp, timeout, clock=clock, wall=lambda: 1e9 + clock.t), clock


def alloc(n):
    return make_report(counters={"iterAllocTotalBlocks": n})


def test_emits_when_every_rank_reported_in_iteration_order():
    a, _ = make()
    a.ingest([message(0, 0, 0), message(0, 1, 1), message(1, 1, 0)])
    assert a.poll() == []  # iteration 1 is complete but waits behind 0
    a.ingest([message(1, 0, 1)])
    recs = a.poll()
    assert [r["iter"] for r in recs] == [0, 1]
    assert all(r["complete"] and r["missingRanks"] == [] and r["reportedRanks"] == [0, 1] for r in recs)
    assert recs[0]["engineId"] == ENGINE and recs[0]["aggregatorEpoch"] == 1 and recs[0]["timestamp"].endswith("Z")


def test_timeout_emits_incomplete_then_late_delta_goes_into_next_record():
    a, clock = make(timeout=1.0)
    a.ingest([message(0, 0, 0, report=alloc(2))])
    clock.t = 0.99
    assert a.poll() == []
    clock.t = 1.0
    [r0] = a.poll()
    assert (r0["complete"], r0["missingRanks"], r0["reportedRanks"]) == (False, [1], [0])
    res = a.ingest([message(1, 0, 0, report=alloc(5))])  # late: iteration 0 is gone
    assert res.acked == []  # not acknowledged before its counts are emitted
    a.ingest([message(0, 1, 1, report=alloc(1)), message(1, 1, 1, report=alloc(1))])
    [r1] = a.poll()
    assert r1["complete"] and r1["lateDeltas"] == 1
    assert r1[WINDOW_VIEW]["512"]["iterAllocTotalBlocks"] == 1 + 1 + 5
    assert set(a.ingest([message(1, 1, 1)]).acked) == {("inc-1", 0), ("inc-1", 1)}
    assert a.counts["incomplete"] == 1 and a.counts["late_deltas"] == 1


def test_duplicates_ignored_and_acked_once_emitted():
    a, _ = make()
    m0, m1 = message(0, 0, 0, report=alloc(3)), message(1, 0, 0, report=alloc(4))
    assert a.ingest([m0, m0]).acked == []
    res = a.ingest([m1, m0])
    [r] = a.poll()
    assert r[WINDOW_VIEW]["512"]["iterAllocTotalBlocks"] == 7
    assert res.duplicates == 1 and a.counts["duplicates"] == 2
    assert set(a.ingest([m0, m1]).acked) == {("inc-0", 0), ("inc-1", 0)}


def test_merged_outbox_message_reports_its_whole_span():
    a, _ = make()
    a.ingest([message(1, i, i, report=alloc(1)) for i in range(3)])
    folded = fold_rank_messages(fold_rank_messages(message(0, 0, 0, report=alloc(2)),
                                                   message(0, 1, 1, report=alloc(2))),
                                message(0, 2, 2, report=alloc(2)))
    a.ingest([folded])
    recs = a.poll()
    assert [r["complete"] for r in recs] == [True, True, True]
    assert [r[WINDOW_VIEW]["512"]["iterAllocTotalBlocks"] for r in recs] == [1, 1, 1 + 6]  # counted at the end


def test_bad_messages_rejected_with_a_reason_others_kept():
    a, _ = make(world=2, tp=1)
    bad = [{"rank": 0}, message(5, 0, 0), {**message(0, 0, 0), "engine_id": "other"},
           {**message(1, 0, 0), "tp_rank": 1}, {**message(0, 0, 0), "seq": "x"}, "junk",
           {**message(0, 0, 0), "iterations": [3, 1]}]
    res = a.ingest(bad + [message(0, 0, 0)])
    assert [r["index"] for r in res.rejected] == list(range(len(bad)))
    assert "lacks 'engine_id'" in res.rejected[0]["error"]
    assert "outside world_size" in res.rejected[1]["error"]
    assert a.counts["rejected"] == len(bad) and a.counts["messages"] == 1


def test_invalid_construction():
    with pytest.raises(ValueError):
        IterationAssembler(ENGINE, 3, 2)
    with pytest.raises(ValueError):
        IterationAssembler(ENGINE, 2, 1, stats_timeout_s=0)


def test_restore_counts_each_message_exactly_once():
    a, clock = make(timeout=1.0)
    a.ingest([message(0, 0, 0, report=alloc(1)), message(1, 0, 0, report=alloc(1))])
    a.poll()
    a.ingest([message(0, 1, 1, report=alloc(2))])  # pending at the crash
    state = a.checkpoint()
    b, _ = make(timeout=1.0)
    b.epoch = 2
    b.restore(state)
    # the outbox re-sends everything unacknowledged: rank 1's 0 was emitted (ack lost), rank 0's 1 was not
    res = b.ingest([message(1, 0, 0, report=alloc(1)), message(0, 1, 1, report=alloc(2)),
                    message(1, 1, 1, report=alloc(3))])
    assert ("inc-1", 0) in res.acked and b.counts["messages"] == 2
    [r] = b.poll()
    assert (r["iter"], r["aggregatorEpoch"], r[WINDOW_VIEW]["512"]["iterAllocTotalBlocks"]) == (1, 2, 5)
    assert r["kvCacheStats"]["allocTotalBlocks"] >= 0


# ------------------------------------------------------------------------------------ property test


def _expected(sent: list[dict]) -> dict:
    """Counters each view/key must sum to: block counts from tp rank 0, bytes from every rank."""
    tot: dict = {}
    for m in sent:
        fields_ = BLOCK_COUNTER_FIELDS + BYTE_FIELDS if m["tp_rank"] == 0 else BYTE_FIELDS
        for view in VIEWS:
            for key, b in m["report"][view].items():
                for f in fields_:
                    if f in VIEW_COUNTERS[view] and b.get(f):
                        tot[(view, key, f)] = tot.get((view, key, f), 0) + b[f]
    return tot


def _emitted(records: list[dict]) -> dict:
    tot: dict = {}
    for r in records:
        for view in VIEWS:
            for key, b in r[view].items():
                for f in VIEW_COUNTERS[view]:
                    if b.get(f):
                        tot[(view, key, f)] = tot.get((view, key, f), 0) + b[f]
    return tot


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dp=st.integers(1, 3), tp=st.integers(1, 2), iters=st.integers(1, 8), seed=st.integers(0, 10_000),
    restart_p=st.floats(0, 0.3), dup_p=st.floats(0, 0.5), fold_p=st.floats(0, 0.4),
    shuffle_window=st.integers(0, 6), gap_p=st.floats(0, 0.5), restart_aggregator=st.booleans(),
    pack=st.booleans(), batch=st.integers(1, 5),
)
def test_nothing_lost_nothing_counted_twice(dp, tp, iters, seed, restart_p, dup_p, fold_p, shuffle_window,
                                           gap_p, restart_aggregator, pack, batch):
    """Either wire form, delivered one by one or in batches (packed batches take the C-level check)."""
    rng = random.Random(seed)
    world = dp * tp
    ranks = [SimRank(r, tp, seed) for r in range(world)]
    streams: list[list[dict]] = []
    for rk in ranks:
        out: list[dict] = []
        for it in range(iters):
            if it and rng.random() < restart_p:
                rk.restart()  # new incarnation; what it sent before stays sent
            m = rk.step(it)
            if out and rng.random() < fold_p and out[-1]["incarnation"] == m["incarnation"]:
                m = fold_rank_messages(out.pop(), m)  # an outbox over its bound
            out.append(m)
        streams.append(out)
    sent = [m for s in streams for m in s]
    # delivery: per-rank order kept but interleaved, locally shuffled, with duplicates
    deliveries = sorted(((i + rng.uniform(0, shuffle_window), m) for s in streams for i, m in enumerate(s)),
                        key=lambda x: x[0])
    wire = []
    for _, m in deliveries:
        wire.append(packed(m) if pack else m)
        if rng.random() < dup_p:
            wire.insert(rng.randrange(len(wire)), wire[-1])

    a, clock = make(world=world, tp=tp, timeout=1.0)
    records: list[dict] = []
    restart_at = rng.randrange(len(wire)) if restart_aggregator else -1
    acks: list[dict] = []
    for k in range(0, len(wire), batch):
        if k <= restart_at < k + batch:  # the aggregator dies: pending is lost, its checkpoint survives
            state = a.checkpoint()
            a, clock = make(world=world, tp=tp, timeout=1.0)
            a.epoch = 2
            a.restore(state)
            # every rank re-sends what it has not had acknowledged, in seq order
            acked = {(r_["inc"], r_["seq"]) for r_ in acks}
            for m2 in sorted(wire[:k], key=lambda x: (x["incarnation"], x["seq"])):
                if (m2["incarnation"], m2["seq"]) not in acked:
                    acks.extend({"inc": i, "seq": s} for i, s in a.ingest([m2]).acked)
                    records += a.poll()
        acks.extend({"inc": i, "seq": s} for i, s in a.ingest(wire[k:k + batch]).acked)
        if rng.random() < gap_p:
            clock.t += rng.choice([0.2, 1.5])  # sometimes past stats_timeout_s: incomplete, then late
        records += a.poll()
    # one idle iteration from every rank closes the stream (and carries any late delta)
    clock.t += 5
    records += a.poll()
    final = [rk.step(iters, report=make_report()) for rk in ranks]
    acks.extend({"inc": i, "seq": s} for i, s in a.ingest(final).acked)
    records += a.poll()
    clock.t += 5
    records += a.poll()

    assert a.pending == {} and a.late == []
    iters_out = [r["iter"] for r in records]
    assert iters_out == sorted(set(iters_out))
    assert _emitted(records) == _expected(sent + final)
    # the cluster cumulative equals the sum of the deltas of tp rank 0 ranks
    exp = _expected(sent + final)
    alloc = sum(v for (view, _, f), v in exp.items() if view == WINDOW_VIEW and f == "iterAllocTotalBlocks")
    assert a.cumulative.stats()["allocTotalBlocks"] == alloc
    # every message is acknowledged once re-sent after its emission
    for m in sent + final:
        if m["incarnation"] and {"inc": m["incarnation"], "seq": m["seq"]} not in acks:
            acks.extend({"inc": i, "seq": s} for i, s in a.ingest([m]).acked)
    assert {(m["incarnation"], m["seq"]) for m in sent + final} <= {(x["inc"], x["seq"]) for x in acks}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), batch=st.integers(2, 16), restart_p=st.floats(0, 0.4))
def test_a_batch_is_taken_as_its_messages_one_by_one(seed, batch, restart_p):
    """Batched ingest applies only the last snapshot of each run of one incarnation: the same cluster
    totals, rank records and records as one message at a time, also with messages lacking a snapshot,
    swapped neighbours, duplicates and more incarnations per rank than are kept (banking)."""
    rng = random.Random(seed)
    ranks = [SimRank(r, 1, seed) for r in range(2)]
    wire = []
    for it in range(12):
        for rk in ranks:
            if it and rng.random() < restart_p:
                rk.restart()
            m = packed(rk.step(it))
            if rng.random() < 0.2:
                del m["kv_cache_stats"]
            wire.append(m)
            if rng.random() < 0.15:
                wire.append(m)  # a duplicate
    for i in range(len(wire) - 1):
        if rng.random() < 0.2:
            wire[i], wire[i + 1] = wire[i + 1], wire[i]
    one, _ = make(world=2, timeout=100.0)
    many, _ = make(world=2, timeout=100.0)
    for m in wire:
        one.ingest([m])
    for k in range(0, len(wire), batch):
        many.ingest(wire[k:k + batch])
    assert many.cumulative.stats() == one.cumulative.stats()
    assert many.cumulative.to_state() == one.cumulative.to_state()
    assert many.latest == one.latest and many.counts == one.counts
    assert many.poll() == one.poll()
