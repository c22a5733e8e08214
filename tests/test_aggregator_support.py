"""Synthetic rank messages for the aggregator tests (valid SPEC section 4 shapes, no kvcache needed)."""

import random
import uuid

from aggregator.merge import (
    BYTE_FIELDS,
    COUNTER_FIELDS,
    GAUGE_FIELDS,
    KV_STATS_COUNTERS,
    PEAK_FIELDS,
    POOL_VIEW,
    VIEW_COUNTERS,
    VIEWS,
    WINDOW_VIEW,
    hit_rate,
)

ENGINE = "engine-t"
WINDOWS = ("512", "1024")
POOLS = {"0": [512], "1": [1024]}
LIFECYCLES = {"0": ("0", 512), "1": ("1", 1024)}


def make_report(counters: dict | None = None, gauges: dict | None = None, rng: random.Random | None = None,
                bytes_scale: int = 1) -> dict:
    """One rank's iteration report. counters/gauges: {field: value} applied to every bucket; rng: random."""
    def val(f):
        if counters and f in counters:
            return counters[f]
        if rng is not None:
            return rng.randint(0, 5) * (bytes_scale if f in BYTE_FIELDS else 1)
        return 0

    def gauge(f):
        if gauges and f in gauges:
            return gauges[f]
        return rng.randint(0, 64) if rng is not None else 0

    out = {view: {} for view in VIEWS}
    for w in WINDOWS:
        b = {f: val(f) for f in COUNTER_FIELDS}
        b.update({f: gauge(f) for f in GAUGE_FIELDS + PEAK_FIELDS})
        b["iterCacheHitRate"] = hit_rate(b["iterReusedBlocks"], b["iterMissedBlocks"])
        out[WINDOW_VIEW][w] = b
    for pg, ws in POOLS.items():
        b = {"poolGroupId": int(pg), "slotSize": 4096, "windowSizes": ws}
        b.update({f: val(f) for f in VIEW_COUNTERS[POOL_VIEW]})
        b.update({f: gauge(f) for f in GAUGE_FIELDS + PEAK_FIELDS})
        out[POOL_VIEW][pg] = b
    for lc, (pg, w) in LIFECYCLES.items():
        b = {"lifeCycleId": int(lc), "poolGroupId": int(pg), "windowSize": w, "kind": "attention"}
        b.update({f: val(f) for f in VIEW_COUNTERS["kvCacheIterationStatsByLifecycle"]})
        b["iterCacheHitRate"] = hit_rate(b["iterReusedBlocks"], b["iterMissedBlocks"])
        out["kvCacheIterationStatsByLifecycle"][lc] = b
    return out


def kv_stats(counters: dict | None = None, tokens_per_block: int = 16, max_blocks: int = 64) -> dict:
    c = dict.fromkeys(KV_STATS_COUNTERS, 0)
    c.update(counters or {})
    return {"maxNumBlocks": max_blocks, "freeNumBlocks": max_blocks // 2, "usedNumBlocks": max_blocks // 2,
            "tokensPerBlock": tokens_per_block, **c,
            "cacheHitRate": hit_rate(c["reusedBlocks"], c["missedBlocks"])}


def message(rank: int, iteration: int, seq: int, *, tp: int = 1, incarnation: str | None = None,
            report: dict | None = None, stats: dict | None = None, timestamp: float | None = None,
            engine_id: str = ENGINE) -> dict:
    return {
        "engine_id": engine_id, "rank": rank, "dp_rank": rank // tp, "tp_rank": rank % tp,
        "incarnation": incarnation or f"inc-{rank}", "iteration": iteration, "seq": seq,
        "timestamp": float(timestamp if timestamp is not None else 1_000_000 + seq),
        "report": report if report is not None else make_report(),
        "kv_cache_stats": stats if stats is not None else kv_stats(),
    }


class SimRank:
    """A rank that produces a consistent stream: each message's cumulative snapshot is the running sum of
    its own deltas (so cumulative == sum of deltas, as in a real KVCacheManager)."""

    def __init__(self, rank: int, tp: int, seed: int = 0, tokens_per_block: int = 16,
                 engine_id: str = ENGINE) -> None:
        self.rank, self.tp, self.engine_id = rank, tp, engine_id
        self.rng = random.Random(seed * 1000 + rank)
        self.tpb = tokens_per_block
        self.restart()

    def restart(self) -> None:
        self.incarnation = uuid.uuid4().hex
        self.seq = 0
        self.cum = dict.fromkeys(KV_STATS_COUNTERS, 0)

    def step(self, iteration: int, report: dict | None = None) -> dict:
        report = report or make_report(rng=self.rng, bytes_scale=4096)
        w = report[WINDOW_VIEW]
        for k, f in (("allocTotalBlocks", "iterAllocTotalBlocks"), ("allocNewBlocks", "iterAllocNewBlocks"),
                     ("reusedBlocks", "iterReusedBlocks"), ("missedBlocks", "iterMissedBlocks")):
            self.cum[k] += sum(b[f] for b in w.values())
        m = message(self.rank, iteration, self.seq, tp=self.tp, incarnation=self.incarnation, report=report,
                    stats=kv_stats(self.cum, self.tpb), engine_id=self.engine_id)
        self.seq += 1
        return m


def test_support_messages_validate():
    from aggregator.assembler import validate_message

    r = SimRank(3, tp=2)
    m = r.step(0)
    validate_message(m, ENGINE, world_size=4, tp=2)
    assert (m["dp_rank"], m["tp_rank"]) == (1, 1)
    assert m["kv_cache_stats"]["allocTotalBlocks"] == sum(
        b["iterAllocTotalBlocks"] for b in m["report"][WINDOW_VIEW].values())
