"""Fake ranks that make packed deltas, and the reference merge the fast one is checked against."""

from __future__ import annotations

import random
import uuid
from typing import Any

import numpy as np

from aggregator.delta import KV_STATS, NUM_GAUGES, SCHED, Iteration, RankDelta, RankLayout, pack
from aggregator.fields import HIT_RATE_FIELD, STATIC_FIELDS, VIEWS
from aggregator.merge import views_of
from kvcache.stats import ALLOC_TOTAL, COUNTER_KEYS, MISSED, NUM_COUNTERS, REUSED, hit_rate

# life cycles (id, pool group, window key, kind) and pool groups (id, slot bytes, window keys)
SHAPES = [
    (((0, 0, "4096", "full"),), ((0, 8192, (4096,)),)),
    (((0, 0, "4096", "full"), (1, 1, "512", "sliding_window")), ((0, 8192, (4096,)), (1, 4096, (512,)))),
    (((0, 0, "4096", "full"), (1, 0, "512", "sliding_window")), ((0, 8192, (512, 4096)),)),
]
BYTES = np.array([k.endswith("Bytes") for k in COUNTER_KEYS])


class FakeRank:
    """A rank whose block counters and gauges equal its tp group's (same `group_rng` draws), bytes its own."""

    def __init__(self, rank: int, tp: int, shape: int = 0, tokens_per_block: int = 16) -> None:
        self.rank, self.tp, self.shape, self.tpb = rank, tp, shape, tokens_per_block
        self.restart()

    def restart(self) -> None:
        lcs, pgs = SHAPES[self.shape]
        self.layout = RankLayout(self.rank, self.rank // self.tp, self.rank % self.tp, uuid.uuid4().hex, lcs, pgs,
                                 max_num_blocks=100, tokens_per_block=self.tpb)
        self.kv = [0] * len(KV_STATS)
        self.kv[KV_STATS.index("tokensPerBlock")] = self.tpb

    def delta(self, group_rng: random.Random, own_rng: random.Random) -> RankDelta:
        lay = self.layout
        counters = np.array([[group_rng.randint(0, 9) for _ in range(NUM_COUNTERS)] for _ in lay.life_cycles])
        counters[:, BYTES] = [[own_rng.randint(0, 1 << 20) for _ in range(int(BYTES.sum()))] for _ in lay.life_cycles]
        gauges = [[group_rng.randint(0, 99) for _ in range(NUM_GAUGES)] for _ in lay.pool_groups]
        k = KV_STATS.index
        for key, col in (("allocTotalBlocks", ALLOC_TOTAL), ("allocNewBlocks", ALLOC_TOTAL),
                         ("reusedBlocks", REUSED), ("missedBlocks", MISSED)):
            self.kv[k(key)] += int(counters[:, col].sum())
        self.kv[k("maxNumBlocks")] = 100
        self.kv[k("usedNumBlocks")] = group_rng.randint(0, 100)
        self.kv[k("freeNumBlocks")] = 100 - self.kv[k("usedNumBlocks")]
        sched = [own_rng.randint(1, 5000) if name == "stepUs" else group_rng.randint(0, 9) for name in SCHED]
        return RankDelta(self.rank, lay.incarnation, pack(lay, counters, gauges, self.kv, sched))


class FakeCluster:
    def __init__(self, dp: int, tp: int, seed: int = 0, shapes: list[int] | None = None) -> None:
        self.dp, self.tp = dp, tp
        self.rng = random.Random(seed)
        self.ranks = [FakeRank(r, tp, (shapes or [0] * dp)[r // tp]) for r in range(dp * tp)]

    @property
    def layouts(self) -> list[RankLayout]:
        return [r.layout for r in self.ranks]

    def iteration(self, i: int, missing: set[int] = frozenset()) -> Iteration:
        deltas = []
        for dp in range(self.dp):
            seed = self.rng.getrandbits(32)
            for r in self.ranks[dp * self.tp:(dp + 1) * self.tp]:
                if r.rank not in missing:
                    deltas.append(r.delta(random.Random(seed), self.rng))
        return Iteration(i, 1.7e9 + i, deltas, tuple(sorted(missing)), {"numActiveRequests": 2})


def reference_merge(rows: list[tuple[RankLayout, np.ndarray]]) -> dict[str, Any]:
    """The merge rules bucket by bucket on each rank's own views (slow, obviously right)."""
    by_dp: dict[int, list[tuple[RankLayout, dict]]] = {}
    for lay, row in rows:
        by_dp.setdefault(lay.dp_rank, []).append((lay, views_of(lay, row)))
    out: dict[str, dict] = {v: {} for v in VIEWS}
    for members in by_dp.values():
        members.sort(key=lambda m: m[0].tp_rank)
        ref = members[0][1]
        for view in VIEWS:
            for key, bucket in ref[view].items():
                b = dict(bucket)
                for f in b:
                    if f.endswith("Bytes"):
                        b[f] = sum(m[1][view][key][f] for m in members)
                have = out[view].get(key)
                if have is None:
                    out[view][key] = b
                    continue
                for f, v in b.items():
                    if f in STATIC_FIELDS[view] or f == HIT_RATE_FIELD:
                        continue
                    have[f] = sorted(set(have[f]) | set(v)) if f == "windowSizes" else have[f] + v
    for view in VIEWS:
        for b in out[view].values():
            if HIT_RATE_FIELD in b:
                b[HIT_RATE_FIELD] = hit_rate(b["iterReusedBlocks"], b["iterMissedBlocks"])
    return out


def rows_of(cluster: FakeCluster, it: Iteration) -> list[tuple[RankLayout, np.ndarray]]:
    layouts = {lay.rank: lay for lay in cluster.layouts}
    return [(layouts[d.rank], d.row) for d in it.deltas]
