"""The packed wire form and the row merge (aggregator/layout.py) against the bucket-by-bucket reference merge:
identical records for any mix of key layouts, tp ranks, folded duplicates, missing fields and windowSizes;
packing loses nothing; bad bucket shapes and bad packed rows rejected at ingest with a reason; the
incremental cluster cumulative equal to a full re-sum."""

import json
import pickle
import random
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_aggregator_support import ENGINE, SimRank, kv_stats, make_report, message

from aggregator.assembler import IterationAssembler
from aggregator.layout import LayoutError, check_rows, layout_for, pack, packed, report_of
from aggregator.merge import (
    KV_STATS_COUNTERS,
    LIFECYCLE_VIEW,
    POOL_VIEW,
    WINDOW_VIEW,
    ClusterCumulative,
    merge_iteration,
    merge_iteration_reference,
)


def _vary(report: dict, rng: random.Random) -> dict:
    """Drop or add keys, drop fields, change windowSizes and static fields: layouts that differ."""
    if rng.random() < 0.3:
        report[WINDOW_VIEW].pop(rng.choice(list(report[WINDOW_VIEW])))
    if rng.random() < 0.3:
        report[WINDOW_VIEW]["4096"] = dict(next(iter(report[WINDOW_VIEW].values()), make_report()[WINDOW_VIEW]["512"]))
    if rng.random() < 0.3:
        report[LIFECYCLE_VIEW].pop("1", None)
    if rng.random() < 0.3:
        pg = report[POOL_VIEW]["0"]
        pg["windowSizes"] = rng.choice([[512, 4096], [4096], [], [512, 512]])
        pg["slotSize"] = rng.choice([4096, 8192])
    if rng.random() < 0.2:
        b = report[WINDOW_VIEW].get("1024")
        if b:
            for f in rng.sample(sorted(b), 3):
                del b[f]
    if rng.random() < 0.2:
        report[LIFECYCLE_VIEW]["0"]["kind"] = "sliding"
    return report


def _random_iteration(rng: random.Random, dp: int, tp: int) -> list[dict]:
    msgs = []
    for r in range(dp * tp):
        if rng.random() < 0.15:
            continue  # a missing rank
        for k in range(rng.choice([1, 1, 1, 2])):  # sometimes two messages of one rank (a fold)
            rep = _vary(make_report(rng=rng, bytes_scale=4096), rng)
            msgs.append(message(r, 7, 10 * r + k, tp=tp, report=rep,
                                stats=kv_stats(tokens_per_block=rng.choice([16, 16, 16, 32]))))
    rng.shuffle(msgs)
    return msgs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), dp=st.integers(1, 4), tp=st.integers(1, 3))
def test_fast_merge_equals_reference(seed, dp, tp):
    msgs = _random_iteration(random.Random(seed), dp, tp)
    fast, ref = merge_iteration(msgs), merge_iteration_reference(msgs)
    assert fast.views == ref.views
    assert json.dumps(fast.views) == json.dumps(ref.views)  # same key and field order too
    assert fast.tp_divergence == ref.tp_divergence and fast.errors == ref.errors
    # packed on the rank, checked at ingest: the same record
    wire = [packed(m) for m in msgs]
    assert all("report" not in w and check_rows(w) for w in wire)
    got = merge_iteration(wire)
    assert got.views == ref.views and got.tp_divergence == ref.tp_divergence and got.errors == ref.errors


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_one_layout_merge_equals_reference(tp):
    """The usual iteration (one layout, every tp rank 0 present) takes merge._one_layout: same record."""
    rng = random.Random(tp)
    msgs = [message(r, 7, r, tp=tp, report=make_report(rng=rng, bytes_scale=4096)) for r in range(2 * tp)]
    for m in msgs[1:]:  # tp ranks of a dp group agree on blocks, so no divergence; bytes differ
        if m["tp_rank"]:
            ref = msgs[m["rank"] - m["tp_rank"]]["report"]
            for view, buckets in m["report"].items():
                for key, b in buckets.items():
                    b.update({f: v for f, v in ref[view][key].items() if "Bytes" not in f})
    got, want = merge_iteration([packed(m) for m in msgs]), merge_iteration_reference(msgs)
    assert json.dumps(got.views) == json.dumps(want.views) and got.tp_divergence == want.tp_divergence == []


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_packing_loses_nothing(seed):
    rng = random.Random(seed)
    rep = _vary(make_report(rng=rng, bytes_scale=4096), rng)
    back = report_of(packed(message(0, 1, 0, report=rep)))
    for view, buckets in rep.items():
        assert list(back[view]) == list(buckets)  # same keys, same order
        for key, b in buckets.items():
            for f, v in b.items():
                if f == "iterCacheHitRate":
                    continue  # recomputed from the counters
                assert back[view][key][f] == v, (view, key, f)
            assert set(back[view][key]) >= set(b)  # a field the rank left out comes back as 0
    assert pack(back) == pack(rep)


def test_layout_parsed_once_per_layout_string():
    a, b = make_report(), make_report(counters={"iterAllocTotalBlocks": 3})
    assert pack(a)[0] == pack(b)[0] and pack(a)[1] != pack(b)[1]
    assert layout_for(pack(a)[0]) is layout_for(pack(b)[0])
    del b[WINDOW_VIEW]["1024"]
    assert pack(a)[0] != pack(b)[0]
    b[POOL_VIEW]["0"]["slotSize"] = 1  # static fields are part of the layout too
    assert pack(make_report())[0] != pack(b)[0]


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_bad_bucket_shapes_rejected_at_ingest_with_reason(tp_rank):
    a = IterationAssembler(ENGINE, 2, 2, 1.0)
    bad_bucket = make_report()
    bad_bucket[WINDOW_VIEW]["512"] = [1, 2, 3]
    bad_number = make_report(counters={"iterOffloadBytes": "12"})
    bad_gauge = make_report(gauges={"primaryFreeNumBlocks": None})
    bad_lc = make_report()
    bad_lc[LIFECYCLE_VIEW]["0"] = "x"
    with pytest.raises(LayoutError, match="must be a dict"):
        pack(bad_bucket)
    msgs = [message(tp_rank, 0, s, tp=2, report=r) for s, r in enumerate([bad_bucket, bad_number, bad_gauge, bad_lc])]
    res = a.ingest(msgs + [message(tp_rank, 0, 9, tp=2)])
    assert [r["index"] for r in res.rejected] == [0, 1, 2, 3]
    assert "must be a dict, got list" in res.rejected[0]["error"]
    assert "counters must be integers, got str" in res.rejected[1]["error"]
    assert "gauges must be integers, got NoneType" in res.rejected[2]["error"]
    assert "must be a dict, got str" in res.rejected[3]["error"]
    assert a.counts["messages"] == 1 and a.counts["rejected"] == 4
    # a rejected message is not marked seen: fixed and re-sent with the same seq, it is taken
    assert a.ingest([message(tp_rank, 0, 0, tp=2)]).rejected == [] and a.counts["messages"] == 2


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_bad_packed_messages_rejected_at_ingest_with_reason(tp_rank):
    a = IterationAssembler(ENGINE, 2, 2, 1.0)
    good = packed(message(tp_rank, 0, 0, tp=2))
    bad = [
        ({**good, "counters": good["counters"][:-8]}, "counters and"),
        ({**good, "gauges": good["gauges"] + bytes(8)}, "gauges, message rows"),
        ({**good, "counters": good["counters"] + b"\x01"}, "(8 per number)"),
        ({**good, "layout": "{not json"}, "layout is not JSON"),
        ({**good, "layout": "[1, 2, 3]"}, "layout must be a list of 3 views"),
        ({**good, "layout": 5}, "packed message needs 'layout'"),
        ({**good, "counters": [1, 2]}, "packed message needs 'counters' (bytes)"),
        ({**good, "report": make_report()}, "either 'report' or 'layout'"),
        ({k: v for k, v in good.items() if k != "gauges"}, "packed message needs 'gauges'"),
    ]
    res = a.ingest([m for m, _ in bad])
    assert [r["index"] for r in res.rejected] == list(range(len(bad)))
    for (_, why), rej in zip(bad, res.rejected, strict=True):
        assert why in rej["error"], (why, rej["error"])
    assert a.counts["messages"] == 0
    # none of them was marked seen: the correct message with the same seq is taken
    assert a.ingest([good]).rejected == [] and a.counts["messages"] == 1


def test_fast_and_field_by_field_validation_agree():
    from aggregator.assembler import MessageError, _validate_fields, batch_valid, validate_message

    good = message(1, 3, 4, tp=2)
    wire = packed(good)
    common = lambda g: [g, {**g, "iterations": [2, 3]}, {**g, "iterations": [4, 3]}, {**g, "rank": True},
                        {**g, "rank": 9}, {**g, "dp_rank": 1}, {**g, "engine_id": "x"}, {**g, "seq": -1},
                        {**g, "kv_cache_stats": []}, {**g, "kv_cache_stats": None},
                        {k: v for k, v in g.items() if k != "incarnation"}]
    variants = [*common(good), *common(wire), {**good, "report": {WINDOW_VIEW: []}}, {**good, "report": []},
                {**wire, "layout": b"x"}, {**wire, "counters": (1, 2)}, {**wire, "gauges": None},
                {**wire, "gauges": bytearray(wire["gauges"])},
                {**wire, "report": {}}, {k: v for k, v in good.items() if k != "report"},
                {**good, "kv_cache_stats": {**good["kv_cache_stats"], "allocTotalBlocks": "7"}}]
    placements = {(r, r // 2, r % 2) for r in range(4)}
    assert batch_valid([wire, packed(message(0, 3, 4, tp=2))], ENGINE, placements)  # the usual batch
    for m in variants:
        if batch_valid([m], ENGINE, placements):  # the C-level batch check never passes what the full one refuses
            _validate_fields(m, ENGINE, 4, 2)
            check_rows(m)
        assert not batch_valid([wire, m], ENGINE, placements) or batch_valid([m], ENGINE, placements)
        errs = []
        for fn in (validate_message, _validate_fields):
            try:
                fn(m, ENGINE, 4, 2)
                errs.append(None)
            except MessageError as e:
                errs.append(str(e))
        if errs[1] is not None or "kv_cache_stats" in str(errs[0]):
            assert errs[0] is not None, m  # never accepted by the fast path when the full check rejects it
        else:
            assert errs[0] is None, (m, errs)
    with pytest.raises(MessageError, match="kv_cache_stats\\['allocTotalBlocks'\\] must be a number"):
        validate_message(variants[-1], ENGINE, 4, 2)


def _brute(c: ClusterCumulative) -> dict:
    out = dict.fromkeys(KV_STATS_COUNTERS, 0)
    for r in c.ranks.values():
        if r.tp_rank == 0:
            for k in out:
                out[k] += r.banked[k] + sum(snap[k] for _, snap, _ in r.snapshots.values())
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_incremental_cumulative_equals_full_resum(seed):
    rng = random.Random(seed)
    c = ClusterCumulative()
    ranks = [SimRank(r, 2, seed) for r in range(4)]
    sent = []
    for it in range(30):
        rk = rng.choice(ranks)
        if rng.random() < 0.15:
            rk.restart()
        sent.append(rk.step(it))
        m = rng.choice(sent) if rng.random() < 0.3 else sent[-1]  # re-sent and reordered snapshots
        c.update(m)
        assert c.computed() == _brute(c)
    d = ClusterCumulative.from_state(pickle.loads(pickle.dumps(c.to_state())))
    assert d.computed() == _brute(d) == c.computed() and d.stats() == c.stats()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
