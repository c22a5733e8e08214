"""The fleet's engine ids while Serve autoscales the engine replicas (`engine_replicas_max`): one lease per id.

Without autoscaling an engine's id is its Serve replica rank, and a replica Serve starts in place of a dead one
gets the dead one's rank, so the same id (its rank actors, its aggregator, its statistics). Under autoscaling
ranks no longer name engines: after a scale-down Serve makes the ranks contiguous again by giving a live
replica another rank (Ray 2.60, `DeploymentRankManager`), so a replica started later could get the rank, and
so the id, of a live or draining one. The registry, one named actor per fleet, leases ids instead:

- `claim(rank, holder)`: the id of the replica's rank when that id is free (never leased, or its holder is
  dead: a replica Serve restarted keeps its own), else the lowest free id. Never an id whose holder lives
  (draining included: a replica holds its id until its engine has shut down) nor a gone one whose aggregator
  still runs (so ids stay within the most replicas at once and the few gone in the last `GONE_GRACE_S`).
- `release(id, holder)`: the replica's engine has shut down (Serve scaled it down): the id is gone. Its
  aggregator lives `GONE_GRACE_S` more, so every ingress mirror reads its last records; then its cumulative
  counters are read into the lease (`final`) and it is removed.
- `engines()`: every id and its state, for the ingresses' fleet view, and `retired`, the counters of gone
  engines no longer listed (forgotten after `retention_s`, or their id leased again): every ingress sums the
  same fleet counters from it, whenever it started. Each call also sweeps: an id whose holder died and that no
  replica took again within `DEAD_GRACE_S` (Serve scaled it away while it was dead) is gone too, and what its
  engine left (rank actors, placement groups, aggregator) is removed.

Why an actor: a claim must see every other claim (Serve starts replicas at once), and Ray's named actors are
the one serialized place Ray gives; its key-value store has no compare-and-set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import time
from dataclasses import dataclass
from typing import Any

import ray

log = logging.getLogger("kvfleet.engine")

GONE_GRACE_S = 10.0  # a gone engine's aggregator outlives it this long: the ingress mirrors read its last records
# a dead holder's id waits this long for Serve's replacement before it is gone: long enough for a lost node's
# replica to come back on a new one, short enough that a replica killed at the end of its drain frees its GPUs
DEAD_GRACE_S = 120.0
SWEEP_S = 5.0


def registry_name(engine_id: str) -> str:
    return f"kvfleet-engines-{engine_id}"


@dataclass
class Lease:
    holder: str  # the holding replica's actor name (in Serve's namespace)
    gone: bool = False  # its engine shut down, or its holder died and no replica took it again
    since: float = 0.0  # when it was claimed, or went
    dead_since: float | None = None  # when its (live) holder was first found dead
    aggregator: bool = True  # its aggregator may still run (removed once gone for GONE_GRACE_S)
    final: dict[str, int] | None = None  # a gone engine's cumulative counters, read before its aggregator went


def choose(leases: dict[str, Lease], base: str, rank: int, holder: str, alive: set[str]) -> str:
    """The id a replica of Serve rank `rank` gets (the rule in the module docstring). `alive`: the holders
    known to live. A gone id is free again once its aggregator is removed, so ids stay within the most replicas
    at once, plus those gone in the last GONE_GRACE_S."""
    def free(eid: str) -> bool:
        lease = leases.get(eid)
        if lease is None or lease.holder == holder:
            return True
        if lease.gone:
            return not lease.aggregator
        return lease.holder not in alive

    preferred = f"{base}-{rank}"
    if free(preferred):
        return preferred
    n = 0
    while not free(f"{base}-{n}"):
        n += 1
    return f"{base}-{n}"


class EngineRegistryImpl:
    """The registry's state and rules; `EngineRegistry` is the actor (tests use this class in-process). One
    lock around each call's changes: a removal awaits Ray, and a claim must not interleave with it."""

    def __init__(self, base: str, retention_s: float, namespace: str = "serve", store: bool = True) -> None:
        self.base = base
        self.retention_s = retention_s
        self.namespace = namespace
        self._key = f"engine-registry/{base}" if store else None
        self.leases, self.retired = self._load()
        self._sweeper: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    def _load(self) -> tuple[dict[str, Lease], dict[str, int]]:
        """The leases a restarted registry actor had (Ray restarts it; they live in the GCS key-value store)."""
        from aggregator.actor import kv_store

        raw = kv_store().get(self._key) if self._key else None
        if not raw:
            return {}, {}
        state = pickle.loads(raw)
        return {eid: Lease(**fields) for eid, fields in state["leases"].items()}, state["retired"]

    def _save(self) -> None:
        from aggregator.actor import kv_store

        if self._key:
            state = {"leases": {eid: dataclasses.asdict(x) for eid, x in self.leases.items()}, "retired": self.retired}
            kv_store().put(self._key, pickle.dumps(state))

    def _alive(self, holder: str) -> bool:
        try:
            ray.get_actor(holder, namespace=self.namespace)
            return True
        except ValueError:  # no live actor of that name (a replica actor is never restarted under its name)
            return False

    def _sweeping(self) -> None:
        """Sweep every SWEEP_S while the actor lives, readers or not (after the app is deleted, a gone
        engine's aggregator must still go)."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self.engines()
            except Exception:
                log.exception("engine registry: sweep failed")

    def _retire(self, lease: Lease) -> None:
        """A gone engine leaves the table: its counters stay in the fleet's sums."""
        for k, v in (lease.final or {}).items():
            self.retired[k] = self.retired.get(k, 0) + v

    async def claim(self, rank: int, holder: str) -> str:
        self._sweeping()
        async with self._lock:
            alive = {x.holder for x in self.leases.values() if not x.gone and self._alive(x.holder)}
            eid = choose(self.leases, self.base, rank, holder, alive)
            before = self.leases.get(eid)
            if before is not None and before.gone:  # a gone id taken again: its counters retire, a fresh engine
                self._retire(before)
            self.leases[eid] = Lease(holder, since=time.time())
            self._save()
        successor = before is not None and not before.gone and before.holder != holder
        log.info("engine id %s leased to replica %s (Serve rank %d%s)", eid, holder, rank,
                 ", its dead holder's successor" if successor else "")
        return eid

    async def release(self, eid: str, holder: str) -> None:
        self._sweeping()
        async with self._lock:
            lease = self.leases.get(eid)
            if lease is None or lease.holder != holder or lease.gone:
                return
            lease.gone, lease.since = True, time.time()
            self._save()
        log.info("engine %s gone (its replica stopped); its aggregator goes in %.0f s", eid, GONE_GRACE_S)

    async def disown(self, eid: str) -> None:
        """An engine of a fixed fleet (no autoscaling) starts under this id: the registry lets go of it, so its
        sweep never removes that engine's aggregator or ranks (an app redeployed without autoscaling)."""
        async with self._lock:
            lease = self.leases.pop(eid, None)
            if lease is not None:
                self._retire(lease)
                self._save()

    async def engines(self) -> dict[str, Any]:
        """After a sweep: {"engines": {id: {"gone", "since", "aggregator", "final"}}, "retired": the counters of
        the gone engines no longer listed}. Ids gone past the retention are forgotten."""
        async with self._lock:
            now = time.time()
            for eid, lease in list(self.leases.items()):
                if lease.gone:
                    if lease.aggregator and now - lease.since >= GONE_GRACE_S:
                        await self._remove(eid, lease)
                    if now - lease.since >= max(self.retention_s, GONE_GRACE_S):
                        self._retire(self.leases.pop(eid))
                    continue
                if self._alive(lease.holder):
                    lease.dead_since = None
                    continue
                lease.dead_since = lease.dead_since or now
                if now - lease.dead_since >= DEAD_GRACE_S:  # Serve did not start it again: scaled away while dead
                    lease.gone, lease.since = True, now
                    log.warning("engine %s gone: its replica died and none took its place in %.0f s", eid,
                                DEAD_GRACE_S)
            self._save()
            table = {eid: {"gone": x.gone, "since": x.since, "aggregator": x.aggregator, "final": x.final}
                     for eid, x in self.leases.items()}
            return {"engines": table, "retired": dict(self.retired)}

    async def _remove(self, eid: str, lease: Lease) -> None:
        """What a gone engine left: its counters read, then its aggregator and the aggregator's checkpoint, and
        its rank actors and placement groups (a dead engine's; a clean shutdown removed them)."""
        from aggregator.actor import final_counters, remove_aggregator
        from engine import ranks

        lease.final = await final_counters(eid)
        lease.aggregator = False
        await asyncio.to_thread(remove_aggregator, eid)
        left = await asyncio.to_thread(ranks.left_behind, eid)
        await asyncio.to_thread(ranks.remove_leftovers, eid, left)


EngineRegistry = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(EngineRegistryImpl)


async def disown_if_leased(engine_id: str, eid: str) -> None:
    """What a fixed fleet's engine does at start: a registry left by an autoscaled app of the same `engine_id`
    (if any) forgets `eid`."""
    from aggregator.actor import NAMESPACE

    try:
        registry = ray.get_actor(registry_name(engine_id), namespace=NAMESPACE)
    except ValueError:
        return
    await registry.disown.remote(eid)


def get_registry(engine_id: str, retention_s: float, resource: str = "") -> ray.actor.ActorHandle:
    """The fleet's registry, created on first use (detached and named, as the aggregators: it outlives any
    replica). `resource`: as the aggregators' (settings `engine_resource`)."""
    from aggregator.actor import NAMESPACE, SLIVER

    return EngineRegistry.options(name=registry_name(engine_id), namespace=NAMESPACE, get_if_exists=True,
                                  lifetime="detached", **({"resources": {resource: SLIVER}} if resource else {})
                                  ).remote(engine_id, retention_s)
