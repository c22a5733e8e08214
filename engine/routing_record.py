"""The `routing` field of every record: how right placement was, per iteration.

A request's prediction is its group's hits, in the statistics' units (the reused blocks a stats commit counts
over every life cycle, `kvcache.events.reuse_table`); its realization is the reused blocks of its first stats
commit on the rank. Each record's `routing` sums both for the requests whose first commit was in that
iteration, per dp group and per salt (the most frequent `TOP_SALTS`, the rest as `other`); its `fleet` sums
the same for the requests the fleet's router placed (several engine replicas, deployment/router/fleet_view.py),
with that router's prediction, made one level up from the replicas' KV event streams (so it also misses the
events still on their way to it). They differ when (1) blocks are evicted between the decision and the
prefill (other requests run meanwhile, or the request waits), (2) the block the rank reuses in part (partial
reuse) was evicted, or another published, in between (the prediction counts it too: the index keeps each
block's tokens, `KVIndex.partial_match`), (3) events are in flight: blocks another request published in the
same step are not in the index yet, (4) a sliding-window life cycle lost a page the anchor life cycle still
has, so the rank's match is shorter than the index's.
"""

from __future__ import annotations

import hashlib
import heapq
from typing import Any

from kvcache.events import root_key

TOP_SALTS = 16
MAX_SALTS = 4096  # salts whose request counts are kept (the most frequent survive a trim)
FLEET_FIELDS = ("requests", "predictedReusedBlocks", "realizedReusedBlocks")


def salt_label(salt: Any) -> str:
    """How records name a salt: a digest of its root key, in hex. Never the salt (a tenant's secret), nor the
    root: from the root anyone could hash a guessed prompt into the salt's block keys on /kv_events."""
    if salt is None:
        return "none"
    return hashlib.blake2b(root_key(salt).to_bytes(8, "little"), digest_size=8, person=b"kvfleet-label").hexdigest()


class RoutingRecord:
    """The tally of the iteration being stepped; `index` is the engine's KVIndex, whose errors (each a resync)
    the record counts too."""

    def __init__(self, policy: str, num_groups: int, index: Any) -> None:
        self.policy = policy
        self.index = index
        self._tally = _Tally(num_groups)
        self.salt_counts: dict[str, int] = {}
        self._reported_errors = 0

    def observe(self, dp: int, res: Any, requests: dict) -> None:
        """A group's step result (tp rank 0's): the requests whose first stats commit it holds are counted."""
        for rid, realized in res.first_reuse.items():
            req = requests.get(rid)
            if req is not None and req.predicted >= 0:
                self.count(req, dp, realized)

    def count(self, req: Any, dp: int, realized: int) -> None:
        label = salt_label(req.cache_salt)
        n = self.salt_counts.get(label, 0) + 1
        self.salt_counts[label] = n
        if len(self.salt_counts) > MAX_SALTS:
            keep = heapq.nlargest(MAX_SALTS // 4, self.salt_counts.items(), key=lambda kv: kv[1])
            self.salt_counts = dict(keep)
            self.salt_counts.setdefault(label, n)
        self._tally.add(dp, label, req.predicted, realized, req.fleet_predicted)
        req.predicted = req.fleet_predicted = -1  # counted once, on its first commit
        req.counted = True

    def take(self) -> dict[str, Any]:
        """The `routing` field of the iteration just stepped, and a fresh tally."""
        t, self._tally = self._tally, _Tally(len(self._tally.per_group))
        # every step calls this: rank the salts only in the iterations that counted a request
        top = {label for label, _ in heapq.nlargest(TOP_SALTS, self.salt_counts.items(), key=lambda kv: kv[1])} \
            if t.salts else set()
        per_salt: dict[str, dict[str, int]] = {}
        for label, (n, p, r) in t.salts.items():
            key = label if label in top else "other"
            acc = per_salt.setdefault(key, {"requests": 0, "predictedReusedBlocks": 0, "realizedReusedBlocks": 0})
            acc["requests"] += n
            acc["predictedReusedBlocks"] += p
            acc["realizedReusedBlocks"] += r
        return {"policy": self.policy, "requests": t.requests, "predictedReusedBlocks": t.predicted,
                "realizedReusedBlocks": t.realized, "perGroupRequests": t.per_group, "perSalt": per_salt,
                "indexResyncs": self._resyncs(), "fleet": dict(zip(FLEET_FIELDS, t.fleet, strict=True))}

    def _resyncs(self) -> int:
        """Index errors (each a resync) since the last record."""
        n, self._reported_errors = self.index.errors - self._reported_errors, self.index.errors
        return n


class _Tally:
    __slots__ = ("requests", "predicted", "realized", "per_group", "salts", "fleet")

    def __init__(self, num_groups: int) -> None:
        self.requests = self.predicted = self.realized = 0
        self.per_group = [0] * num_groups
        self.salts: dict[str, list[int]] = {}
        self.fleet = [0, 0, 0]  # the requests the fleet's router placed: count, its prediction, realized

    def add(self, dp: int, label: str, predicted: int, realized: int, fleet_predicted: int = -1) -> None:
        if fleet_predicted >= 0:
            self.fleet[0] += 1
            self.fleet[1] += fleet_predicted
            self.fleet[2] += realized
        self.requests += 1
        self.predicted += predicted
        self.realized += realized
        self.per_group[dp] += 1
        s = self.salts.setdefault(label, [0, 0, 0])
        s[0] += 1
        s[1] += predicted
        s[2] += realized
