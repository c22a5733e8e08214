"""Placement across dp groups: which group a request goes to, and the reuse it is predicted to find there.

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

The KV index and the groups' free blocks are the KV event hub's (engine/kv_hub.py); how right each prediction
was goes into the records' `routing` field (engine/routing_record.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from engine.config import RoutingConfig, load_weight_for
from engine.kv_hub import KVEventHub
from engine.scheduler import shared_blocks

POLICIES = ("kv", "least_loaded", "round_robin")


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


class Placement:
    """Which dp group a request goes to, and what it is predicted to reuse there, from the hub's index."""

    def __init__(self, config: RoutingConfig, hub: KVEventHub) -> None:
        s = config
        self.policy = s.policy
        self.hub = hub
        self.B = hub.B
        self._load_weight = s.load_weight
        self.weights = (s.primary_weight, s.host_weight, load_weight_for(s.load_weight, "cpu"), s.free_weight)
        self.reuse_table: list[int] | None = None  # kvcache.events.reuse_table of the ranks
        self.partial_worth = 0  # kvcache.events.partial_reuse_worth of the ranks: 0 without partial reuse
        self._rr = 0
        self._last_hits = 0  # prompt blocks the last choice found on its group

    def resolve_load_weight(self, device: str) -> None:
        """An unset load weight (`device=auto`) takes the default of the ranks' device, once it is known."""
        self.weights = (*self.weights[:2], load_weight_for(self._load_weight, device), self.weights[3])

    def place(self, req: Any, groups: Sequence[Any], up: list[int]) -> int:
        """Put a new (or re-queued) request's placement on it: its block keys (computed once), its dp group,
        its predicted reuse; returns the group. The caller queues it there."""
        if req.block_keys is None:
            req.block_keys = self.hub.keys(req.prompt, req.cache_salt)
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
        if not self.partial_worth or req.block_keys is None or not self.hub.recording:
            return 0
        return self.hub.index.partial_tokens(req.dp, req.prompt, req.block_keys, self._last_hits, req.cache_salt)

    def choose(self, keys: list[int] | None, prompt_len: int, groups: Sequence[Any], up: list[int]) -> tuple[int, int]:
        """(dp group, predicted reused blocks) for a request of `prompt_len` tokens with these block keys."""
        limit = max(0, (prompt_len - 1) // self.B)
        index, known = self.hub.index, bool(keys) and self.hub.recording
        hits = {dp: index.prefix(dp, keys[:limit]) if known else (0, 0) for dp in up}
        if known:  # a prefix on its way into a group's cache counts as held there
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
                room = self.hub.free[d] - waiting_blocks(groups[d], self.B)
                return kv_rank(self.weights, self.B, hits[d], group_load(groups[d]), need, room,
                               len(index.blocks[d])) + (d,)

            dp = min(up, key=rank)
        self._last_hits = sum(hits[dp])
        return dp, self.predicted(self._last_hits)

    def held(self, dp: int, keys: list[int] | None, prompt_len: int) -> int:
        """The predicted reuse of a prompt on group `dp`, chosen elsewhere (the fleet's router)."""
        limit = max(0, (prompt_len - 1) // self.B)
        self._last_hits = sum(self.hub.index.prefix(dp, keys[:limit])) if keys and self.hub.recording else 0
        return self.predicted(self._last_hits)

    def cached_tokens(self, req: Any) -> int:
        """Prompt tokens the request's group holds for it now (full blocks, either tier), by its index: not the
        prefix placement counted on its way (`hit_tokens` does), which a request admitted now would compute."""
        if not req.block_keys or not self.hub.recording:
            return 0
        limit = max(0, (len(req.prompt) - 1) // self.B)
        return sum(self.hub.index.prefix(req.dp, req.block_keys[:limit])) * self.B

    def predicted(self, blocks: int) -> int:
        table = self.reuse_table
        return table[min(blocks, len(table) - 1)] if table else blocks
