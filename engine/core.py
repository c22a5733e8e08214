"""The engine: continuous batching over dp groups of rank actors that step in lockstep.

It lives in the engine's Serve replica. Each step it plans, per dp group, which requests to create, run and
close (engine/scheduler.py); every rank then steps with its group's plan (an idle group steps with an empty
plan, so every rank reports every iteration and the aggregator can close it). When no group has anything to
do the engine does not step. Iterations continue after the aggregator's last emitted one, so a restarted
engine never reuses an iteration number.

Failures: a rank whose step call fails because the actor is gone takes its dp group down; the others keep
stepping. The group's requests are re-queued at once (on a group that is up, if any) and prefill again from
prompt + tokens generated so far (a seeded sampler draws on where it was): their streams go on with no gap
and no repeat. The group restarts as new actors after a backoff (engine/recovery.py) and serves again once
set up and warmed up; after `max_group_restarts` failures in a row it stays down.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator

from aggregator.delta import Iteration
from engine.backoff import backoff_s
from engine.config import EngineConfig
from engine.errors import (
    RETRY_AFTER_DOWN_S,
    EngineError,
    EngineStopping,
    Overloaded,
    RequestError,
    check_request,
    one_line,
)
from engine.kv_hub import KVEventHub
from engine.lifecycle import EngineLifecycle
from engine.messages import ADMITTED, Admitted, EngineHealth, GroupState, KVStreamEvent, LoadReport
from engine.placement import Placement, group_load, waiting_blocks
from engine.recovery import GroupRecovery, Orphans
from engine.request_times import ArrivalRate, RequestRecorder
from engine.routing_record import RoutingRecord
from engine.scheduler import (
    Group,
    Request,
    TokenEvent,
    apply_result,
    engine_stats,
    plan_group,
    prefill_cap,
    share_cores,
)
from engine.stats_channel import StatsChannel
from engine.transport import StepFailure, Transport, send_step
from workers.model_setting import check_model, load_tokenizer
from workers.sampling_params import SamplingParams
from workers.step import LAST_SAMPLED, StepPlan, StepResult, Work

log = logging.getLogger("kvfleet.engine")


# A step in which no request ran (every scheduled one found no room) is retried after this pause, doubling up
# to the maximum, or as soon as something changes (a request arrives, finishes or is aborted): never a busy loop.
NO_PROGRESS_PAUSE_S = (0.001, 0.25)
# A step sent ahead (async scheduling) goes this long before the step in flight should end: enough for the hop
# to the rank (~1 ms on CPU) and a late timer in a busy process, short enough that a request arriving before it
# is admitted at the next step (bench/README.md, "Fifteenth session").
AHEAD_MARGIN_S = 0.02
PREFILL_WINDOW = 64  # the recent steps with prompt work whose rate the load report gives (`prefill_tokens_per_s`)
DEMAND_WINDOW_S = 10.0  # the arrivals whose uncached prompt tokens a second the load report gives


class Engine(EngineLifecycle, GroupRecovery):
    """Owns the rank actors and the aggregator handle; `generate` streams one request's tokens."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = c = config
        check_model(c.model or None, c.tp, c.simulation.profile)  # a bad file or tp fails here, before any rank exists
        self.tokenizer = load_tokenizer(c.model or None)
        self.model_name = c.served_model_name
        self.max_seq_len = c.cache.max_seq_len
        self.world_size = c.world_size
        self.max_request_tokens = self.max_seq_len
        self._limits = [self.max_seq_len] * c.dp  # per dp group: the longest request its ranks hold
        self.vocab_size = 0
        self.aggregator = None
        self.stats: StatsChannel | None = None
        self.workers: list = []  # per rank: its actor, or None while its group is down
        self.transport: Transport | None = None  # how the ranks are stepped (engine/transport.py)
        self.rank_info: list[dict] = []
        self.iteration = 0
        self.steps = 0
        self.preemptions = 0
        self.error: str | None = None
        self._pgs: list = []
        self._groups = [Group() for _ in range(c.dp)]
        self.hub = KVEventHub(c.kv_events, c.routing.policy == "kv", c.cache.tokens_per_block, c.dp)
        self.placement = Placement(c.routing, self.hub)
        self.routing_record = RoutingRecord(c.routing.policy, c.dp, self.hub.index)
        self._requests: dict[str, Request] = {}
        # while no dp group is up; one that expires fails with a 503 (recovery.py) and is forgotten here
        self._orphans = Orphans(c.placement_timeout_s, lambda req: self._requests.pop(req.id, None))
        self._restarting: dict[int, asyncio.Task] = {}
        self._closing = False
        self._device = self._dtype = ""
        self._cores: dict[str, int] = {}  # CPUs of each node that holds a rank (CPU, tp 1), by node id
        self._wake = asyncio.Event()  # set while there may be work; cleared only when no group has any
        self._changed = asyncio.Event()  # a request arrived, finished or left since the last step began
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()
        self._completed = 0  # requests finished in the iteration being applied
        self.recorder = RequestRecorder(c.served_model_name, c.cache.max_seq_len, c.dp)
        self._prefill = collections.deque(maxlen=PREFILL_WINDOW)  # (prompt tokens, seconds) of recent steps
        self._arrivals = ArrivalRate(DEMAND_WINDOW_S)  # uncached prompt tokens of new requests
        self._decode_s = 0.0  # the last decode-only step's time on its slowest rank (when to send one ahead)

    # ---- requests ----------------------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + completion) served: max_seq_len, or less when one rank's KV cache
        holds less. Advertised by /v1/models and enforced here, so a request is never silently cut short."""
        return min(self.max_seq_len, self.max_request_tokens)

    def _set_limit(self, dp: int, infos: list[dict]) -> None:
        """Group `dp`'s ranks hold requests up to this many tokens (each (re)start sizes its caches anew: on
        CUDA from the memory free then); what the engine admits is the least of every group's."""
        self._limits[dp] = min(info["max_request_tokens"] for info in infos)
        before, self.max_request_tokens = self.max_request_tokens, min(self._limits)
        if self.max_request_tokens != before and self.steps:
            log.warning("dp group %d holds requests up to %d tokens: the engine now admits up to %d (was %d)",
                        dp, self._limits[dp], self.max_model_len, min(self.max_seq_len, before))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError for a request that must never reach a rank (engine.errors.check_request)."""
        check_request(prompt_token_ids, params.max_tokens, self.vocab_size, self.max_model_len, self.max_seq_len)

    async def generate(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None, announce: bool = False, num_output_tokens: int = 0,
                       placed: tuple[int, int, int] | None = None) -> AsyncIterator[TokenEvent | Admitted]:
        """Stream a request's tokens; closing the iterator (the client went away) aborts it. `announce`:
        `ADMITTED` first, once the request is admitted (the ingress answers a refusal before any response starts).
        `num_output_tokens`, `placed`: as in `submit`."""
        req = self.submit(request_id, prompt_token_ids, params, cache_salt, num_output_tokens, placed)
        try:
            if announce:
                yield ADMITTED
            async for ev in self.stream(req):
                yield ev
        finally:
            if not req.done:  # left early: free its blocks
                self.abort(req.id)

    def submit(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
               cache_salt: str | None = None, num_output_tokens: int = 0,
               placed: tuple[int, int, int] | None = None) -> Request:
        """Admit a request, or refuse it at once: RequestError (bad input), Overloaded (the waiting queue is
        full), EngineError (no dp group can ever take it, or shutting down). `num_output_tokens`: tokens another
        engine already sampled for it (the ingress re-sends a dead replica's request as prompt + those tokens), so a
        seeded sampler draws on where it was. `placed`: (dp group, prompt blocks it holds, prompt tokens past them
        its rank reuses in part) as the fleet's router chose them; the request goes there while that group is up,
        else where this engine's routing puts it."""
        if self.error:
            raise EngineError(self.error, RETRY_AFTER_DOWN_S)
        if self._closing:
            raise EngineStopping(f"engine {self.config.engine_id} is shutting down")
        self.validate(prompt_token_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._requests:
            raise RequestError(f"request id {rid!r} is already running", "duplicate_request_id")
        waiting = len(self._orphans) + sum(len(g.waiting) for g in self._groups)
        if waiting >= self.config.max_waiting_requests:
            raise Overloaded(f"{waiting} requests are waiting already (max_waiting_requests); retry later")
        if params.seed is None and not params.greedy:  # one seed for every tp rank of the group
            params = dataclasses.replace(params, seed=secrets.randbits(63))  # not predictable from others' seeds
        if params.min_tokens and not params.all_stop_token_ids:  # what the ranks' samplers hold back until then
            eos = () if params.ignore_eos else tuple(self.tokenizer.eos_token_ids)
            params = dataclasses.replace(params, all_stop_token_ids=eos + params.stop_token_ids)
        n = num_output_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < len(prompt_token_ids):
            raise RequestError(f"num_output_tokens must be an integer in [0, {len(prompt_token_ids)}), got {n!r}")
        req = Request(rid, list(prompt_token_ids), params, cache_salt, params.max_tokens,
                      num_output_tokens=n)
        if placed is not None:
            worth = self.placement.partial_worth if placed[2] else 0  # the block its rank reuses in part, if any
            req.placed, req.fleet_predicted = placed[0], self.placement.predicted(placed[1]) + worth
        self._place(req)
        self._requests[rid] = req
        self._arrivals.add(max(0, len(req.prompt) - req.hit_tokens), time.monotonic())
        return req

    async def stream(self, req: Request) -> AsyncIterator[TokenEvent]:
        """The tokens of a submitted request (the caller aborts it if it leaves early, as `generate` does)."""
        while True:
            ev = await req.queue.get()
            if isinstance(ev, BaseException):
                raise ev
            yield ev
            if ev.finish_reason is not None:
                return

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is None or req.done:
            return
        req.done = True
        self.recorder.finish(req, "abort", time.monotonic())
        self._orphans.remove(req)
        if req.dp < 0:
            return
        group = self._groups[req.dp]
        if req in group.waiting:
            group.waiting.remove(req)
        if req in group.running:
            group.running.remove(req)
            group.to_close.append(req.id)
            self._poke()
        log.info("request %s aborted after %d tokens", request_id, len(req.generated))

    async def kv_events(self, after: str | None, timeout_s: float) -> list[KVStreamEvent]:
        """Long poll of the KV event stream (engine/kv_stream.py): its events after `after`."""
        return await self.hub.stream.wait(after, timeout_s)

    def groups_state(self) -> list[GroupState]:
        """What the fleet's router weighs besides the blocks, per dp group (engine/messages.py)."""
        B = self.config.cache.tokens_per_block
        return [GroupState(g.down is None and not g.stays_down, group_load(g),
                           self.hub.free[dp] - waiting_blocks(g, B)) for dp, g in enumerate(self._groups)]

    def load_report(self) -> LoadReport:
        """The engine's load for Serve's autoscaling policy (deployment/autoscale.py): its queues and KV room,
        exact; the prompt tokens no group holds are those its placement did not find cached."""
        uncached = sum(len(r.prompt) for r in self._orphans.reqs)
        running = waiting = short = 0
        usage, up = 0.0, 0
        B = self.config.cache.tokens_per_block
        for dp, g in enumerate(self._groups):
            for r in itertools.chain(g.waiting, g.running):
                uncached += max(0, len(r.prompt) - max(r.num_computed_tokens, r.hit_tokens))
            running += len(g.running)
            waiting += len(g.waiting)
            if g.down is None and not g.stays_down:
                up += 1
                usage += 1 - self.hub.free[dp] / max(1, self.hub.total[dp])
                short += self.hub.free[dp] < waiting_blocks(g, B)
        tokens = sum(n for n, _ in self._prefill)
        seconds = sum(s for _, s in self._prefill)
        return LoadReport(uncached, running, waiting + len(self._orphans), up * self.config.max_num_seqs,
                          usage / up if up else 0.0, short, tokens / seconds if seconds else 0.0,
                          self._arrivals.per_s(time.monotonic()))

    async def health(self) -> EngineHealth:
        """The engine's state; raises EngineError (an HTTP 503) while no dp group serves."""
        if self.error:
            raise EngineError(self.error, RETRY_AFTER_DOWN_S)
        down = {str(dp): g.down for dp, g in enumerate(self._groups) if g.down is not None}
        if len(down) == len(self._groups):
            raise EngineError("no dp group is up: " + "; ".join(f"group {dp}: {why}" for dp, why in down.items()),
                              RETRY_AFTER_DOWN_S)
        groups = {str(dp): g.health(dp in self._restarting) for dp, g in enumerate(self._groups)}
        return EngineHealth(True, self.world_size, self.iteration, self.steps,
                            sum(len(g.running) for g in self._groups),
                            len(self._orphans) + sum(len(g.waiting) for g in self._groups), down, groups)

    # ---- placement ---------------------------------------------------------------------------------------------
    def _place(self, req: Request, front: bool = False) -> None:
        """Queue a request on the dp group that `routing` picks among those up; while none is, it waits (an
        orphan) until a restarted group takes it or its placement deadline fails it. Re-queued go `front`."""
        need = len(req.prompt) + req.max_tokens
        fits = [dp for dp, g in enumerate(self._groups) if not g.stays_down and need <= self._limits[dp]]
        up = [dp for dp in fits if self._groups[dp].down is None]
        if up:
            self.placement.place(req, self._groups, up)  # sets req.dp
            waiting = self._groups[req.dp].waiting
            waiting.appendleft(req) if front else waiting.append(req)
            self._poke()
            return
        if all(g.stays_down for g in self._groups):
            raise EngineError("every dp group is down", RETRY_AFTER_DOWN_S)
        if not fits:  # admitted before a group came back with a smaller cache: no group will ever hold it
            raise RequestError(
                f"this request needs {need} tokens ({len(req.prompt)} in the prompt, {req.max_tokens} in the "
                f"completion), but since a restart the dp groups' KV caches hold at most {max(self._limits)}",
                "context_length_exceeded")
        self._orphans.add(req)

    # ---- the step loop -----------------------------------------------------------------------------------------
    def _poke(self) -> None:
        self._wake.set()
        self._changed.set()

    async def _loop(self) -> None:
        """The step loop, guarded: a bug raised in it must not leave an engine that admits requests and never
        steps while its health check passes. The engine fails instead (every request gets a retryable 503,
        /health and Serve's check_health fail), and Serve replaces the replica."""
        try:
            await self._steps()
        except Exception as e:
            log.exception("the step loop failed; the engine stops serving")
            self.error = f"the engine's step loop failed: {one_line(e)}"
            self._fail_all(EngineError(self.error, RETRY_AFTER_DOWN_S))

    async def _steps(self) -> None:
        idle = 0  # steps in a row in which nothing moved
        ahead: tuple[list, asyncio.Future] | None = None  # the next step, already sent (`_ahead_plans`)
        failed: set[int] = set()  # the groups whose step failed in the iteration before
        unplanned: set[int] = set()  # those, and the groups whose step went otherwise than planned
        while True:
            if ahead is None:
                await self._wake.wait()
                cap = prefill_cap(self._groups, self.config.max_prefill_tokens_while_decoding)
                plans = [None if g.down else plan_group(g, self.iteration, self.config,
                                                        self.placement.cached_tokens, cap)
                         for g in self._groups]
                if self._cores:
                    share_cores(plans, self._groups, self._cores, max(1, int(self.config.num_cpus_per_rank)))
                if not any(p is not None and (p.new or p.work or p.close) for p in plans):
                    self._wake.clear()
                    continue
                self.hub.plan(plans)
                self._changed.clear()
                sent = send_step(self.transport, len(self.workers), plans, self.config.tp)
                stale: set[int] = set()
            else:  # sent before the last step's result: a group that failed there failed this one too
                (plans, sent), stale = ahead, failed
            prompt_tokens = sum(w.num_scheduled_tokens for p in plans if p is not None for w in p.work
                                if w.new_token_id is None)
            began = time.monotonic()
            ahead, later = None, None
            wait = self._decode_s - AHEAD_MARGIN_S  # the step began about now (an ahead one a little before)
            nxt = self._ahead_plans(plans, unplanned)
            if nxt is not None and wait <= 0:
                ahead = nxt, send_step(self.transport, len(self.workers), nxt, self.config.tp)
            elif nxt is not None:
                later = asyncio.ensure_future(self._send_ahead_after(wait, nxt))
            try:
                results, deltas, missing = await sent
            finally:  # not sent before this step's result (or the loop stops): the next one is planned from it
                if later is not None and not later.done():
                    later.cancel()
                    later = None
            if later is not None:
                ahead = later.result()
            if prompt_tokens:
                self._prefill.append((prompt_tokens, time.monotonic() - began))
            else:
                self._decode_s = max((res.step_s for res in results if isinstance(res, StepResult)), default=0.0)
            self._completed = 0
            progress = False
            failed, unplanned = set(), set()
            for dp, res in enumerate(results):
                if dp in stale:
                    continue
                if isinstance(res, StepFailure):
                    failed.add(dp)
                    unplanned.add(dp)
                    self._group_failed(dp, res)
                    progress = True
                elif res is not None:
                    progress = progress or bool(res.ran or res.failed)
                    if res.failed or res.deferred or res.recomputed or res.suspended:
                        unplanned.add(dp)
                    self.hub.observe(dp, res)
                    self.routing_record.observe(dp, res, self._requests)
                    self.recorder.step(dp, res, self._requests)
                    self._apply(self._groups[dp], res)
            if ahead is not None:  # the ranks append what they sampled now themselves (LAST_SAMPLED)
                for p in ahead[0]:
                    for w in p.work if p is not None else ():
                        req = self._requests.get(w.request_id)
                        if req is not None:
                            req.new_token_id = None
            requests = self.recorder.take(self._groups)
            if self.stats is not None:
                engine = engine_stats(self._groups, plans, self.config, self._completed)
                self.stats.put(Iteration(self.iteration, time.time(), deltas, missing, engine,
                                         self.routing_record.take(), requests))
            self.iteration += 1
            self.steps += 1
            if self.error:
                return
            if progress or ahead is not None:
                idle = 0
                continue
            idle += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), backoff_s(idle, *NO_PROGRESS_PAUSE_S))

    async def _send_ahead_after(self, wait: float, ahead: list[StepPlan | None]) -> tuple[list, asyncio.Future] | None:
        """Async scheduling (`async_scheduling`): send the next step before this one's result, so each rank
        starts it the moment this one ends and the engine's turn between steps (its result back, the next plan
        out: ~3 ms a step on CPU, bench/README.md) no longer stands between them. Sent AHEAD_MARGIN_S before
        the step in flight should end (by the last decode step's time), not at once: a request that arrives
        before then is admitted in the next step, not one later. Nothing is sent if one did arrive, or one
        was aborted (it is then to close), meanwhile."""
        await asyncio.sleep(wait)
        if not self._may_go_ahead():
            return None
        return ahead, send_step(self.transport, len(self.workers), ahead, self.config.tp)

    def _may_go_ahead(self) -> bool:
        """No group has anything waiting or to close, and the engine has no orphans and is not closing."""
        if self._closing or len(self._orphans):
            return False
        return not any(g.waiting or g.to_close for g in self._groups)

    def _ahead_plans(self, plans: list[StepPlan | None], unplanned: set[int]) -> list[StepPlan | None] | None:
        """The plans of the step after `plans`, if it can be planned without their result: every group only
        decodes, and none has anything waiting, to close, or that went otherwise than planned in the step
        before (`unplanned`). Its work is these decodes, each with the token its rank samples now
        (LAST_SAMPLED), less the requests that this step's token ends by length; one that a stop token ends
        the rank drops itself (Work.stop_ids)."""
        if not (self.config.async_scheduling and getattr(self.transport, "pipelined", False)) or unplanned \
                or not self._may_go_ahead():
            return None
        eos = tuple(self.tokenizer.eos_token_ids)
        ahead: list[StepPlan | None] = []
        for g, p in zip(self._groups, plans, strict=True):
            if p is None:
                ahead.append(None)
                continue
            if g.down is not None or p.new or p.close or p.kv_resync:
                return None
            work = []
            for w in p.work:
                req = self._requests.get(w.request_id)
                if w.new_token_id is None or w.num_scheduled_tokens != 1 or req is None or req.done:
                    return None
                if len(req.generated) + 1 < req.max_tokens:
                    params = req.params
                    stops = frozenset(params.stop_token_ids if params.ignore_eos else (*eos, *params.stop_token_ids))
                    work.append(Work(req.id, 1, LAST_SAMPLED, stops))
            ahead.append(StepPlan(p.iteration + 1, work=work, record=p.record, kv_events=p.kv_events,
                                  threads=p.threads))
        if not any(p is not None and p.work for p in ahead):
            return None
        return ahead

    def _finish_failed(self, g: Group, req: Request, error: BaseException) -> None:
        g.finish(req)
        self.recorder.finish(req, "error", time.monotonic())
        self._requests.pop(req.id, None)
        self._poke()
        req.queue.put_nowait(error)

    def _apply(self, g: Group, res: StepResult) -> None:
        if res.ran:
            g.failures = 0  # it serves again: failures "in a row" start over
        self.preemptions += len(res.recomputed) + len(res.suspended)
        for req, ev in apply_result(g, res, self._requests, self.tokenizer.eos_token_ids):
            self.recorder.event(req, getattr(ev, "finish_reason", None), not isinstance(ev, TokenEvent))
            if req.done:
                self._requests.pop(req.id, None)
                self._completed += isinstance(ev, TokenEvent)
                self._poke()
            req.queue.put_nowait(ev)

    def _fail_all(self, error: BaseException) -> None:
        for req in list(self._requests.values()):
            req.done = True
            req.queue.put_nowait(error)
        self._orphans.take_all()
        self._requests.clear()
        for g in self._groups:
            g.waiting.clear()
            g.running.clear()
