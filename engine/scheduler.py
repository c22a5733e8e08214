"""A dp group's queues and the rule that plans its step.

Each group keeps its waiting requests (FIFO), its running ones (oldest first: their order is the ranks'
preemption priority) and the ids to close on its ranks next step. A plan spends the step's token budget on
decodes first (one token each), then on prefill chunks, oldest first, then admits waiting requests while the
budget lasts and the group runs fewer than `max_num_seqs`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.errors import RequestFailed
from engine.messages import GroupHealth
from engine.request_times import RequestTimes
from workers.sampling_params import SamplingParams
from workers.step import NewRequest, StepPlan, StepResult, Work


@dataclass
class TokenEvent:
    token_id: int
    finish_reason: str | None = None  # "stop" | "length" | None


@dataclass(eq=False)  # a request is itself: `in` / `remove` on a group's queues compare identity, not fields
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    max_tokens: int  # what it may generate in all (vLLM: SamplingParams.max_tokens)
    # of `prompt`, the last tokens that are output sampled before this engine had it (re-sent by the ingress)
    num_output_tokens: int = 0
    dp: int = -1
    generated: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # what the ranks last reported as computed
    new_token_id: int | None = None  # sampled last step, not yet sent to the ranks
    created: bool = False
    done: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    warmup: bool = False
    expiry: Any = None  # while no dp group is up: the timer that fails the request at its placement deadline
    block_keys: list[int] | None = None  # the prompt's full blocks' keys (engine/placement.py), or None
    predicted: int = -1  # reused blocks its placement predicted; -1 until placed and once counted
    counted: bool = False  # in a record's `routing` (once, on the group of its first commit: not again if moved)
    hit_tokens: int = 0  # prompt tokens its placement expects the rank to find cached (the group's load)
    placed: int = -1  # the dp group the fleet's router chose (deployment/router/fleet_view.py), until placed there
    fleet_predicted: int = -1  # the reused blocks the fleet's router predicted; -1 if it did not place it
    times: RequestTimes = field(default_factory=RequestTimes)  # for vLLM's request metrics

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.generated)

    def requeue(self) -> None:
        """Forget the ranks that held it (their group went down): it prefills again from its prompt and the
        tokens it already generated, on whatever group takes it."""
        self.created = False
        self.num_computed_tokens = 0
        self.new_token_id = None
        self.times.queued = time.monotonic()


@dataclass
class Group:
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    to_close: list = field(default_factory=list)
    down: str | None = None  # why the group does not step now (one of its ranks is gone; it may be restarting)
    failures: int = 0  # deaths and failed restarts since it last ran a request
    stays_down: bool = False  # failed too often in a row: not restarted again
    restarts: int = 0
    node: str | None = None  # the Ray node its ranks are on (or the one its placement targets)
    lost_node: str | None = None  # the node its ranks were unreachable on: a restart waits for Ray's verdict
    pending: bool = False  # its restart waits for resources to place its ranks (no node has room)
    admitted: list = field(default_factory=list)  # queue times (s) of the requests its last plan admitted

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def health(self, restarting: bool) -> GroupHealth:
        return GroupHealth(self.down is None, self.down, self.failures, self.restarts, restarting, self.stays_down,
                           self.pending, self.node)

    def finish(self, req: Request) -> None:
        """A request is done (finished or failed): off the group, closed on its ranks next step."""
        req.done = True
        if req in self.running:
            self.running.remove(req)
        self.to_close.append(req.id)  # a tp rank that did not fail it still holds it


def apply_result(g: Group, res: StepResult, requests: dict[str, Request],
                 eos: tuple[int, ...]) -> list[tuple[Request, TokenEvent | RequestFailed]]:
    """Move a group's requests on by its tp rank 0's step result; what to deliver to whom (a finished or failed
    request is done and off the group)."""
    out: list[tuple[Request, TokenEvent | RequestFailed]] = []
    for rid, why in res.failed.items():
        req = requests.get(rid)
        if req is not None and not req.done:
            g.finish(req)
            out.append((req, RequestFailed(f"request {rid} failed: {why}")))
    for rid, reused in res.reused.items():
        if rid in requests:
            requests[rid].num_computed_tokens = reused
    for rid in res.recomputed:
        if rid in requests:
            requests[rid].num_computed_tokens = 0
    for rid, (history, token) in res.ran.items():
        req = requests.get(rid)
        if req is None or req.done:
            continue
        req.num_computed_tokens = history
        if token is None:
            continue
        req.generated.append(token)
        p = req.params
        reason = None
        if (not p.ignore_eos and token in eos) or token in p.stop_token_ids:  # any eos id stops it
            reason = "stop"
        elif len(req.generated) >= req.max_tokens:
            reason = "length"
        if reason is None:
            req.new_token_id = token
        else:
            g.finish(req)
        out.append((req, TokenEvent(token, reason)))
    return out


def shared_blocks(keys: list[int] | None, requests: Any) -> int:
    """The most leading full blocks of `keys` that one of `requests` still to be prefilled past them will
    publish: a prefix on its way into the group's cache, which the index does not show yet."""
    best = 0
    if not keys:
        return 0
    for r in requests:
        theirs = r.block_keys
        if not theirs or theirs[0] != keys[0] or r.num_computed_tokens >= len(r.prompt):
            continue
        n = 0
        for a, b in zip(keys, theirs, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def is_decoding(r: Request) -> bool:
    return r.total - r.num_computed_tokens <= 1


def prefill_cap(groups: list[Group], chunk: int) -> int:
    """The prompt tokens a group's step may prefill beside decodes, 0 = its whole budget. The groups step in
    lockstep, so one group's long prefill step holds every group's decodes back: while requests decode and the
    queue is short (at most one request a group waits), a prompt goes in chunks of `chunk`
    (`max_prefill_tokens_while_decoding`) and the decodes ride along (Sarathi-Serve's stall-free batching); a
    longer queue is served for throughput, at the whole budget. Off by default: it pays for dp > 1 in
    lockstep, while at dp 1 its TPOT gain was within the noise and its TTFT loss was not (bench/README.md)."""
    if not chunk or sum(len(g.waiting) for g in groups) > len(groups):
        return 0
    return chunk if any(is_decoding(r) for g in groups for r in g.running) else 0


def plan_group(g: Group, iteration: int, s: EngineConfig,
               cached_tokens: Callable[[Request], int] | None = None, cap: int = 0) -> StepPlan:
    """One group's plan: a token budget spent on decodes first (one token each), then prefill chunks of the
    running requests, oldest first, then on waiting requests, admitted only while the budget lasts (and fewer
    than `max_num_seqs` run), as vLLM's scheduler does: a request created on the ranks matches the reuse tree
    then, so one that waits behind another of the same prefix finds that prefix's blocks published instead of
    prefilling it again beside it. A new request's claim on the budget is what its placement does not expect
    cached (the rank computes at most its budget past what it reuses): `cached_tokens(req)` says what the
    group holds now, from its KV index (engine/placement.py), the placement's prediction if that is more. A
    request whose prefix a running request is still prefilling waits for it (behind it, not in place of the
    requests after it) until the index holds it: admitted beside it, it would compute the same blocks again.
    `cap` (`prefill_cap`), when not 0, bounds the step's prompt tokens."""
    plan = StepPlan(iteration, close=g.to_close)
    g.to_close = []
    g.admitted = []
    budget = s.max_num_batched_tokens
    decodes = [r for r in g.running if is_decoding(r)]
    prefills = [r for r in g.running if not is_decoding(r)]
    given: dict[str, int] = {}
    for r in decodes[:budget]:
        given[r.id] = 1
    budget -= len(given)
    if cap:
        budget = min(budget, cap)
    for r in prefills:
        if budget <= 0:
            break
        n = min(budget, r.total - r.num_computed_tokens)
        given[r.id] = n
        budget -= n
    now = time.monotonic()
    later: list[Request] = []
    while g.waiting and len(g.running) < s.max_num_seqs and budget > 0:
        req = g.waiting.popleft()
        held = cached_tokens(req) if cached_tokens is not None else 0
        if shared_blocks(req.block_keys, g.running) * s.cache.tokens_per_block > held:
            later.append(req)  # a running request is prefilling its prefix: admitted once that is published
            continue
        hit = max(held, req.hit_tokens)  # placement's guess came before the requests ahead published theirs
        g.admitted.append(now - req.times.queued)
        req.times.scheduled = req.times.scheduled or now
        # a re-queued request prefills what it already generated too, and its sampler goes on where it was
        plan.new.append(NewRequest(req.id, req.prompt + req.generated, req.params, req.cache_salt,
                                   num_output_tokens=req.num_output_tokens + len(req.generated),
                                   block_keys=req.block_keys))
        req.created = True
        g.running.append(req)
        n = min(budget, max(1, req.total - max(req.num_computed_tokens, hit)))
        given[req.id] = n
        budget -= n
    g.waiting.extendleft(reversed(later))
    for r in g.running:  # priority: oldest first
        if r.id in given:
            plan.work.append(Work(r.id, given[r.id], r.new_token_id))
            r.new_token_id = None
    return plan


def share_cores(plans: list[StepPlan | None], groups: list[Group], cores: dict[str, int], own: int) -> None:
    """On CPU, a stepping rank takes the cores of its node that no other group steps on now: a lone request
    decodes on every core (a decode step reads all the weights: memory-bound, and one core does not draw the
    node's bandwidth), a busy machine splits them as configured (`own`, each rank's threads). For tp 1: `cores`
    is each node's CPUs by node id, and a group's node is its rank's."""
    stepping = [(g, p) for g, p in zip(groups, plans, strict=True) if p is not None and (p.work or p.new)]
    busy: dict[str | None, int] = {}  # an empty plan's step takes next to no time: its rank's cores are free
    for g, _ in stepping:
        busy[g.node] = busy.get(g.node, 0) + 1
    for g, p in stepping:
        p.threads = max(own, cores.get(g.node or "", 0) // busy[g.node])


def engine_stats(groups: list[Group], plans: list[StepPlan | None], s: EngineConfig,
                 completed: int) -> dict[str, float]:
    """The engine's stats of the iteration just stepped (aggregator.delta.ENGINE_FIGURES): requests, and the
    batch limits of the configuration (static) and of the groups that are up (runtime)."""
    up = sum(1 for g in groups if g.down is None)
    waits = [w for g, p in zip(groups, plans, strict=True) if p is not None for w in g.admitted]
    return {"numActiveRequests": sum(len(g.running) for g in groups),
            "numQueuedRequests": sum(len(g.waiting) for g in groups),
            "numCompletedRequests": completed,
            "numNewActiveRequests": sum(len(p.new) for p in plans if p is not None),
            "maxNumActiveRequests": up * s.max_num_seqs,
            "maxBatchSizeStatic": len(groups) * s.max_num_seqs, "maxBatchSizeRuntime": up * s.max_num_seqs,
            "maxNumTokensStatic": len(groups) * s.max_num_batched_tokens,
            "maxNumTokensRuntime": up * s.max_num_batched_tokens,
            "newActiveRequestsQueueLatencyMS": 1000 * sum(waits) / len(waits) if waits else 0.0}
