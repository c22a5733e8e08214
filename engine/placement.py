"""Placement across dp groups: which group a request goes to, and how right that was.

Policies (`routing`): `kv` scores every group that is up by the prompt blocks it already holds (the KV index,
engine/kv_index.py: an exact picture of what the ranks reported) against its load, `least_loaded` takes the
group with the fewest requests, `round_robin` the next one. The `kv` score, in tokens:

    B * (primary_weight * primary hits + host_weight * host hits)
      - load_weight * (tokens still to compute or generate on the group)
      - free_weight * B * (blocks the prompt needs beyond the group's room: what it would preempt)

where room is the group's free blocks (free or evictable, as its rank last reported) less what its waiting
requests will take, and hits are the longest prefix of the prompt's full blocks the group holds (the rank
matches at most all but the prompt's last token). Ties go to the lighter group, then the one holding fewer
blocks (so tenants spread over the groups' caches), then the one with more room, then the lower dp rank: one
rule, `kv_rank`, which the fleet's router applies to every engine replica's groups too.
Salts are in the block keys (kvcache/events.py), so one salt's blocks never predict another's reuse.

Predicted vs realized: a request's prediction is its group's hits, in the statistics' units (the reused blocks
a stats commit counts over every life cycle, `kvcache.events.reuse_table`); its realization is the reused
blocks of its first stats commit on the rank. Each record's `routing` sums both for the requests whose first
commit was in that iteration; its `fleet` sums the same for the requests the fleet's router placed (several
engine replicas, deployment/router/fleet_view.py), with that router's prediction, made one level up from the
replicas' KV event streams (so it also misses the events still on their way to it). They differ when (1)
blocks are evicted between the decision and the prefill (other requests run meanwhile, or the request waits),
(2) the block the rank reuses in part (partial reuse) was evicted, or another published, in between (the
prediction counts it too: the index keeps each block's tokens, `KVIndex.partial_match`), (3) events
are in flight: blocks another request published in the same step are not in the index yet, (4) a sliding-
window life cycle lost a page the anchor life cycle still has, so the rank's match is shorter than the
index's.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import KVEventsConfig, RoutingConfig
from engine.kv_index import KVIndex
from engine.kv_publisher import KVEventPublisher
from engine.kv_stream import KVEventStream
from engine.scheduler import shared_blocks
from kvcache.events import prompt_keys, root_key

POLICIES = ("kv", "least_loaded", "round_robin")
TOP_SALTS = 16
MAX_SALTS = 4096  # salts whose request counts are kept (the most frequent survive a trim)


def group_load(g: Any) -> int:
    """Tokens a group still has to compute or generate: prompts not yet prefilled (less what their placement
expects cached) and outputs not yet made."""
    total = 0
    for r in itertools.chain(g.waiting, g.running):
        total += r.total - max(r.num_computed_tokens, r.hit_tokens) + r.max_tokens - len(r.generated)
    return total


def waiting_blocks(g: Any, B: int) -> int:
    """Blocks the group's waiting requests will take beyond what their placement expects cached: room that
    its last reported free blocks no longer have."""
    return sum(max(0, -(-(r.total + r.max_tokens) // B) - r.hit_tokens // B) for r in g.waiting)


def kv_score(weights: tuple[float, float, float, float], B: int, hits: tuple[int, int], load: int, need: int,
             room: int) -> float:
    """The `kv` policy's score of one dp group, in tokens (the formula above): the fleet's router
    (deployment/router/fleet_view.py) scores every engine replica's groups with it too."""
    wp, wh, wl, wf = weights
    primary, host = hits
    short = max(0, need - primary - host - room)
    return B * (wp * primary + wh * host) - wl * load - wf * B * short


def kv_rank(weights: tuple[float, float, float, float], B: int, hits: tuple[int, int], load: int, need: int,
            room: int, held: int) -> tuple:
    """The `kv` rule, one for both levels: a dp group's sort key, best lowest, whether this engine places a
    request on one of its groups or the fleet's router scores every engine replica's (deployment/router/
    fleet_view.py). The score, then the lighter group, the one holding fewer blocks (`held`: tenants spread over
    the caches), the one with more room; callers add their own last tie-breaks (dp rank, replica order)."""
    return (-kv_score(weights, B, hits, load, need, room), load, held, -room)


def salt_label(salt: Any) -> str:
    """How records name a salt: a digest of its root key, in hex. Never the salt (a tenant's secret), nor the
    root: from the root anyone could hash a guessed prompt into the salt's block keys on /kv_events."""
    if salt is None:
        return "none"
    return hashlib.blake2b(root_key(salt).to_bytes(8, "little"), digest_size=8, person=b"kvfleet-label").hexdigest()


class Router:
    def __init__(self, config: RoutingConfig, events: KVEventsConfig, tokens_per_block: int, num_groups: int) -> None:
        s = config
        self.policy = s.policy
        self.B = tokens_per_block
        self.weights = (s.primary_weight, s.host_weight, s.load_weight, s.free_weight)
        self.always_events = s.policy == "kv" or events.always or events.publisher == "zmq"
        self.index = KVIndex(num_groups, 1 << 30, self.B)
        self.stream = KVEventStream(events.buffer, self.B, self.index, buffer_always=events.always)
        self.publisher = KVEventPublisher(events, self.B, num_groups, self.index, salt_label)  # ZMQ, vLLM's format
        self.free = [0] * num_groups  # each group's free primary blocks, from its last step
        self.reuse_table: list[int] | None = None  # kvcache.events.reuse_table of the ranks
        self.partial_worth = 0  # kvcache.events.partial_reuse_worth of the ranks: 0 without partial reuse
        self._rr = 0
        self._events_on = False
        self._tally = _Tally(num_groups)
        self.salt_counts: dict[str, int] = {}
        self._reported_errors = 0
        self._last_hits = 0  # prompt blocks the last choice found on its group

    def group_started(self, dp: int, info: dict[str, Any]) -> None:
        """Group `dp`'s tp rank 0 is set up (a start or a restart): its cache is empty, all its primary blocks
        free (a room the `kv` score weighs before its first step reports one), and its slots on every tier are
        the most blocks the index may hold for it."""
        self.free[dp] = info["max_num_blocks"]
        self.index.max_blocks[dp] = info["kv_slots"]

    # ---- the decision -------------------------------------------------------------------------------------
    @property
    def events_on(self) -> bool:
        """Whether the ranks record KV events: always for `kv` (or `kv_events`), else while someone listens."""
        return self.always_events or self.stream.listening

    def keys(self, prompt: list[int], salt: Any) -> list[int] | None:
        """The prompt's block keys, computed once (the rank publishes with them), or None while events are off."""
        return prompt_keys(prompt, self.B, salt) if self._events_on or self.events_on else None

    def place(self, req: Any, groups: Sequence[Any], up: list[int]) -> int:
        """Put a new (or re-queued) request's placement on it: its block keys (computed once), its dp group,
        its predicted reuse; returns the group. The caller queues it there."""
        if req.block_keys is None:
            req.block_keys = self.keys(req.prompt, req.cache_salt)
        if req.placed in up:  # the fleet's router chose this group (first placement only): no second routing
            req.dp, req.placed = req.placed, -1
            predicted = self.held(req.dp, req.block_keys, len(req.prompt))
        else:
            req.dp, predicted = self.choose(req.block_keys, len(req.prompt), groups, up)
        partial = self._partial_tokens(req)
        if not req.counted:  # a request moved off a dead group after its first commit is not counted again
            req.predicted = predicted + (self.partial_worth if partial else 0)
        req.hit_tokens = self._last_hits * self.B + partial
        return req.dp

    def _partial_tokens(self, req: Any) -> int:
        """Prompt tokens past its held full blocks that its group's rank will reuse in part, as the rank matches
        (`KVCacheManager.match`: at most a block less one, never the prompt's last token)."""
        if not self.partial_worth or req.block_keys is None or not self._events_on:
            return 0
        return self.index.partial_tokens(req.dp, req.prompt, req.block_keys, self._last_hits, req.cache_salt)

    def choose(self, keys: list[int] | None, prompt_len: int, groups: Sequence[Any], up: list[int]) -> tuple[int, int]:
        """(dp group, predicted reused blocks) for a request of `prompt_len` tokens with these block keys."""
        limit = max(0, (prompt_len - 1) // self.B)
        hits = {dp: self.index.prefix(dp, keys[:limit]) if keys and self._events_on else (0, 0) for dp in up}
        if keys and self._events_on:  # a prefix on its way into a group's cache counts as held there
            for dp in up:
                coming = shared_blocks(keys[:limit], itertools.chain(groups[dp].waiting, groups[dp].running))
                if coming > sum(hits[dp]):
                    hits[dp] = (coming - hits[dp][1], hits[dp][1])
        if self.policy == "round_robin":
            dp = up[self._rr % len(up)]
            self._rr += 1
        elif self.policy == "least_loaded":
            dp = min(up, key=lambda d: groups[d].load)
        else:
            need = -(-prompt_len // self.B)

            def rank(d: int) -> tuple:
                room = self.free[d] - waiting_blocks(groups[d], self.B)
                return kv_rank(self.weights, self.B, hits[d], group_load(groups[d]), need, room,
                               len(self.index.blocks[d])) + (d,)

            dp = min(up, key=rank)
        self._last_hits = sum(hits[dp])
        return dp, self.predicted(self._last_hits)

    def held(self, dp: int, keys: list[int] | None, prompt_len: int) -> int:
        """The predicted reuse of a prompt on group `dp`, chosen elsewhere (the fleet's router)."""
        limit = max(0, (prompt_len - 1) // self.B)
        self._last_hits = sum(self.index.prefix(dp, keys[:limit])) if keys and self._events_on else 0
        return self.predicted(self._last_hits)

    def cached_tokens(self, req: Any) -> int:
        """Prompt tokens the request's group holds for it now (full blocks, either tier), at least what its
        placement predicted: what its admission will not compute. Placement guessed when the request arrived,
        before the requests ahead of it had published the prefix they share (the plan's budget claim)."""
        if not req.block_keys or not self._events_on:
            return req.hit_tokens
        limit = max(0, (len(req.prompt) - 1) // self.B)
        return max(req.hit_tokens, sum(self.index.prefix(req.dp, req.block_keys[:limit])) * self.B)

    def predicted(self, blocks: int) -> int:
        table = self.reuse_table
        return table[min(blocks, len(table) - 1)] if table else blocks

    # ---- the step: flags out, events and realized reuse in --------------------------------------------------
    def plan(self, plans: list) -> None:
        """Tell each group's ranks whether to record events, and whether to send a snapshot (a resync)."""
        on = self.events_on
        if self._events_on and not on:
            for dp in range(len(self.index.blocks)):
                self.drop_group(dp)
        self._events_on = on
        for dp, p in enumerate(plans):
            if p is not None:
                p.kv_events = on
                p.kv_resync = on and self.index.resync[dp]

    def observe(self, dp: int, res: Any, requests: dict) -> None:
        """A group's step result (tp rank 0's): its events into the index and the stream, its first commits."""
        if res.free_blocks >= 0:
            self.free[dp] = res.free_blocks
        if res.kv_events:
            self.index.apply(dp, res.kv_events)
            self.stream.publish(dp, res.kv_events)
            self.publisher.publish(dp, res.kv_events)
        for rid, realized in res.first_reuse.items():
            req = requests.get(rid)
            if req is not None and req.predicted >= 0:
                self._count(req, dp, realized)

    def drop_group(self, dp: int) -> None:
        """What the engine knows of a group's cache is gone: the group went down, restarts with an empty cache,
        or a step of it raised and its events were lost (the engine calls this). Its rank's next snapshot
        rebuilds it, on the index and on the stream."""
        self.index.drop_group(dp)
        self.stream.cleared(dp)
        self.publisher.cleared(dp)

    # ---- records ------------------------------------------------------------------------------------------
    def _count(self, req: Any, dp: int, realized: int) -> None:
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

    def take_record(self) -> dict[str, Any]:
        """The `routing` field of the iteration just stepped, and a fresh tally."""
        t, self._tally = self._tally, _Tally(len(self.free))
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


FLEET_FIELDS = ("requests", "predictedReusedBlocks", "realizedReusedBlocks")


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
