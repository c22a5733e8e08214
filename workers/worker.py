"""RankWorker: one Ray actor per rank (one GPU each), owning its device, model shard and KV cache manager.

Every rank steps every iteration with the plan of its dp group (an idle group gets an empty plan). The
plan says which requests to create, close and run, in priority order; the rank itself finds room in its KV
cache, preempting the lowest-priority requests when it must (suspend to the host tier when there is one,
else close and recompute later). tp ranks of one group run the same deterministic code on equal caches, so
they make identical block decisions. After the step the rank commits the stats of the requests it ran and
returns its iteration delta (aggregator/delta.py) with its step result; the engine forwards it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import replace
from typing import Any

import ray
import torch

from aggregator.delta import RankDelta, RankLayout, SchedulerStats, pack, values
from kvcache import KVCacheManager
from kvcache.events import partial_reuse_worth, reuse_table
from workers.cpu_kernels import build_all
from workers.loader import kv_cache_config, load_model
from workers.model import SeqInput
from workers.parallel import (
    TPGroup,
    expected_work_s,
    free_port,
    group_min,
    init_tp_group,
    node_ip,
    set_cpu_threads,
)
from workers.sampling import make_generator, sample
from workers.simulated import SimulatedModel
from workers.step import LAST_SAMPLED, NewRequest, RankSpec, StepPlan, StepResult, Work

log = logging.getLogger("kvfleet.worker")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_kv_cache(spec: RankSpec, cfg: Any, device: str, dtype: torch.dtype, tp_group: TPGroup,
                   model: Any = None) -> KVCacheManager:
    """This rank's KV cache manager, with the primary pool size agreed over the tp group: on CUDA each rank
    sizes its pool from its own free memory, and ranks of one group must hold equal block counts to make
    identical block decisions, so all take the smallest. A simulated model's cache is its profile's size on
    the `meta` device: real bookkeeping, no bytes."""
    where = model.kv_cache_place() if isinstance(model, SimulatedModel) else {"device": device}
    kv_cfg = kv_cache_config(cfg, spec.tp, spec.cache, dtype=dtype, **where)
    kv_cfg.gpu_cache_bytes = group_min(kv_cfg.gpu_cache_bytes, tp_group)
    return KVCacheManager(kv_cfg)


def layout_of(kv: KVCacheManager, spec: RankSpec, incarnation: str, node_id: str) -> RankLayout:
    """This rank's static stats layout, registered with the aggregator once per incarnation (read from the
    cache's configuration: it exists with statistics off too). `node_id` comes from the caller: asking Ray
    here would start or join a cluster from a process that has none (a unit test's rank)."""
    return RankLayout(
        spec.rank, spec.dp_rank, spec.tp_rank, incarnation,
        life_cycles=tuple((lc.id, lc.pool_group, lc.window_key, lc.kind) for lc in kv.life_cycles),
        pool_groups=tuple((pg.id, pg.slot_bytes, tuple(pg.window_keys)) for pg in kv.pool_groups),
        max_num_blocks=kv.get_kv_cache_stats().max_num_blocks, tokens_per_block=kv.tokens_per_block,
        node_id=node_id, node_ip=node_ip())


class _Req:
    __slots__ = ("id", "tokens", "params", "salt", "num_output_tokens", "device", "kv", "warmup", "prio", "keys",
                 "first", "prompt_len", "last_sampled")

    def __init__(self, new: NewRequest, device: str) -> None:
        self.id = new.request_id
        self.tokens = list(new.prompt)
        self.params = new.params
        self.salt = new.cache_salt
        self.num_output_tokens = new.num_output_tokens  # sampled so far: seeds the next draw
        # a re-sent request's prompt ends with its earlier output
        self.prompt_len = len(self.tokens) - new.num_output_tokens
        self.device = device
        self.kv = None
        self.warmup = new.warmup
        self.prio = 0
        self.keys = new.block_keys
        self.first = not new.warmup  # its first stats commit is still to come (predicted vs realized)
        self.last_sampled: tuple[int, int] | None = None  # (iteration, token) sampled and not yet appended

    def history(self) -> tuple[list[int], list[int]] | None:
        """(prompt, output) tokens, for the sampler's penalties and min_tokens; None when it has neither."""
        if not self.params.penalized:
            return None
        return self.tokens[:self.prompt_len], self.tokens[self.prompt_len:]

    def generator(self) -> torch.Generator | None:
        """The generator of the request's next draw (seeded per draw: a rank that takes the request over
        draws what the first one would have)."""
        return make_generator(self.params, self.device, self.num_output_tokens)


class RankWorker:
    """The body of the rank actor (made a Ray actor by `ray.remote(RankWorker)` in the engine)."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.incarnation = uuid.uuid4().hex
        self.counted_from = (0, 0, 0, 0)  # cumulative block counters at this incarnation's start (`adopt`)
        self.reqs: dict[str, _Req] = {}
        self.model = self.kv = self.layout = None
        self.max_request_tokens = self.vocab_size = 0
        self.last_work: tuple[float, int] | None = None  # thread-seconds and tokens of the last step that ran any
        self.device = "cuda:0" if spec.device == "cuda" else "cpu"
        if spec.device == "cpu":
            torch.set_num_threads(max(1, spec.num_threads))
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def address(self) -> dict[str, Any]:
        """Where this rank can host its tp group's rendezvous (asked of tp rank 0)."""
        return {"ip": node_ip(), "port": free_port(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid()}

    def setup(self, master_addr: str, master_port: int, timeout_s: float = 120.0) -> dict[str, Any]:
        """Join the tp group, load the model shard and build the KV cache; returns the cache's reach."""
        s = self.spec
        tp_group = init_tp_group(s.tp_rank, s.tp, master_addr, master_port, timeout_s=timeout_s, device=self.device)
        dtype = DTYPES[s.dtype]
        self.model, cfg = load_model(s.model or None, tp_rank=s.tp_rank, tp_size=s.tp, device=self.device,
                                     dtype=dtype, seed=s.seed, max_seq_len=s.cache.max_seq_len,
                                     simulation=s.simulation)
        self.kv = build_kv_cache(s, cfg, self.device, dtype, tp_group, self.model)
        self.layout = layout_of(self.kv, s, self.incarnation, ray.get_runtime_context().get_node_id())
        lo, hi = 1, s.cache.max_seq_len
        while lo < hi:  # the longest request one rank can hold alone
            mid = (lo + hi + 1) // 2
            if self.kv.fits(mid, s.max_num_batched_tokens):
                lo = mid
            else:
                hi = mid - 1
        self.max_request_tokens, self.vocab_size = lo, cfg.vocab_size
        if self.device == "cpu" and not isinstance(self.model, SimulatedModel):
            build_all()  # built (or loaded from the cache) here, not in the first request's step
        log.info("rank %d (dp %d, tp %d) ready on %s: %d primary blocks, requests up to %d tokens",
                 s.rank, s.dp_rank, s.tp_rank, self.device, self.kv.get_kv_cache_stats().max_num_blocks, lo)
        return self._info()

    def adopt(self, spec: RankSpec) -> dict[str, Any] | None:
        """A new engine of this rank's engine id takes it over (the engine's replica died; the rank, detached,
        lived on with its model and KV cache): None unless it is set up for the same `spec`. The dead engine's
        requests are closed (their blocks stay cached), and statistics start a new incarnation here: what the
        dead engine's last steps counted never reached the aggregator, so the new incarnation's cumulative
        counters start from now, as a fresh rank's start from 0, and the records still sum to the cumulative."""
        if self.kv is None or spec != self.spec:
            return None
        left = len(self.reqs)
        for req in list(self.reqs.values()):
            if req.kv is not None:
                req.kv.close()
        self.reqs.clear()
        self.kv.set_kv_events(False, False)  # the new engine asks for a snapshot of what the cache holds
        self.kv.get_iteration_stats()  # the undelivered steps' counters and residency: gone with their engine
        self.kv.residency.drain()
        self.incarnation = uuid.uuid4().hex
        stats = self.kv.get_kv_cache_stats()
        self.counted_from = (stats.alloc_total_blocks, stats.alloc_new_blocks, stats.reused_blocks,
                             stats.missed_blocks)
        self.layout = replace(self.layout, incarnation=self.incarnation)
        log.info("rank %d taken over by a new engine %s (%d requests of the dead one closed)", spec.rank,
                 spec.engine_id, left)
        return self._info()

    def _info(self) -> dict[str, Any]:
        """What setup (and adopt) tell the engine: the cache's reach and this incarnation's layout."""
        stats = self.kv.get_kv_cache_stats()
        return {"rank": self.spec.rank, "max_request_tokens": self.max_request_tokens,
                "vocab_size": self.vocab_size, "reuse_table": reuse_table(self.kv),
                "partial_reuse_blocks": partial_reuse_worth(self.kv), "kv_slots": self.kv.num_slots,
                "max_num_blocks": stats.max_num_blocks, "node_id": self.layout.node_id,
                "device": self.device, "incarnation": self.incarnation, "layout": self.layout,
                "cpus": len(os.sched_getaffinity(0))}

    # ---- the step -------------------------------------------------------------------------------------------
    # no task events: the GCS keeps up to 100,000 (task_events_max_num_task_in_gcs), and every rank's step is
    # one, every iteration; they would fill the GCS and tell an operator nothing the stats stream does not
    @ray.method(enable_task_events=False)
    def step(self, plan: StepPlan) -> StepResult:
        """One iteration: close, open the new requests, make room, forward, sample, commit, stats. A request
        that raises (bad input, a sampler error) fails alone: it is dropped here and named in `failed`, and the
        step goes on for the others."""
        t0 = time.perf_counter()
        if self.device == "cpu":
            tokens = sum(w.num_scheduled_tokens for w in plan.work)
            set_cpu_threads(plan.threads, self.spec.num_threads, expected_work_s(self.last_work, tokens))
        failed: dict[str, str] = {}
        self._close(plan.close)
        recording = plan.record and self.spec.cache.enable_stats
        events = plan.kv_events and self.spec.tp_rank == 0
        self.kv.set_kv_events(events, plan.kv_resync)
        # suspended before this step: those that run in it are resumed (iterResumedRequests); stats only
        was_suspended = self._suspended() if recording else set()
        reused, reused_host, cached = self._open_new(plan.new, failed)
        runs, deferred, recomputed, suspended = self._make_room(self._scheduled(plan.iteration, plan.work))
        logits = self._forward(runs, failed)
        if logits is None:
            runs = []
        ran, first_reuse = self._commit(plan.iteration, runs, self._sample(runs, logits, failed), failed)
        step_s = time.perf_counter() - t0
        if runs:
            self.last_work = (step_s * torch.get_num_threads(), sum(len(tokens) for _, tokens in runs))
        out = StepResult(plan.iteration, ran, deferred, recomputed, suspended, reused, step_s, failed,
                         first_reuse=first_reuse, reused_host=reused_host)
        if recording:
            generating = {w.request_id for w in plan.work if w.new_token_id is not None}
            out.delta = self._delta(self._scheduler_stats(step_s, runs, generating, deferred, suspended,
                                                          was_suspended, cached))
        if events:
            out.kv_events = self.kv.kv_events.drain()
            out.free_blocks = self.kv.get_kv_cache_stats().free_num_blocks
        return out

    def _close(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.reqs.pop(rid, None)
            if req is not None and req.kv is not None:
                req.kv.close()

    def _suspended(self) -> set[str]:
        return {rid for rid, r in self.reqs.items() if r.kv is not None and not r.kv.is_active}

    def _open_new(self, new_requests: list[NewRequest],
                  failed: dict[str, str]) -> tuple[dict[str, int], dict[str, int], list[int]]:
        """Create the new requests' caches: (tokens each reused, of those the ones on the host tier, tokens all
        found cached on the primary / the host tier)."""
        reused: dict[str, int] = {}
        reused_host: dict[str, int] = {}
        cached = [0, 0]
        for new in new_requests:
            req = self.reqs[new.request_id] = _Req(new, self.device)
            try:
                self._open(req)
            except Exception as e:
                self._fail(req, e, failed)
                continue
            reused[req.id] = req.kv.num_reused_tokens
            levels = req.kv.cached_tokens_by_level
            if len(levels) > 1 and levels[1]:
                reused_host[req.id] = levels[1]
            for level, tokens in enumerate([] if new.warmup else levels):
                cached[level] += tokens
        return reused, reused_host, cached

    def _scheduled(self, iteration: int, work: list[Work]) -> list[Work]:
        """The plan's work on requests this rank holds, in priority order, with last step's sampled tokens: the
        engine's, or (LAST_SAMPLED) the one this rank sampled in the iteration before, unless there was none or
        it stopped the request (then the work is dropped: the engine finishes or re-plans the request)."""
        order = []
        for w in work:
            req = self.reqs.get(w.request_id)
            if req is None:
                continue
            token = w.new_token_id
            if token == LAST_SAMPLED:
                last, req.last_sampled = req.last_sampled, None
                if last is None or last[0] != iteration - 1 or last[1] in w.stop_ids:
                    continue
                token = last[1]
            elif token is not None:
                req.last_sampled = None  # the engine sent it
            if token is not None:
                req.tokens.append(token)
            order.append(w)
        return order

    def _forward(self, runs: list, failed: dict[str, str]) -> list[torch.Tensor] | None:
        """The batch's logits; None when it raised (no way to tell whose input broke it: all of it fails)."""
        if not runs:
            return None
        try:
            return self.model([SeqInput(tokens, req.kv.history_length, req.kv) for req, tokens in runs], self.kv)
        except Exception as e:
            for req, _ in runs:
                self._fail(req, e, failed)
            return None

    def _commit(self, iteration: int, runs: list, sampled: dict[int, int],
                failed: dict[str, str]) -> tuple[dict[str, tuple[int, int | None]], dict[str, int]]:
        """Commit what ran and its pending stats: (request -> (history, sampled token)), and the reused blocks
        of each request's first commit (predicted vs realized placement). A sampled token is kept for a next
        step that names it LAST_SAMPLED."""
        ran: dict[str, tuple[int, int | None]] = {}
        first_reuse: dict[str, int] = {}
        for i, (req, tokens) in enumerate(runs):
            if req.id in failed:
                continue
            req.kv.commit(tokens)
            committed = req.kv.commit_pending_stats()
            if req.first:
                req.first = False
                first_reuse[req.id] = committed.reused_blocks
            token = sampled.get(i)
            req.last_sampled = None if token is None else (iteration, token)
            ran[req.id] = (req.kv.history_length, token)
        return ran, first_reuse

    def _scheduler_stats(self, step_s: float, runs: list, generating: set[str], deferred: list[str],
                         suspended: list[str], was_suspended: set[str], cached: list[int]) -> SchedulerStats:
        n_gen = sum(1 for req, _ in runs if req.id in generating)
        gpu, cpu, pinned = self._memory()
        return SchedulerStats(
            step_us=int(step_s * 1e6), num_scheduled_requests=len(runs), num_context_requests=len(runs) - n_gen,
            num_gen_requests=n_gen, num_paused_requests=len(deferred) + len(suspended),
            num_ctx_tokens=sum(len(tokens) for req, tokens in runs if req.id not in generating),
            num_gen_tokens=n_gen, iter_suspended_requests=len(suspended),
            iter_resumed_requests=sum(1 for req, _ in runs if req.id in was_suspended),
            iter_cached_tokens_level0=cached[0], iter_cached_tokens_level1=cached[1],
            gpu_mem_usage=gpu, cpu_mem_usage=cpu, pinned_mem_usage=pinned)

    def _sample(self, runs: list, logits: list[torch.Tensor] | None, failed: dict[str, str]) -> dict[int, int]:
        """A token for each run whose prompt is now complete; a row the batched sampler cannot take is
        retried alone, so only the request that causes an error fails."""
        if not runs:
            return {}
        done = [i for i, (req, tokens) in enumerate(runs) if req.kv.history_length + len(tokens) == len(req.tokens)]
        if not done:
            return {}
        sampled = {}
        try:
            reqs = [runs[i][0] for i in done]
            toks = sample(torch.stack([logits[i] for i in done]), [r.params for r in reqs],
                          [r.generator() for r in reqs], [r.history() for r in reqs])
            sampled = dict(zip(done, toks, strict=True))
        except Exception:
            for i in done:
                req = runs[i][0]
                try:
                    sampled[i] = sample(logits[i][None], [req.params], [req.generator()], [req.history()])[0]
                except Exception as e:
                    self._fail(req, e, failed)
        for i in sampled:
            runs[i][0].num_output_tokens += 1
        return sampled

    def _fail(self, req: _Req, error: Exception, failed: dict[str, str]) -> None:
        """Drop a request whose step raised; the engine fails it with this one-line reason."""
        lines = str(error).strip().splitlines()
        failed[req.id] = why = f"{type(error).__name__}: {lines[0] if lines else ''}"
        log.warning("rank %d: request %s failed: %s", self.spec.rank, req.id, why)
        self.reqs.pop(req.id, None)
        if req.kv is not None:
            req.kv.close()
            req.kv = None

    def _open(self, req: _Req) -> None:
        """(Re)create the request's cache from every token it has: a recomputed request reuses its blocks."""
        req.kv = self.kv.create_kv_cache(req.id, req.tokens, cache_salt=req.salt, exclude_from_stats=req.warmup,
                                         block_keys=req.keys)

    def _make_room(self, order: list[Work]):
        """Resume and grow each request in priority order; preempt lower-priority ones when there is no room.

        Preemption suspends a victim when the rank has a host tier (its blocks may then be offloaded), and
        closes it for recompute when suspending cannot help (no host tier, or still no room once every
        lower-priority request is suspended)."""
        for req in self.reqs.values():  # unscheduled requests are the first victims
            req.prio = len(order)
        for i, w in enumerate(order):
            self.reqs[w.request_id].prio = i
        pool = sorted((r for r in self.reqs.values() if r.kv is not None), key=lambda r: r.prio)
        host = self.kv.config.host_cache_bytes > 0
        runs, deferred, recomputed, suspended, parked = [], [], [], [], []
        for w in order:
            req = self.reqs[w.request_id]
            if req.kv is None:
                self._open(req)
            n = min(w.num_scheduled_tokens, len(req.tokens) - req.kv.history_length)
            if n <= 0:
                continue
            while not (req.kv.resume() and req.kv.resize(req.kv.history_length + n)):
                victim = pool.pop() if pool and pool[-1].prio > req.prio else None
                if victim is not None and victim.kv is not None:
                    if host and victim.kv.is_active:
                        victim.kv.suspend()
                        parked.append(victim)
                        suspended.append(victim.id)
                    else:
                        self._recompute(victim, recomputed)
                elif victim is None:
                    lower = [r for r in parked if r.prio > req.prio and r.kv is not None]
                    if not lower:
                        deferred.append(req.id)
                        break
                    victim = max(lower, key=lambda r: r.prio)
                    parked.remove(victim)
                    self._recompute(victim, recomputed)
            else:
                h = req.kv.history_length
                n = min(n, len(req.tokens) - h)
                runs.append((req, req.tokens[h:h + n]))
        return runs, deferred, recomputed, suspended

    def _recompute(self, req: _Req, recomputed: list[str]) -> None:
        req.kv.close()
        req.kv = None
        recomputed.append(req.id)

    def _delta(self, scheduler_stats: SchedulerStats) -> RankDelta:
        """Drain this iteration's KV cache stats into one packed row (O(life cycles + pool groups))."""
        report = self.kv.get_iteration_stats()
        gauges = [pg.primary + pg.secondary for pg in report.pool_groups]
        kv_stats = values(self.kv.get_kv_cache_stats())
        if any(self.counted_from):  # an adopted rank's counters, from its adoption (KvCacheStats: 4 gauges first)
            kv_stats = kv_stats[:4] + tuple(c - b for c, b in zip(kv_stats[4:], self.counted_from, strict=True))
        row = pack(self.layout, report.counters, gauges, kv_stats, values(scheduler_stats))
        return RankDelta(self.spec.rank, self.incarnation, row, self.kv.residency.drain())

    def _memory(self) -> tuple[int, int, int]:
        """(GPU, CPU resident, pinned host) bytes this rank uses: TensorRT-LLM's gpu/cpu/pinnedMemUsage."""
        gpu = torch.cuda.memory_allocated() if self.device.startswith("cuda") else 0
        with open("/proc/self/statm", "rb") as f:
            rss = int(f.read().split()[1]) * PAGE_SIZE
        pinned = self.kv.config.host_cache_bytes if torch.cuda.is_available() else 0
        return gpu, rss, pinned

    def kv_snapshot(self) -> dict[str, Any]:
        """Gauges and cumulative counters of this rank's cache, for tests and debugging."""
        return {"kvCacheStats": self.kv.get_kv_cache_stats().to_dict(), "requests": len(self.reqs),
                "active": sum(1 for r in self.reqs.values() if r.kv is not None and r.kv.is_active)}
