"""StatsAggregator: the Ray actor around the assembler, one per engine.

The engine calls `ingest` with the iterations it stepped (in order, one call in flight) and keeps each
iteration's deltas until a reply acknowledges it. What the actor adds to `assembler.py`: the ring buffer of
cluster records read by cursor (`query`, never removing anything), a long poll for any number of readers
(`wait_records`), rank health, Prometheus text, and surviving its own restart:
- Ray restarts it (`max_restarts=-1`) and retries the call in flight (`max_task_retries=-1`);
- before replying, `ingest` writes a small checkpoint to Ray's GCS key-value store (epoch, last emitted
  iteration, the cumulative totals), and the reply acknowledges only what that checkpoint covers: a write that
  fails undoes the emission (the call fails, the engine's retry finds the iterations new, not duplicates), so
  nothing is emitted, published or acknowledged that is not saved; the registered layouts are stored there
  too, once per registration (the live incarnations' and those the kept rank details name: see Assembler);
- a restarted actor (same actor id) restores both, with `aggregatorEpoch` one higher; the engine sees the new
  epoch in a reply and re-sends every iteration not yet acknowledged. The cumulative `kvCacheStats` continue
  from the checkpoint, so they never go backwards; the newest records are checkpointed too (a ring of slots of
  TAIL_CHUNK consecutive records, 2 * TAIL_RECORDS records and a slot more), so a reader that had not yet
  fetched the last records before the restart still gets every record: the stream has no gap. Older buffered
  records are gone (the ingress mirrors keep theirs).

One engine feeds an aggregator at a time. The engine's first `register` attaches it: a new session number
(checkpointed before the reply), and the reply's `acked` is where the engine's iterations continue. Every
later call carries the session, and a call of an earlier session is refused (`StaleSession`): a replaced engine
replica's last ingest, still in flight (Ray retries it), can never be merged into the new engine's numbering.

Every crash point leaves a consistent checkpoint: an ingest checkpoints at most TAIL_RECORDS iterations at a
time, their slots first, then the state. Slots written after the last state save hold iterations the state
does not cover (ignored at restore: the engine re-sends them), and they can overwrite only records older than
the ring's newest TAIL_RECORDS and a slot (the slot more is for a chunk's misalignment), so the newest
TAIL_RECORDS records that the state covers always survive. (Writing a
whole large batch's slots before one state save overwrote exactly the records that state covered.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import time
from collections import OrderedDict
from typing import Any, Protocol

import ray

from aggregator.assembler import Assembler
from aggregator.buffer import LongPoll, RecordBuffer
from aggregator.delta import Iteration, RankDelta, RankLayout
from aggregator.fields import POOL_VIEW, ROUTING_COUNTERS, VIEW_COUNTERS, WINDOW_VIEW
from aggregator.messages import Ack, AggregatorHealth, RankHealth
from aggregator.metrics import render_metrics
from aggregator.vllm_metrics import VllmMetrics

log = logging.getLogger("kvfleet.aggregator")
_KV_NAMESPACE = "kvfleet"
WAIT_LIMIT = 1000  # most records one wait_records call returns
TAIL_RECORDS = 256  # a restart restores at least this many of the newest records its checkpoint covers
# records a tail slot holds: a slot written whole per ingest, not a write per record (a GCS write each record
# was most of the aggregator's CPU at a step every few milliseconds: bench/engine_bench.py, stats on/off)
TAIL_CHUNK = 16


def tail_slots() -> int:
    """The ring's slots: 2 * TAIL_RECORDS records and a slot more (read at call time: tests shrink TAIL_*)."""
    return -(-2 * TAIL_RECORDS // TAIL_CHUNK) + 1


SLIVER = 0.001  # of a placement resource (`engine_resource`): it steers where the actor runs, it reserves nothing
NAMESPACE = "kvfleet"  # the aggregator's Ray namespace: a new engine replica (or an operator) finds it by name
# Whether kvfleet's own actors (the aggregator, the ranks) record Ray task events: off unless an operator turns on
# Serve's switch for Serve's actors, as Serve does. The GCS keeps every task's events (up to 100,000) and every
# /health probe is a call of each: on, they pile up in the GCS for as long as the app serves. The per-step
# calls stay off even then (`@ray.method(enable_task_events=False)`).
TASK_EVENTS = os.environ.get("RAY_SERVE_ENABLE_TASK_EVENTS", "0") == "1"


class StaleSession(RuntimeError):
    """A call of an engine that another engine has replaced (a later attach)."""


def aggregator_name(engine_id: str) -> str:
    return f"kvfleet-stats-{engine_id}"


class Checkpoint(Protocol):
    """Where an aggregator's restart finds what it must not lose: named parts, each saved whole."""

    def load(self, part: str) -> Any: ...

    def save(self, part: str, value: Any) -> None: ...


class KVStore:
    """Ray's GCS key-value store in kvfleet's namespace: the only user of Ray's private `internal_kv` in
    kvfleet (Ray has no public key-value store). Off (None, nothing saved) where Ray's worker is not connected."""

    def __init__(self) -> None:
        from ray.experimental import internal_kv

        self._kv = internal_kv if internal_kv._internal_kv_initialized() else None

    def get(self, key: str) -> bytes | None:
        return self._kv._internal_kv_get(key, namespace=_KV_NAMESPACE) if self._kv else None

    def put(self, key: str, value: bytes) -> None:
        if self._kv:
            self._kv._internal_kv_put(key, value, True, namespace=_KV_NAMESPACE)

    def delete_prefix(self, prefix: str) -> None:
        if self._kv:
            self._kv._internal_kv_del(prefix, del_by_prefix=True, namespace=_KV_NAMESPACE)


def kv_store() -> KVStore:
    return KVStore()


class GCSCheckpoint:
    """The `Checkpoint` of a Ray actor: Ray's GCS key-value store (keyed by the actor id, so only a restart of
    this very actor reads it; a new actor of the same name starts clean)."""

    def __init__(self, engine_id: str) -> None:
        self._kv = kv_store()
        self.actor_id = ray.get_runtime_context().get_actor_id() if self._kv._kv else None
        self.key = f"{checkpoint_prefix(engine_id)}{self.actor_id}" if self.actor_id else None

    def load(self, part: str) -> Any:
        raw = self._kv.get(f"{self.key}/{part}") if self.key else None
        return pickle.loads(raw) if raw else None

    def save(self, part: str, value: Any) -> None:
        if self.key:
            self._kv.put(f"{self.key}/{part}", pickle.dumps(value, protocol=5))


def checkpoint_prefix(engine_id: str) -> str:
    return f"stats-checkpoint/{engine_id}/"


class StatsAggregatorImpl:
    """The actor's body; `StatsAggregator` is this class made a Ray actor."""

    def __init__(self, engine_id: str, world_size: int, tp: int, buffer_size: int = 10_000,
                 rank_detail_records: int = 512, checkpoint: Checkpoint | None = None) -> None:
        """`checkpoint`: where restarts find their predecessor's state (load/save); default Ray's GCS."""
        self.engine_id, self.world_size, self.tp = engine_id, world_size, tp
        self._ckpt = checkpoint if checkpoint is not None else GCSCheckpoint(engine_id)
        saved = self._ckpt.load("state")
        self.asm = Assembler(engine_id, world_size, tp, epoch=saved["epoch"] + 1 if saved else 1)
        if saved:
            self.asm.restore(saved, self._ckpt.load("layouts") or [])
        self.buffer = RecordBuffer(buffer_size)
        self.details: OrderedDict[int, list[RankDelta]] = OrderedDict()
        self.rank_detail_records = max(0, min(rank_detail_records, buffer_size))
        self.totals: dict[str, dict[str, dict[str, int]]] = (saved or {}).get("totals") or {WINDOW_VIEW: {},
                                                                                            POOL_VIEW: {}}
        self.completed = (saved or {}).get("completed", 0)  # requests, over every record emitted
        self.session = (saved or {}).get("session", 0)  # of the engine attached last
        self.vllm = VllmMetrics(engine_id)  # vLLM's families, cumulative like the totals
        self.vllm.restore((saved or {}).get("vllm"))
        self._tail_chunk, self._tail = -1, {}  # the tail ring's chunk being filled (_save_tail)
        if saved:
            for rec in self._load_tail():
                self.buffer.append(rec)
        self._save_state()
        self._reported_stats = self.buffer.latest()["kvCacheStats"] if len(self.buffer) else \
            self.asm.cumulative.stats()
        self._changes = LongPoll()  # readers waiting for new records
        self.subscribers = 0
        self.routing = dict.fromkeys(ROUTING_COUNTERS, 0)  # the records' `routing` sums, this epoch
        self.routed_per_group: dict[str, int] = {}
        self.started = time.time()
        log.info("stats aggregator %s up: epoch %d, world_size %d, tp %d, restored=%s", engine_id,
                 self.asm.epoch, world_size, tp, bool(saved))

    def _save_tail(self, records: list[dict[str, Any]]) -> None:
        """The new records into the checkpoint's tail ring: the slot of each TAIL_CHUNK consecutive iterations
        they fall in, written once, whole (the chunk being filled is kept here: O(records emitted))."""
        slots = tail_slots()
        i = 0
        while i < len(records):
            chunk = records[i]["iter"] // TAIL_CHUNK
            if chunk != self._tail_chunk:
                self._tail_chunk, self._tail = chunk, {}
            while i < len(records) and records[i]["iter"] // TAIL_CHUNK == chunk:
                self._tail[records[i]["iter"]] = records[i]
                i += 1
            self._ckpt.save(f"tail/{chunk % slots}", list(self._tail.values()))

    def _load_tail(self) -> list[dict[str, Any]]:
        """The tail ring's records up to the restored last emitted iteration, oldest first (a slot written after
        the last state save holds iterations the engine sends again); the chunk being filled kept from them."""
        last = self.asm.last_emitted
        if last is None:
            return []
        recs = []
        for slot in range(tail_slots()):
            recs += self._ckpt.load(f"tail/{slot}") or []
        recs = sorted((r for r in recs if r["iter"] <= last), key=lambda r: r["iter"])
        self._tail_chunk = last // TAIL_CHUNK
        self._tail = {r["iter"]: r for r in recs if r["iter"] // TAIL_CHUNK == self._tail_chunk}
        return recs

    def _save_state(self) -> None:
        self._ckpt.save("state", {**self.asm.checkpoint(), "totals": self.totals, "completed": self.completed,
                                  "session": self.session, "vllm": self.vllm.to_state()})

    def _reply(self) -> Ack:
        return Ack(self.asm.epoch, self.asm.last_emitted, self.session)

    def _check_session(self, session: int | None) -> None:
        """Refuse a call of a replaced engine (None: an unfenced caller, tests and tools)."""
        if session is not None and session != self.session:
            raise StaleSession(f"engine session {session} was replaced by session {self.session}: "
                               f"its calls are refused")

    # ---------------------------------------------------------------- the engine's calls

    async def register(self, layouts: list[RankLayout], session: int | None = None) -> Ack:
        """Ranks' static layouts (once per incarnation), before their first deltas. Without a session it
        attaches a new engine: the reply's `session` fences every earlier engine off, its `acked` is the
        last iteration emitted (the new engine continues after it)."""
        self._check_session(session)
        if session is None:
            self.session += 1
            try:
                self._save_state()
            except BaseException:
                self.session -= 1  # not saved, not attached: the engine retries the attach
                raise
            log.info("stats aggregator %s: engine session %d attached after iteration %s", self.engine_id,
                     self.session, self.asm.last_emitted)
        self.asm.register(layouts)
        self._ckpt.save("layouts", list(self.asm.layouts.values()))
        if self.asm.last_emitted is None:  # the capacity is known from the layouts, before any iteration
            self._reported_stats = self.asm.cumulative.stats()
        return self._reply()

    @ray.method(enable_task_events=False)  # one call per engine step: as RankWorker.step, no task events
    async def ingest(self, iterations: list[Iteration], session: int | None = None) -> Ack:
        """Take iterations (deltas, or object refs of deltas) of the attached engine's `session`; the reply's
        `acked` is the newest iteration that a record holds and the checkpoint covers: the engine may forget
        everything up to it."""
        self._check_session(session)
        for i, it in enumerate(iterations):
            if isinstance(it, Iteration) and any(isinstance(d, ray.ObjectRef) for d in it.deltas):
                iterations[i] = Iteration(it.iteration, it.timestamp, list(await asyncio.gather(*it.deltas)),
                                          it.missing, it.engine, it.routing)
        self.asm.check(iterations)  # a bad batch is refused whole, before anything is counted
        for start in range(0, len(iterations), TAIL_RECORDS):
            chunk = iterations[start:start + TAIL_RECORDS]
            records = self._emit_saved(chunk)
            if records:
                self._publish(records, chunk)
        return self._reply()

    def _emit_saved(self, chunk: list[Iteration]) -> list[dict[str, Any]]:
        """The chunk's new records, counted and checkpointed. A failed write undoes all of it (and raises): the
        engine's retry must find these iterations new, or they would be acked as duplicates, never recorded."""
        undo = self._undo_point()
        try:
            records = self.asm.ingest(chunk)
            if records:
                self._account(records, chunk)
                self._save_tail(records)  # before the state: what the state covers is always restorable
                self._save_state()
        except BaseException:
            self._undo(undo)
            raise
        return records

    def _undo_point(self) -> tuple:
        """What an emission changes before its save: O(ranks + metric series + TAIL_CHUNK), never the records
        or layouts (the tail's chunk being filled: a retry must write its slot with the records before it)."""
        totals = {view: {key: dict(t) for key, t in by_key.items()} for view, by_key in self.totals.items()}
        return (self.asm.snapshot(), totals, self.completed, self.vllm.to_state(), self._tail_chunk,
                dict(self._tail))

    def _undo(self, point: tuple) -> None:
        snap, self.totals, self.completed, vllm, self._tail_chunk, self._tail = point
        self.asm.rollback(snap)
        self.vllm.restore(vllm)

    def _account(self, records: list[dict[str, Any]], iterations: list[Iteration]) -> None:
        """The checkpointed sums over the records (vLLM's families, per-window and pool-group totals, completed)."""
        by_iter = {it.iteration: it for it in iterations}
        for rec in records:
            self.vllm.observe(by_iter[rec["iter"]], self.asm.layouts)
            for view in (WINDOW_VIEW, POOL_VIEW):
                totals = self.totals[view]
                for key, bucket in rec[view].items():
                    t = totals.setdefault(key, dict.fromkeys(VIEW_COUNTERS[view], 0))
                    for f in VIEW_COUNTERS[view]:
                        t[f] += bucket[f]
            self.completed += rec["numCompletedRequests"]

    def _publish(self, records: list[dict[str, Any]], iterations: list[Iteration]) -> None:
        """Saved records to readers: the buffer, rank details, this epoch's routing sums; then the layouts that
        no kept detail names are forgotten."""
        deltas = {it.iteration: it.deltas for it in iterations}
        self._reported_stats = records[-1]["kvCacheStats"]
        for rec in records:
            if self.rank_detail_records:
                self.details[rec["iter"]] = deltas[rec["iter"]]
                while len(self.details) > self.rank_detail_records:
                    self.details.popitem(last=False)
            if rec["tpDivergence"]:
                log.error("iteration %d: %d tp divergences", rec["iter"], len(rec["tpDivergence"]))
            if rec["errors"]:
                log.warning("iteration %d: %s", rec["iter"], rec["errors"][0])
            routing = rec.get("routing")
            if routing:
                for k in ROUTING_COUNTERS:
                    self.routing[k] += routing.get(k, 0)
                for dp, n in enumerate(routing.get("perGroupRequests", ())):
                    self.routed_per_group[str(dp)] = self.routed_per_group.get(str(dp), 0) + n
            self.buffer.append(rec)
        self.asm.forget_layouts(next(iter(self.details)) if self.details else None)
        self._changes.notify()

    # ---------------------------------------------------------------- readers

    async def query(self, since: int = -1, limit: int | None = None, ranks: bool = False) -> list[dict]:
        """Cluster records with iter > since, oldest first; reading removes nothing."""
        if not isinstance(since, int) or isinstance(since, bool):
            raise ValueError(f"since must be an int, got {since!r}")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be a non-negative int, got {limit!r}")
        recs = self.buffer.since(since, limit)
        return [self._with_ranks(r) for r in recs] if ranks else recs

    def _with_ranks(self, rec: dict[str, Any]) -> dict[str, Any]:
        deltas = self.details.get(rec["iter"])
        ranks = None if deltas is None else {
            str(d.rank): self.asm.rank_record(d, rec["iter"]) for d in deltas
            if (d.rank, d.incarnation) in self.asm.layouts}
        return {**rec, "ranks": ranks}

    @ray.method(enable_task_events=False)  # one call per mirror per batch of records
    async def wait_records(self, since: int, timeout_s: float, linger_s: float = 0.0) -> list[dict]:
        """Long poll: records with iter > since as soon as there are any (and those of the `linger_s` after the
        first: one reply for a step's worth of records), [] after timeout_s."""
        self.subscribers += 1
        try:
            got = await self._changes.wait(lambda: self.buffer.since(since, WAIT_LIMIT), float(timeout_s))
            if got and linger_s > 0 and len(got) < WAIT_LIMIT:
                await asyncio.sleep(min(float(linger_s), 1.0))
                got = self.buffer.since(since, WAIT_LIMIT)
            return got
        finally:
            self.subscribers -= 1

    async def ranks(self) -> dict[str, RankHealth]:
        """Every rank's latest record and health: healthy = reported in the newest record."""
        now = time.time()
        out = {}
        for r in range(self.world_size):
            latest = self.asm.latest.get(r)
            d, it, seen = latest if latest else (None, None, None)
            lay = self.asm.layouts.get((r, d.incarnation)) if d else None
            out[str(r)] = RankHealth(
                r, r // self.tp, r % self.tp, d.incarnation if d else None, seen,
                None if seen is None else now - seen, d is not None and r not in self.asm.missing,
                lay.node_id if lay else None, lay.node_ip if lay else None,
                self.asm.rank_record(d, it) if d else None)
        return out

    async def kv_cache_stats(self) -> dict[str, Any]:
        """Cluster cumulative kvCacheStats as of the newest emitted record (never going backwards)."""
        return dict(self._reported_stats)

    async def metrics_text(self) -> str:
        snap = {"epoch": self.asm.epoch, "counts": dict(self.asm.counts), "last_iter": self.asm.last_emitted,
                "buffered": len(self.buffer), "subscribers": self.subscribers, "completed": self.completed,
                "routing": self.routing, "routed_per_group": self.routed_per_group,
                "cluster": self._reported_stats, "latest": self.buffer.latest(), "totals": self.totals,
                "ranks": await self.ranks(), "vllm": self.vllm.families()}
        return render_metrics(snap)

    async def health(self) -> AggregatorHealth:
        ranks = await self.ranks()
        return AggregatorHealth(
            True, self.engine_id, self.asm.epoch, self.world_size, self.tp, self.asm.last_emitted, len(self.buffer),
            self.buffer.oldest_iter(), self.buffer.capacity, sum(r.healthy for r in ranks.values()),
            dict(self.asm.counts), time.time() - self.started)


StatsAggregator = ray.remote(max_restarts=-1, max_task_retries=-1)(StatsAggregatorImpl)


def get_or_create_aggregator(engine_id: str, world_size: int, tp: int, buffer_size: int = 10_000,
                             resource: str = "", **options: Any) -> ray.actor.ActorHandle:
    """The engine's aggregator actor, created on first use (named, so a new engine finds it by engine id).
    `resource`: a custom resource it asks a sliver of, so it runs (and Ray restarts it) only on the nodes that
    advertise it (deployment/settings.py `engine_resource`)."""
    opts = {"name": aggregator_name(engine_id), "namespace": NAMESPACE, "get_if_exists": True, "num_cpus": 0,
            "enable_task_events": TASK_EVENTS,
            **({"resources": {resource: SLIVER}} if resource else {}), **options}
    return StatsAggregator.options(**opts).remote(engine_id, world_size, tp, buffer_size)


def remove_aggregator(engine_id: str) -> bool:
    """Kill a gone engine's aggregator for good and drop its checkpoints (engine/registry.py, after a
    scale-down). Whether there was one."""
    try:
        actor = ray.get_actor(aggregator_name(engine_id), namespace=NAMESPACE)
    except ValueError:
        actor = None
    if actor is not None:
        ray.kill(actor, no_restart=True)
    kv_store().delete_prefix(checkpoint_prefix(engine_id))
    return actor is not None


COUNTERS = ("allocTotalBlocks", "allocNewBlocks", "reusedBlocks", "missedBlocks")  # kvCacheStats that only grow


async def final_counters(engine_id: str, timeout_s: float = 5.0) -> dict[str, int] | None:
    """A gone engine's cumulative counters, from its aggregator before it is removed (None: it does not answer)."""
    import asyncio

    try:
        actor = ray.get_actor(aggregator_name(engine_id), namespace=NAMESPACE)
        stats = await asyncio.wait_for(actor.kv_cache_stats.remote(), timeout_s)
    except Exception:
        return None
    return {k: int(stats.get(k, 0)) for k in COUNTERS}
