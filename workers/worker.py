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
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from aggregator.delta import RankDelta, RankLayout, pack
from kvcache import KVCacheManager
from kvcache.events import KVEvent, reuse_table

from .config import CacheSettings
from .loader import kv_cache_config, load_model
from .model import SeqInput
from .parallel import TPGroup, free_port, group_min, init_tp_group, node_ip
from .sampling import SamplingParams, sample

log = logging.getLogger("kvfleet.worker")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RankSpec:
    """What one rank needs to start; plain data so it pickles into the actor."""

    engine_id: str
    rank: int
    dp: int
    tp: int
    model: str
    device: str  # "cpu" or "cuda"
    dtype: str
    seed: int
    cache: CacheSettings
    max_num_batched_tokens: int
    num_threads: int = 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp


@dataclass
class NewRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    warmup: bool = False  # warm-up requests are excluded from every statistic
    drawn: int = 0  # tokens already sampled (a request re-prefilled on a new group): a seeded sampler goes on
    block_keys: list[int] | None = None  # the prompt's full blocks' keys (kvcache.events), computed once


@dataclass
class Work:
    """Run up to `budget` tokens of a request; `append` is the token sampled last step (None in prefill)."""

    request_id: str
    budget: int
    append: int | None = None


@dataclass
class StepPlan:
    iteration: int
    new: list[NewRequest] = field(default_factory=list)
    work: list[Work] = field(default_factory=list)  # highest priority first
    close: list[str] = field(default_factory=list)
    record: bool = True  # False for warm-up steps: no stats message
    kv_events: bool = False  # record KV events (tp rank 0 only: the others make the same decisions)
    kv_resync: bool = False  # start them with a snapshot of everything the cache holds


@dataclass
class StepResult:
    iteration: int
    ran: dict[str, tuple[int, int | None]]  # request id -> (history after, sampled token or None mid-prefill)
    deferred: list[str]  # scheduled but found no room this step
    recomputed: list[str]  # preempted by closing their cache: they prefill again (reusing what is cached)
    suspended: list[str]  # preempted by suspend(): their blocks may go to the host tier
    reused: dict[str, int]  # new request id -> tokens reused from the prefix cache
    step_s: float
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why; the rank has dropped it
    delta: RankDelta | None = None  # this rank's stats of the iteration (None: warm-up, or stats off)
    kv_events: list[KVEvent] | None = None  # this step's KV events (plan.kv_events, tp rank 0)
    first_reuse: dict[str, int] = field(default_factory=dict)  # request id -> reused blocks of its first commit
    free_blocks: int = -1  # free primary blocks after the step (with KV events)
    reused_host: dict[str, int] = field(default_factory=dict)  # new request id -> of its reused tokens, on host


def build_kv_cache(spec: RankSpec, cfg: Any, device: str, dtype: torch.dtype, tp_group: TPGroup) -> KVCacheManager:
    """This rank's KV cache manager, with the primary pool size agreed over the tp group: on CUDA each rank
    sizes its pool from its own free memory, and ranks of one group must hold equal block counts to make
    identical block decisions, so all take the smallest."""
    kv_cfg = kv_cache_config(cfg, spec.tp, spec.cache, device=device, dtype=dtype)
    kv_cfg.gpu_cache_bytes = group_min(kv_cfg.gpu_cache_bytes, tp_group)
    return KVCacheManager(kv_cfg)


def layout_of(kv: KVCacheManager, spec: RankSpec, incarnation: str) -> RankLayout:
    """This rank's static stats layout, registered with the aggregator once per incarnation (read from the
    cache's configuration: it exists with statistics off too)."""
    return RankLayout(
        spec.rank, spec.dp_rank, spec.tp_rank, incarnation,
        life_cycles=tuple((lc.id, lc.pool_group, lc.window_key, lc.kind) for lc in kv.life_cycles),
        pool_groups=tuple((pg.id, pg.slot_bytes, tuple(pg.window_keys)) for pg in kv.pool_groups),
        max_num_blocks=kv.get_kv_cache_stats().max_num_blocks, tokens_per_block=kv.tokens_per_block)


class _Req:
    __slots__ = ("id", "tokens", "params", "salt", "drawn", "device", "kv", "warmup", "prio", "keys", "first")

    def __init__(self, new: NewRequest, device: str) -> None:
        self.id = new.request_id
        self.tokens = list(new.prompt)
        self.params = new.params
        self.salt = new.cache_salt
        self.drawn = new.drawn
        self.device = device
        self.kv = None
        self.warmup = new.warmup
        self.prio = 0
        self.keys = new.block_keys
        self.first = not new.warmup  # its first stats commit is still to come (predicted vs realized)

    def generator(self) -> torch.Generator | None:
        """The generator of the request's next draw (seeded per draw: a rank that takes the request over
        draws what the first one would have)."""
        return self.params.make_generator(self.device, self.drawn)


class RankWorker:
    """The body of the rank actor (made a Ray actor by `ray.remote(RankWorker)` in the engine)."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.incarnation = uuid.uuid4().hex
        self.reqs: dict[str, _Req] = {}
        self.model = self.kv = self.layout = None
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
                                     dtype=dtype, seed=s.seed, max_seq_len=s.cache.max_seq_len)
        self.kv = build_kv_cache(s, cfg, self.device, dtype, tp_group)
        self.layout = layout_of(self.kv, s, self.incarnation)
        lo, hi = 1, s.cache.max_seq_len
        while lo < hi:  # the longest request one rank can hold alone
            mid = (lo + hi + 1) // 2
            if self.kv.fits(mid, s.max_num_batched_tokens):
                lo = mid
            else:
                hi = mid - 1
        stats = self.kv.get_kv_cache_stats()
        log.info("rank %d (dp %d, tp %d) ready on %s: %d primary blocks, requests up to %d tokens",
                 s.rank, s.dp_rank, s.tp_rank, self.device, stats.max_num_blocks, lo)
        return {"rank": s.rank, "max_request_tokens": lo, "vocab_size": cfg.vocab_size,
                "reuse_table": reuse_table(self.kv), "kv_slots": sum(p.num_slots for p in self.kv._pools),
                "max_num_blocks": stats.max_num_blocks, "node_id": ray.get_runtime_context().get_node_id(),
                "device": self.device, "incarnation": self.incarnation, "layout": self.layout}

    # ---- the step -------------------------------------------------------------------------------------------
    def step(self, plan: StepPlan) -> StepResult:
        """One iteration. A request that raises (bad input, a sampler error) fails alone: it is dropped here
        and named in `failed`, and the step goes on for the others."""
        t0 = time.perf_counter()
        failed: dict[str, str] = {}
        for rid in plan.close:
            req = self.reqs.pop(rid, None)
            if req is not None and req.kv is not None:
                req.kv.close()
        recording = plan.record and self.spec.cache.enable_stats
        events = plan.kv_events and self.spec.tp_rank == 0
        self.kv.set_kv_events(events, plan.kv_resync)
        # suspended before this step: those that run in it are resumed (iterResumedRequests); stats only
        was_suspended = ({rid for rid, r in self.reqs.items() if r.kv is not None and not r.kv.is_active}
                         if recording else set())
        reused, reused_host = {}, {}
        first_reuse: dict[str, int] = {}
        cached = [0, 0]  # tokens the new requests found in the prefix cache, on the primary / the host tier
        for new in plan.new:
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
            for level, tokens in enumerate([] if new.warmup else req.kv.cached_tokens_by_level):
                cached[level] += tokens
        order = [w for w in plan.work if w.request_id in self.reqs]
        for w in order:
            if w.append is not None:
                self.reqs[w.request_id].tokens.append(w.append)
        runs, deferred, recomputed, suspended = self._make_room(order)
        ran: dict[str, tuple[int, int | None]] = {}
        if runs:
            try:
                seqs = [SeqInput(tokens, req.kv.history_length, req.kv) for req, tokens in runs]
                logits = self.model(seqs, self.kv)
            except Exception as e:  # no way to tell whose input broke the batch: fail what ran in it
                for req, _ in runs:
                    self._fail(req, e, failed)
                runs = []
            sampled = self._sample(runs, logits, failed) if runs else {}
            for i, (req, tokens) in enumerate(runs):
                if req.id in failed:
                    continue
                req.kv.commit(tokens)
                committed = req.kv.commit_pending_stats()
                if req.first:
                    req.first = False
                    first_reuse[req.id] = committed.reused_blocks
                ran[req.id] = (req.kv.history_length, sampled.get(i))
        step_s = time.perf_counter() - t0
        delta = None
        if recording:
            gen = {w.request_id for w in plan.work if w.append is not None}
            ctx_tokens = sum(len(tokens) for req, tokens in runs if req.id not in gen)
            n_gen = sum(1 for req, _ in runs if req.id in gen)
            sched = [int(step_s * 1e6), len(runs), len(runs) - n_gen, n_gen, len(deferred) + len(suspended),
                     ctx_tokens, n_gen, len(suspended), sum(1 for req, _ in runs if req.id in was_suspended),
                     *cached, *self._memory()]
            delta = self._delta(sched)
        out = StepResult(plan.iteration, ran, deferred, recomputed, suspended, reused, step_s, failed, delta,
                         first_reuse=first_reuse, reused_host=reused_host)
        if events:
            out.kv_events = self.kv.kv_events.drain()
            out.free_blocks = self.kv.get_kv_cache_stats().free_num_blocks
        return out

    def _sample(self, runs: list, logits: list[torch.Tensor], failed: dict[str, str]) -> dict[int, int]:
        """A token for each run whose prompt is now complete; a row the batched sampler cannot take is
        retried alone, so only the request that causes an error fails."""
        done = [i for i, (req, tokens) in enumerate(runs) if req.kv.history_length + len(tokens) == len(req.tokens)]
        if not done:
            return {}
        sampled = {}
        try:
            toks = sample(torch.stack([logits[i] for i in done]), [runs[i][0].params for i in done],
                          [runs[i][0].generator() for i in done])
            sampled = dict(zip(done, toks, strict=True))
        except Exception:
            for i in done:
                req = runs[i][0]
                try:
                    sampled[i] = sample(logits[i][None], [req.params], [req.generator()])[0]
                except Exception as e:
                    self._fail(req, e, failed)
        for i in sampled:
            runs[i][0].drawn += 1
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
            n = min(w.budget, len(req.tokens) - req.kv.history_length)
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

    def _delta(self, sched: list[int]) -> RankDelta:
        """Drain this iteration's KV cache stats into one packed row (O(life cycles + pool groups))."""
        report = self.kv.get_iteration_stats()
        k = self.kv.get_kv_cache_stats()
        kv_stats = [k.max_num_blocks, k.free_num_blocks, k.used_num_blocks, k.tokens_per_block, k.alloc_total_blocks,
                    k.alloc_new_blocks, k.reused_blocks, k.missed_blocks]
        gauges = [pg.primary + pg.secondary for pg in report.pool_groups]
        row = pack(self.layout, report.counters, gauges, kv_stats, sched)
        return RankDelta(self.spec.rank, self.incarnation, row, self.kv.residency.drain())

    def _memory(self) -> list[int]:
        """(GPU, CPU resident, pinned host) bytes this rank uses: TensorRT-LLM's gpu/cpu/pinnedMemUsage."""
        gpu = torch.cuda.memory_allocated() if self.device.startswith("cuda") else 0
        with open("/proc/self/statm", "rb") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        pinned = self.kv.config.host_cache_bytes if torch.cuda.is_available() else 0
        return [gpu, rss, pinned]

    def kv_snapshot(self) -> dict[str, Any]:
        """Gauges and cumulative counters of this rank's cache, for tests and debugging."""
        return {"kvCacheStats": self.kv.get_kv_cache_stats().to_dict(), "requests": len(self.reqs),
                "active": sum(1 for r in self.reqs.values() if r.kv is not None and r.kv.is_active)}
