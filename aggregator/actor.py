"""StatsAggregator: the Ray actor (async) around the iteration assembler, one per engine.

What it adds to `assembler.py`: a ring buffer of cluster records read by cursor (`query`, never removing
anything), a long poll for any number of live subscribers (`wait_records`), a background task that emits
timed-out iterations, rank health, Prometheus text, and surviving its own restart:
- Ray restarts it (`max_restarts=-1`) and retries calls in flight (`max_task_retries=-1`);
- ranks re-send every message not yet acknowledged (acks come once a message's counters are emitted);
- a small checkpoint in Ray's GCS key-value store, written before each batch of records is published:
  epoch, last emitted iteration, which (incarnation, seq) are already counted, and the per-rank cumulative
  snapshots. It is keyed by the actor id, so only a restart of this very actor reads it (a new actor of the
  same name starts clean). After a restart `aggregatorEpoch` is one higher, buffered records are gone,
  re-sent messages that were already emitted are acknowledged and ignored, the rest are merged (into their
  own iteration, or as late deltas when it was emitted before), and the cluster's cumulative `kvCacheStats`
  continue from the checkpoint, so they never go backwards.
The checkpoint is written only when records are emitted, and at most once per `checkpoint_interval_s` (its
pickling and GCS round trip cost O(ranks) each): iterations that become due sooner stay pending until the
interval is over, then leave together under one checkpoint. Emission (`poll`: records built, their messages'
acks staged), the checkpoint write and publication remain one step with no await between them, so deferring
only moves when records appear: no record is visible and no message acknowledged before a checkpoint that
counts it exists, exactly as before. At 20 iterations/s records are 50 ms apart, longer than the interval,
so nothing waits; a burst waits at most the interval.
The one window left: records published in the instant between the checkpoint write and a reader's fetch
die with the buffer (their counts are in the cumulative totals, not in any record a reader saw).

Garbage-collector pauses were the emission lag's tail: an automatic gen-2 pass walks every object the
actor holds (the rank detail ring alone keeps ~9 tracked objects per rank message: 300k at 64 ranks) and
took 50-300 ms whenever the survivors grew by a quarter, i.e. every few seconds. In a Ray actor
(`manage_gc`) automatic gen-2 passes are off (gens 0 and 1 keep running) and a full pass runs right after a
publication at most every `FULL_GC_INTERVAL_S`, so the stream sees one such pause per interval instead.
The aggregator's data is acyclic (freed by reference counting), so little waits for that pass.
(Serialising the ring instead costs ~15 us per message, as much as the whole merge.)
"""

from __future__ import annotations

import asyncio
import gc
import logging
import pickle
import time
from collections import OrderedDict
from typing import Any

import ray

from .assembler import IterationAssembler
from .buffer import RecordBuffer
from .layout import report_of
from .merge import POOL_VIEW, VIEW_COUNTERS, VIEWS, WINDOW_VIEW
from .metrics import render_metrics

log = logging.getLogger("kvfleet.aggregator")
_KV_NAMESPACE = "kvfleet"
WAIT_LIMIT = 1000  # most records one wait_records call returns
FULL_GC_INTERVAL_S = 300.0  # with manage_gc: the one full collection per this many seconds


def aggregator_name(engine_id: str) -> str:
    return f"kvfleet-stats-{engine_id}"


def rank_record(m: dict[str, Any]) -> dict[str, Any]:
    """A rank's own record (the `ranks` entries of a cluster record, and /stats/ranks)."""
    report = report_of(m)
    return {
        "iter": m["iteration"], "rank": m["rank"], "dpRank": m["dp_rank"], "tpRank": m["tp_rank"],
        "incarnation": m["incarnation"], "seq": m["seq"], "timestamp": m.get("timestamp"),
        **({"iterations": list(m["iterations"])} if "iterations" in m else {}),
        "kvCacheStats": m.get("kv_cache_stats"),
        **{view: report.get(view, {}) for view in VIEWS},
    }


class _Checkpoint:
    """The few numbers an aggregator restart must not lose, in Ray's GCS key-value store."""

    def __init__(self, engine_id: str) -> None:
        from ray.experimental import internal_kv

        self._kv = internal_kv if internal_kv._internal_kv_initialized() else None
        self.actor_id = ray.get_runtime_context().get_actor_id() if self._kv else None
        self.key = f"stats-checkpoint/{engine_id}/{self.actor_id}" if self.actor_id else None

    def load(self) -> dict[str, Any] | None:
        if not self.key:
            return None
        raw = self._kv._internal_kv_get(self.key, namespace=_KV_NAMESPACE)
        return pickle.loads(raw) if raw else None

    def save(self, state: dict[str, Any]) -> None:
        if self.key:
            self._kv._internal_kv_put(self.key, pickle.dumps(state, protocol=5), True, namespace=_KV_NAMESPACE)


class StatsAggregatorImpl:
    """The actor's body; `StatsAggregator` is this class made a Ray actor."""

    def __init__(self, engine_id: str, world_size: int, tp: int, buffer_size: int = 10_000,
                 stats_timeout_s: float = 2.0, rank_detail_records: int = 512,
                 checkpoint_interval_s: float = 0.02, manage_gc: bool | None = None) -> None:
        self.engine_id, self.world_size, self.tp = engine_id, world_size, tp
        self.timeout = stats_timeout_s
        self._ckpt = _Checkpoint(engine_id)
        saved = self._ckpt.load()
        epoch = saved["epoch"] + 1 if saved else 1
        self.asm = IterationAssembler(engine_id, world_size, tp, stats_timeout_s, epoch=epoch)
        if saved:
            self.asm.restore(saved)
        self.buffer = RecordBuffer(buffer_size)
        self.details: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()
        self.rank_detail_records = max(0, min(rank_detail_records, buffer_size))
        self.totals: dict[str, dict[str, dict[str, int]]] = {WINDOW_VIEW: {}, POOL_VIEW: {}}
        self.checkpoint_interval_s = checkpoint_interval_s
        self.manage_gc = bool(self._ckpt.actor_id) if manage_gc is None else manage_gc
        self._last_full_gc = time.monotonic()
        self.full_gcs = 0
        if self.manage_gc:  # no automatic gen-2 pass (see the module docstring); gens 0 and 1 unchanged
            t0, t1, _ = gc.get_threshold()
            gc.set_threshold(t0, t1, 1_000_000_000)
        self._last_checkpoint = float("-inf")
        self._deferred: asyncio.TimerHandle | None = None
        self._save_checkpoint()
        self._new_records: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._ticker: asyncio.Task | None = None
        self.subscribers = 0
        self.started = time.time()
        log.info("stats aggregator %s up: epoch %d, world_size %d, tp %d, restored=%s",
                 engine_id, epoch, world_size, tp, bool(saved))

    # ---------------------------------------------------------------- internals

    def _ensure_started(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._new_records = self._new_records or asyncio.Event()
            self._wake = self._wake or asyncio.Event()
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        """Emit iterations whose stats_timeout_s ran out; sleeps until the oldest pending one is due."""
        while True:
            deadline = self.asm.next_deadline()
            if deadline is not None and self._ckpt.key:  # not before the checkpoint interval allows a write
                deadline = max(deadline, self._last_checkpoint + self.checkpoint_interval_s)
            try:
                if deadline is None:
                    self._wake.clear()
                    await self._wake.wait()
                else:
                    await asyncio.sleep(max(0.0, deadline - self.asm.clock()) + 1e-4)
                self._maybe_publish()
            except Exception:  # never let the ticker die silently; the next call restarts it
                log.exception("stats aggregator ticker failed")
                raise

    def _maybe_publish(self) -> None:
        """Emit and publish what is due, unless the last checkpoint is younger than the interval: then once
        it is over (see the module docstring)."""
        if not self.asm.due():
            return
        wait = self._last_checkpoint + self.checkpoint_interval_s - time.monotonic()
        if wait > 0 and self._ckpt.key:
            if self._deferred is None:
                self._deferred = asyncio.get_running_loop().call_later(wait, self._run_deferred)
            return
        self._publish(self.asm.poll())

    def _run_deferred(self) -> None:
        self._deferred = None
        try:
            self._maybe_publish()
        except Exception:  # a timer callback: log, and the next ingest or tick tries again
            log.exception("stats aggregator deferred publication failed")

    def _publish(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        self._save_checkpoint(records[-1]["kvCacheStats"])
        for rec in records:
            msgs = rec.pop("_rank_messages")
            if self.rank_detail_records:
                self.details[rec["iter"]] = msgs
                while len(self.details) > self.rank_detail_records:
                    self.details.popitem(last=False)
            for view in (WINDOW_VIEW, POOL_VIEW):
                tv = self.totals[view]
                for key, b in rec[view].items():
                    t = tv.get(key)
                    if t is None:
                        t = tv[key] = dict.fromkeys(VIEW_COUNTERS[view], 0)
                    for f in VIEW_COUNTERS[view]:
                        t[f] += b[f]
            if not rec["complete"]:
                log.warning("iteration %d emitted incomplete, missing ranks %s", rec["iter"], rec["missingRanks"])
            if rec["tpDivergence"]:
                log.error("iteration %d: %d tp divergences", rec["iter"], len(rec["tpDivergence"]))
            self.buffer.append(rec)
        ev, self._new_records = self._new_records, asyncio.Event()
        ev.set()
        if self.manage_gc and time.monotonic() - self._last_full_gc >= FULL_GC_INTERVAL_S:
            self._last_full_gc = time.monotonic()  # after the woken readers have run
            asyncio.get_running_loop().call_soon(self._full_gc)

    def _full_gc(self) -> None:
        t0 = time.perf_counter()
        found = gc.collect()
        self.full_gcs += 1
        log.info("full gc: %d unreachable, %.1f ms", found, (time.perf_counter() - t0) * 1e3)

    def _save_checkpoint(self, stats: dict[str, Any] | None = None) -> None:
        # readers see the cluster kvCacheStats of the last checkpoint only, so a restart never shows less
        self._reported_stats = stats if stats is not None else self.asm.cumulative.stats()
        if self._ckpt.key:
            self._ckpt.save(self.asm.checkpoint())
            self._last_checkpoint = time.monotonic()

    def _with_ranks(self, rec: dict[str, Any]) -> dict[str, Any]:
        msgs = self.details.get(rec["iter"])
        ranks = None if msgs is None else {str(m["rank"]): rank_record(m) for m in msgs}
        return {**rec, "ranks": ranks}

    # ---------------------------------------------------------------- API (all async)

    async def ingest(self, messages: list[dict[str, Any]] | bytes, poll: list[str] | None = None,
                     expect: list | None = None) -> dict[str, Any]:
        """Take rank messages; answer which (incarnation, seq) pairs are now safely emitted. `poll` lists
        incarnations that send nothing new and only collect their acks. `expect` is the [aggregator_id,
        epoch] the sender last heard from: if that is not this actor now (it restarted), nothing is taken and
        the reply says `stale`, so the sender re-sends all it holds unacknowledged, oldest first, instead of
        letting this batch's newer iterations overtake what the old actor lost.

        `messages` may also be one pickle of the list (what RankOutbox sends): Ray then moves a single
        buffer instead of encoding and decoding every nested container, about 1.5x the batches/s."""
        self._ensure_started()
        me = {"epoch": self.asm.epoch, "aggregator_id": self._ckpt.actor_id}
        if expect is not None and list(expect) != [me["aggregator_id"], me["epoch"]]:
            return {**me, "acked": [], "stale": True}
        if isinstance(messages, bytes | bytearray | memoryview):
            try:
                messages = pickle.loads(messages)
            except Exception as e:
                raise ValueError(f"ingest: messages bytes are not a pickled list ({type(e).__name__}: {e})") from None
        if not isinstance(messages, list):
            messages = [messages]
        res = self.asm.ingest(messages, poll or ())
        for rej in res.rejected:
            log.warning("rejected rank message %d: %s", rej["index"], rej["error"])
        self._maybe_publish()
        if self.asm.pending:
            self._wake.set()
        out: dict[str, Any] = {**me, "acked": res.acked}
        if res.rejected:
            out["rejected"] = res.rejected
        return out

    async def query(self, since: int = -1, limit: int | None = None, ranks: bool = False) -> list[dict]:
        """Cluster records with iter > since, oldest first; reading removes nothing."""
        self._ensure_started()
        if not isinstance(since, int) or isinstance(since, bool):
            raise ValueError(f"since must be an int, got {since!r}")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be a non-negative int, got {limit!r}")
        recs = self.buffer.since(since, limit)
        return [self._with_ranks(r) for r in recs] if ranks else recs

    async def wait_records(self, since: int, timeout_s: float) -> list[dict]:
        """Long poll: records with iter > since as soon as there are any, [] after timeout_s."""
        self._ensure_started()
        deadline = time.monotonic() + max(0.0, float(timeout_s))
        self.subscribers += 1
        try:
            while True:
                recs = self.buffer.since(since, WAIT_LIMIT)
                left = deadline - time.monotonic()
                if recs or left <= 0:
                    return recs
                try:
                    await asyncio.wait_for(self._new_records.wait(), left)
                except TimeoutError:
                    pass
        finally:
            self.subscribers -= 1

    async def ranks(self) -> dict[str, dict[str, Any]]:
        """Every expected rank's latest record and health (healthy: kept up with the last iteration, or
        reported within stats_timeout_s)."""
        now = time.time()
        out = {}
        for r in range(self.world_size):
            m = self.asm.latest.get(r)
            seen = self.asm.last_seen.get(r)
            age = None if seen is None else now - seen
            healthy = m is not None and (m["iteration"] >= self.asm.last_emitted or age <= self.timeout)
            out[str(r)] = {
                "rank": r, "dp_rank": r // self.tp, "tp_rank": r % self.tp,
                "incarnation": m["incarnation"] if m else None, "last_seen": seen, "age_s": age,
                "healthy": healthy, "record": rank_record(m) if m else None,
            }
        return out

    async def kv_cache_stats(self) -> dict[str, Any]:
        """Cluster cumulative kvCacheStats as of the newest emitted record (never going backwards)."""
        return dict(self._reported_stats)

    async def metrics_text(self) -> str:
        return render_metrics(await self._metrics_snapshot())

    async def _metrics_snapshot(self) -> dict[str, Any]:
        return {
            "epoch": self.asm.epoch, "counts": dict(self.asm.counts), "last_iter": self.asm.last_emitted,
            "buffered": len(self.buffer), "subscribers": self.subscribers,
            "pending": len(self.asm.pending), "cluster": self._reported_stats,
            "latest": self.buffer.latest(), "totals": self.totals, "ranks": await self.ranks(),
        }

    async def health(self) -> dict[str, Any]:
        self._ensure_started()
        ranks = await self.ranks()
        return {
            "ok": True, "engine_id": self.engine_id, "epoch": self.asm.epoch, "world_size": self.world_size,
            "tp": self.tp, "last_iter": self.asm.last_emitted, "pending_iterations": len(self.asm.pending),
            "buffered": len(self.buffer), "oldest_buffered_iter": self.buffer.oldest_iter(),
            "buffer_size": self.buffer.capacity, "stats_timeout_s": self.timeout,
            "healthy_ranks": sum(r["healthy"] for r in ranks.values()), "counts": dict(self.asm.counts),
            "uptime_s": time.time() - self.started,
        }


StatsAggregator = ray.remote(max_restarts=-1, max_task_retries=-1)(StatsAggregatorImpl)


def get_or_create_aggregator(engine_id: str, world_size: int, tp: int, buffer_size: int = 10_000,
                             stats_timeout_s: float = 2.0, **options: Any) -> ray.actor.ActorHandle:
    """The engine's aggregator actor, created on first use (named, so ranks find it by engine id)."""
    opts = {"name": aggregator_name(engine_id), "get_if_exists": True, "num_cpus": 0, **options}
    return StatsAggregator.options(**opts).remote(engine_id, world_size, tp, buffer_size, stats_timeout_s)
