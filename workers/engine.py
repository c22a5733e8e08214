"""The engine: continuous batching over dp groups of rank actors that step in lockstep.

It lives in the engine's Serve replica. Each step it plans, per dp group, which requests to create, run and
close (workers/scheduler.py); every rank of the cluster then
steps with its group's plan (an idle group steps with an empty plan, so every rank reports every iteration
and the aggregator can close it). When no group has anything to do the engine does not step at all.
Iterations are numbered globally and continue after the aggregator's last emitted iteration, so a restarted
engine never reuses an iteration number.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray

from aggregator.delta import Iteration

from . import ranks
from .errors import EngineError, RequestError, RequestFailed, check_request, one_line
from .loader import check_model, load_tokenizer
from .sampling import SamplingParams
from .scheduler import Group, Request, plan_group
from .stats_channel import StatsChannel
from .transport import Transport, make_transport
from .worker import NewRequest, StepPlan, StepResult, Work

log = logging.getLogger("kvfleet.engine")


def first_iteration(last_emitted: int | None) -> int:
    """The iteration a (re)started engine begins with: one past what its aggregator already emitted."""
    return 0 if last_emitted is None else max(0, int(last_emitted) + 1)


@dataclass
class TokenEvent:
    token_id: int
    finish_reason: str | None = None  # "stop" | "length" | None


@dataclass
class _StepFailure:
    """A rank's step raised: `rank_gone` when the actor itself is dead or unreachable."""

    rank: int
    error: BaseException

    @property
    def rank_gone(self) -> bool:
        return isinstance(self.error, ray.exceptions.RayActorError)


# A step in which no request ran (every scheduled one found no room) is retried after this pause, doubling up
# to the maximum, or as soon as something changes (a request arrives, finishes or is aborted): never a busy loop.
NO_PROGRESS_PAUSE_S = (0.001, 0.25)


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
        self.stats: StatsChannel | None = None
        self.workers: list = []
        self.transport: Transport | None = None
        self.rank_info: list[dict] = []
        self.iteration = 0
        self.steps = 0
        self.preemptions = 0
        self.error: str | None = None
        self._pgs: list = []
        self._groups = [Group() for _ in range(settings.dp)]
        self._requests: dict[str, Request] = {}
        self._wake = asyncio.Event()  # set while there may be work; cleared only when no group has any
        self._changed = asyncio.Event()  # a request arrived, finished or left since the last step began
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._completed = 0  # requests finished in the iteration being applied

    # ---- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        from aggregator import get_or_create_aggregator

        s = self.settings
        device = ranks.device_of(s)
        dtype = ranks.dtype_of(s, device)
        self.aggregator = get_or_create_aggregator(s.engine_id, self.world_size, s.tp, s.stats_buffer_size)
        health = await self.aggregator.health.remote()
        if (health["world_size"], health["tp"]) != (self.world_size, s.tp):
            raise EngineError(
                f"a stats aggregator for engine {s.engine_id!r} already runs with world_size "
                f"{health['world_size']} and tp {health['tp']}, but this engine has {self.world_size} ranks "
                f"(tp {s.tp}): use another engine_id, or stop the old engine first")
        self.iteration = first_iteration(health.get("last_iter"))
        for dp in range(s.dp):
            pg, workers = await ranks.start_group(s, dp, device, dtype)
            self._pgs.append(pg)
            self.workers += workers
        groups = [self.workers[dp * s.tp:(dp + 1) * s.tp] for dp in range(s.dp)]
        self.rank_info = [info for group in await asyncio.gather(*map(ranks.setup_group, groups)) for info in group]
        self.max_request_tokens = min(info["max_request_tokens"] for info in self.rank_info)
        self.vocab_size = self.rank_info[0]["vocab_size"]
        self.transport = make_transport(s.step_transport, self.workers)
        if s.enable_stats:
            self.stats = StatsChannel(self.aggregator)
            await self.stats.register([info["layout"] for info in self.rank_info])
        await self._warm_up()
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        log.info("engine %s: %d ranks on %s (%s), iterations from %d, requests up to %d tokens", s.engine_id,
                 self.world_size, device, dtype, self.iteration, self.max_request_tokens)

    async def _warm_up(self) -> None:
        """A few excluded steps per dp group (first-call costs), recorded nowhere."""
        params = SamplingParams(max_tokens=2, temperature=0.0)
        prompt = list(range(1, 9))
        new = [NewRequest(f"warmup-{dp}", prompt, params, None, warmup=True) for dp in range(self.settings.dp)]
        plans = [StepPlan(-1, [new[dp]], [Work(new[dp].request_id, len(prompt))], record=False)
                 for dp in range(self.settings.dp)]
        results = await self._warm_up_step(plans)
        plans = [StepPlan(-1, [], [Work(new[dp].request_id, 1, results[dp].ran[new[dp].request_id][1])],
                          record=False) for dp in range(self.settings.dp)]
        await self._warm_up_step(plans)
        await self._warm_up_step([StepPlan(-1, close=[n.request_id], record=False) for n in new])

    async def _warm_up_step(self, plans: list[StepPlan]) -> list[StepResult]:
        results, _, _ = await self._step_all(plans)
        for res in results:
            if isinstance(res, _StepFailure) or res.failed:
                why = one_line(res.error) if isinstance(res, _StepFailure) else next(iter(res.failed.values()))
                raise EngineError(f"warm-up step failed: {why}")
        return results

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self._fail_all(EngineError("the engine is shutting down"))
        if self.stats is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.stats.drained(), 5.0)
            await self.stats.close()
        if self.transport is not None:
            await self.transport.close()
        ranks.stop(self.workers, self._pgs)
        self.workers, self._pgs = [], []

    # ---- requests ----------------------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + completion) served: max_seq_len, or less when one rank's KV cache
        holds less. Advertised by /v1/models and enforced here, so a request is never silently cut short."""
        return min(self.max_seq_len, self.max_request_tokens)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that must never reach a rank (workers.errors.check_request)."""
        check_request(prompt_token_ids, params.max_tokens, self.vocab_size, self.max_model_len, self.max_seq_len)

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
        up = [dp for dp, g in enumerate(self._groups) if g.down is None]
        if not up:
            raise EngineError("every dp group is down")
        req = Request(rid, list(prompt_token_ids), params, cache_salt, params.max_tokens)
        req.dp = min(up, key=lambda dp: self._groups[dp].load)
        self._groups[req.dp].waiting.append(req)
        self._requests[rid] = req
        self._poke()
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
            self._poke()
        log.info("request %s aborted after %d tokens", request_id, len(req.generated))

    async def health(self) -> dict[str, Any]:
        if self.error:
            raise EngineError(self.error)
        return {"ok": True, "ranks": self.world_size, "iteration": self.iteration, "steps": self.steps,
                "running": sum(len(g.running) for g in self._groups),
                "waiting": sum(len(g.waiting) for g in self._groups),
                "down_groups": {str(dp): g.down for dp, g in enumerate(self._groups) if g.down is not None}}

    # ---- the step loop -----------------------------------------------------------------------------------------
    def _poke(self) -> None:
        self._wake.set()
        self._changed.set()

    async def _loop(self) -> None:
        pause = 0.0
        while True:
            await self._wake.wait()
            plans = [None if g.down else plan_group(g, self.iteration, self.settings) for g in self._groups]
            if not any(p is not None and (p.new or p.work or p.close) for p in plans):
                self._wake.clear()
                continue
            for p in plans:
                if p is not None:
                    p.iteration = self.iteration
            self._changed.clear()
            results, deltas, missing = await self._step_all(plans)
            self._completed = 0
            progress = False
            for dp, res in enumerate(results):
                if isinstance(res, _StepFailure):
                    self._group_failed(dp, res)
                    progress = True
                elif res is not None:
                    progress = progress or bool(res.ran or res.failed)
                    self._apply(self._groups[dp], res)
            if self.stats is not None:
                self.stats.put(Iteration(self.iteration, time.time(), deltas, missing, self._figures(plans)))
            self.iteration += 1
            self.steps += 1
            if self.error:
                return
            if progress:
                pause = 0.0
                continue
            lo, hi = NO_PROGRESS_PAUSE_S
            pause = min(max(2 * pause, lo), hi)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), pause)

    def _figures(self, plans: list[StepPlan | None]) -> dict[str, int]:
        """The engine's request figures of the iteration just stepped (aggregator.delta.ENGINE_FIGURES)."""
        up = sum(1 for g in self._groups if g.down is None)
        return {"numActiveRequests": sum(len(g.running) for g in self._groups),
                "numQueuedRequests": sum(len(g.waiting) for g in self._groups),
                "numCompletedRequests": self._completed,
                "numNewActiveRequests": sum(len(p.new) for p in plans if p is not None),
                "maxNumActiveRequests": up * self.settings.max_num_seqs}

    async def _step_all(self, plans: list[StepPlan | None]) -> tuple[list, list, tuple[int, ...]]:
        """Step every rank of each group that has a plan. Per group: tp rank 0's result (with every tp rank's
        failed requests), or the failure of a rank whose step raised (a dead rank first), or None; then every
        rank's stats delta, and the ranks that gave none (not stepped, or failed)."""
        tp = self.settings.tp
        ranks = [rank for rank in range(len(self.workers)) if plans[rank // tp] is not None]
        stepped = await self.transport.step([plans[r // tp] for r in range(len(self.workers))])
        outs = [stepped[r] for r in ranks]
        results: list = [None] * len(plans)
        deltas = [out.delta for out in outs if isinstance(out, StepResult) and out.delta is not None]
        reported = {d.rank for d in deltas}
        missing = tuple(r for r in range(len(self.workers)) if r not in reported)
        for rank, out in zip(ranks, outs, strict=True):
            dp, cur = rank // tp, results[rank // tp]
            if isinstance(out, BaseException):
                fail = _StepFailure(rank, out)
                if not isinstance(cur, _StepFailure) or (fail.rank_gone and not cur.rank_gone):
                    results[dp] = fail
            elif cur is None:
                results[dp] = out
            elif isinstance(cur, StepResult):
                cur.failed.update(out.failed)
        return results, deltas, missing

    def _group_failed(self, dp: int, failure: _StepFailure) -> None:
        """A dead rank takes its dp group down (the others go on); any other step error fails the group's
        running requests, which are closed on every rank, and the group steps on."""
        g = self._groups[dp]
        why = one_line(failure.error)
        if not failure.rank_gone:
            log.error("dp group %d: step of rank %d raised, failing %d running requests: %s", dp, failure.rank,
                      len(g.running), why)
            for req in list(g.running):
                self._finish_failed(g, req, RequestFailed(f"generation failed: {why}"))
            return
        g.down = f"rank {failure.rank} is gone ({type(failure.error).__name__})"
        log.error("dp group %d is down: %s", dp, g.down)
        error = EngineError(f"dp group {dp} is down: {g.down}")
        for req in list(g.waiting) + list(g.running):
            req.done = True
            self._requests.pop(req.id, None)
            req.queue.put_nowait(error)
        g.waiting.clear()
        g.running.clear()
        g.to_close.clear()
        if all(other.down for other in self._groups):
            self.error = "every dp group is down: " + "; ".join(
                f"group {i}: {other.down}" for i, other in enumerate(self._groups))
            self._fail_all(EngineError(self.error))

    def _finish_failed(self, g: Group, req: Request, error: BaseException) -> None:
        req.done = True
        self._requests.pop(req.id, None)
        if req in g.running:
            g.running.remove(req)
        g.to_close.append(req.id)  # a tp rank that did not fail it still holds it
        self._poke()
        req.queue.put_nowait(error)

    def _apply(self, g: Group, res: StepResult) -> None:
        eos = self.tokenizer.eos_token_ids  # any of them stops a request (Llama-3 has two, SmolLM2 has two)
        for rid, why in res.failed.items():
            req = self._requests.get(rid)
            if req is not None and not req.done:
                self._finish_failed(g, req, RequestFailed(f"request {rid} failed: {why}"))
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
            if (not p.ignore_eos and token in eos) or token in p.stop_token_ids:
                reason = "stop"
            elif len(req.generated) >= req.max_new:
                reason = "length"
            if reason is None:
                req.append = token
            else:
                req.done = True
                self._completed += 1
                self._requests.pop(rid, None)
                g.running.remove(req)
                g.to_close.append(rid)
                self._poke()
            req.queue.put_nowait(TokenEvent(token, reason))

    def _fail_all(self, error: BaseException) -> None:
        for req in list(self._requests.values()):
            req.done = True
            req.queue.put_nowait(error)
        self._requests.clear()
        for g in self._groups:
            g.waiting.clear()
            g.running.clear()
