"""The engine: continuous batching over dp groups of rank actors that step in lockstep.

It lives in the Serve ingress replica. Each step it plans, per dp group, which requests to create, run (with
a token budget: decodes first, then prefill chunks, oldest first) and close; every rank of the cluster then
steps with its group's plan (an idle group steps with an empty plan, so every rank reports every iteration
and the aggregator can close it). When no group has anything to do the engine does not step at all.
Iterations are numbered globally and continue after the aggregator's last emitted iteration, so a restarted
engine never reuses an iteration number.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from .loader import check_model, load_tokenizer
from .sampling import SamplingParams
from .worker import NewRequest, RankSpec, RankWorker, StepPlan, StepResult, Work

log = logging.getLogger("kvfleet.engine")

SETUP_TIMEOUT_S = 600.0


class RequestError(ValueError):
    """Bad input for the engine (an HTTP 400): the message says what is wrong, `code` is machine-readable."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class EngineError(RuntimeError):
    """The engine cannot serve (a rank died, or it is shutting down)."""


@dataclass
class TokenEvent:
    token_id: int
    finish_reason: str | None = None  # "stop" | "length" | None


@dataclass
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    max_new: int
    dp: int = -1
    generated: list[int] = field(default_factory=list)
    known_history: int = 0  # what the ranks last reported as computed
    append: int | None = None  # sampled last step, not yet sent to the ranks
    created: bool = False
    done: bool = False
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    warmup: bool = False

    @property
    def total(self) -> int:
        return len(self.prompt) + len(self.generated)


@dataclass
class _Group:
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    to_close: list = field(default_factory=list)

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)


def _device(settings: Any) -> str:
    if settings.device != "auto":
        return settings.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


class Engine:
    """Owns the rank actors and the aggregator handle; `generate` streams one request's tokens."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        check_model(settings.model or None, settings.tp)  # a bad file or tp fails here, before any rank exists
        self.tokenizer = load_tokenizer(settings.model or None)
        self.model_name = settings.served_model_name
        self.max_seq_len = settings.max_seq_len
        self.world_size = settings.dp * settings.tp
        self.max_request_tokens = settings.max_seq_len
        self.vocab_size = 0
        self.aggregator = None
        self.relays: list[ray.actor.ActorHandle] = []
        self.workers: list = []
        self.rank_info: list[dict] = []
        self.iteration = 0
        self.steps = 0
        self.preemptions = 0
        self.error: str | None = None
        self._pgs: list = []
        self._groups = [_Group() for _ in range(settings.dp)]
        self._requests: dict[str, _Request] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()

    # ---- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        from aggregator import get_or_create_aggregator

        s = self.settings
        device = _device(s)
        dtype = s.dtype if s.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        self.aggregator = get_or_create_aggregator(s.engine_id, self.world_size, s.tp, s.stats_buffer_size,
                                                   s.stats_timeout_s)
        health = await self.aggregator.health.remote()
        if (health["world_size"], health["tp"]) != (self.world_size, s.tp):
            raise EngineError(
                f"a stats aggregator for engine {s.engine_id!r} already runs with world_size "
                f"{health['world_size']} and tp {health['tp']}, but this engine has {self.world_size} ranks "
                f"(tp {s.tp}): use another engine_id, or stop the old engine first")
        self.iteration = max(0, int(health.get("last_iter") or -1) + 1)
        actor_cls = ray.remote(RankWorker)
        for dp in range(s.dp):
            bundle = {"CPU": s.num_cpus_per_rank, **({"GPU": 1} if device == "cuda" else {})}
            pg = placement_group([bundle] * s.tp, strategy="STRICT_PACK", name=f"kvfleet-{s.engine_id}-dp{dp}")
            self._pgs.append(pg)
            await asyncio.wait_for(pg.ready(), SETUP_TIMEOUT_S)
            for tp_rank in range(s.tp):
                rank = dp * s.tp + tp_rank
                spec = RankSpec(
                    engine_id=s.engine_id, rank=rank, dp=s.dp, tp=s.tp, model=s.model, device=device, dtype=dtype,
                    seed=s.seed, tokens_per_block=s.tokens_per_block, max_seq_len=s.max_seq_len,
                    max_num_batched_tokens=s.max_num_batched_tokens, kv_cache_bytes=s.kv_cache_bytes,
                    gpu_memory_fraction=s.gpu_memory_fraction, host_cache_bytes=s.host_cache_bytes,
                    enable_block_reuse=s.enable_block_reuse, enable_partial_reuse=s.enable_partial_reuse,
                    enable_stats=s.enable_stats, num_threads=max(1, int(s.num_cpus_per_rank)))
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=tp_rank)
                self.workers.append(actor_cls.options(
                    name=f"kvfleet-rank-{s.engine_id}-{rank}", num_cpus=s.num_cpus_per_rank,
                    num_gpus=1 if device == "cuda" else 0, scheduling_strategy=strategy,
                    max_restarts=0).remote(spec))
        addrs = [await self.workers[dp * s.tp].address.remote() for dp in range(s.dp)]
        self._start_relays({a["node_id"] for a in addrs})
        setups = []
        for dp, addr in enumerate(addrs):
            setups += [w.setup.remote(addr["ip"], addr["port"]) for w in self.workers[dp * s.tp:(dp + 1) * s.tp]]
        self.rank_info = await asyncio.wait_for(asyncio.gather(*setups), SETUP_TIMEOUT_S)
        self.max_request_tokens = min(info["max_request_tokens"] for info in self.rank_info)
        self.vocab_size = self.rank_info[0]["vocab_size"]
        await self._warm_up()
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        log.info("engine %s: %d ranks on %s (%s), iterations from %d, requests up to %d tokens", s.engine_id,
                 self.world_size, device, dtype, self.iteration, self.max_request_tokens)

    def _start_relays(self, node_ids: set[str]) -> None:
        """One stats relay per node that holds ranks (aggregator/relay.py), before the ranks look for it."""
        from aggregator import StatsRelay, relay_name

        for node in sorted(node_ids):
            self.relays.append(StatsRelay.options(
                name=relay_name(self.settings.engine_id, node), get_if_exists=True, num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(self.settings.engine_id))

    async def _warm_up(self) -> None:
        """A few excluded steps per dp group (first-call costs), recorded nowhere."""
        params = SamplingParams(max_tokens=2, temperature=0.0)
        prompt = list(range(1, 9))
        new = [NewRequest(f"warmup-{dp}", prompt, params, None, warmup=True) for dp in range(self.settings.dp)]
        plans = [StepPlan(-1, [new[dp]], [Work(new[dp].request_id, len(prompt))], record=False)
                 for dp in range(self.settings.dp)]
        results = await self._step_all(plans)
        plans = [StepPlan(-1, [], [Work(new[dp].request_id, 1, results[dp].ran[new[dp].request_id][1])],
                          record=False) for dp in range(self.settings.dp)]
        await self._step_all(plans)
        await self._step_all([StepPlan(-1, close=[n.request_id], record=False) for n in new])

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_all(EngineError("the engine is shutting down"))
        for w in self.workers + self.relays:
            try:
                ray.kill(w)
            except Exception:
                pass
        for pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.workers, self.relays, self._pgs = [], [], []

    # ---- requests ----------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that must never reach a rank."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "empty_prompt")
        if self.vocab_size and any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})", "invalid_prompt")
        if n + params.max_tokens > self.max_seq_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_seq_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion).",
                "context_length_exceeded")
        if n + 1 > self.max_request_tokens:
            raise RequestError(
                f"the prompt of {n} tokens cannot fit the KV cache of one rank, which holds requests of at most "
                f"{self.max_request_tokens} tokens", "context_length_exceeded")

    async def generate(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None) -> AsyncIterator[TokenEvent]:
        """Stream a request's tokens; closing the iterator (the client went away) aborts it."""
        if self.error:
            raise EngineError(self.error)
        self.validate(prompt_token_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already running", "duplicate_request_id")
        if params.seed is None and not params.greedy:  # one seed for every tp rank of the group
            params = dataclasses.replace(params, seed=random.getrandbits(63))
        max_new = min(params.max_tokens, self.max_request_tokens - len(prompt_token_ids))
        req = _Request(rid, list(prompt_token_ids), params, cache_salt, max_new)
        req.dp = min(range(len(self._groups)), key=lambda g: self._groups[g].load)
        self._groups[req.dp].waiting.append(req)
        self._requests[rid] = req
        self._wake.set()
        try:
            while True:
                ev = await req.queue.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            if not req.done:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None or req.done:
            return
        req.done = True
        group = self._groups[req.dp]
        if req in group.waiting:
            group.waiting.remove(req)
        if req in group.running:
            group.running.remove(req)
            group.to_close.append(req.id)
            self._wake.set()
        log.info("request %s aborted after %d tokens", request_id, len(req.generated))

    async def health(self) -> dict[str, Any]:
        if self.error:
            raise EngineError(self.error)
        return {"ok": True, "ranks": self.world_size, "iteration": self.iteration, "steps": self.steps,
                "running": sum(len(g.running) for g in self._groups),
                "waiting": sum(len(g.waiting) for g in self._groups)}

    # ---- the step loop -----------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            plans = [self._plan(g) for g in self._groups]
            if not any(p.new or p.work or p.close for p in plans):
                self._wake.clear()
                continue
            for p in plans:
                p.iteration = self.iteration
            try:
                results = await self._step_all(plans)
            except Exception as e:  # a rank died or failed: nothing can be served consistently any more
                self.error = f"rank step failed at iteration {self.iteration}: {e}"
                log.error("engine %s stopped: %s", self.settings.engine_id, self.error)
                self._fail_all(EngineError(self.error))
                return
            self.iteration += 1
            self.steps += 1
            for g, res in zip(self._groups, results, strict=True):
                self._apply(g, res)

    async def _step_all(self, plans: list[StepPlan]) -> list[StepResult]:
        """Step every rank with its group's plan; returns tp rank 0's result per group."""
        tp = self.settings.tp
        refs = [w.step.remote(plans[rank // tp]) for rank, w in enumerate(self.workers)]
        results = await asyncio.gather(*refs)
        return [results[dp * tp] for dp in range(len(plans))]

    def _plan(self, g: _Group) -> StepPlan:
        s = self.settings
        plan = StepPlan(self.iteration, close=g.to_close)
        g.to_close = []
        while g.waiting and len(g.running) < s.max_num_seqs:
            req = g.waiting.popleft()
            plan.new.append(NewRequest(req.id, req.prompt, req.params, req.cache_salt))
            req.created = True
            g.running.append(req)
        budget = s.max_num_batched_tokens
        decodes = [r for r in g.running if r.total - r.known_history <= 1]
        prefills = [r for r in g.running if r.total - r.known_history > 1]
        given: dict[str, int] = {}
        for r in decodes[:budget]:
            given[r.id] = 1
        budget -= len(given)
        for r in prefills:
            if budget <= 0:
                break
            n = min(budget, r.total - r.known_history)
            given[r.id] = n
            budget -= n
        for r in g.running:  # priority: oldest first
            if r.id in given:
                plan.work.append(Work(r.id, given[r.id], r.append))
                r.append = None
        return plan

    def _apply(self, g: _Group, res: StepResult) -> None:
        eos = self.tokenizer.eos_token_id
        for rid, reused in res.reused.items():
            req = self._requests.get(rid)
            if req is not None:
                req.known_history = reused
        self.preemptions += len(res.recomputed) + len(res.suspended)
        for rid in res.recomputed:
            req = self._requests.get(rid)
            if req is not None:
                req.known_history = 0
        for rid, (history, token) in res.ran.items():
            req = self._requests.get(rid)
            if req is None or req.done:
                continue
            req.known_history = history
            if token is None:
                continue
            req.generated.append(token)
            p = req.params
            reason = None
            if (not p.ignore_eos and token == eos) or token in p.stop_token_ids:
                reason = "stop"
            elif len(req.generated) >= req.max_new:
                reason = "length"
            if reason is None:
                req.append = token
            else:
                req.done = True
                self._requests.pop(rid, None)
                g.running.remove(req)
                g.to_close.append(rid)
                self._wake.set()
            req.queue.put_nowait(TokenEvent(token, reason))

    def _fail_all(self, error: BaseException) -> None:
        for req in list(self._requests.values()):
            req.done = True
            req.queue.put_nowait(error)
        self._requests.clear()
        for g in self._groups:
            g.waiting.clear()
            g.running.clear()
