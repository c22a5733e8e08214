"""The fleet's engine ids while Serve autoscales the engine replicas (`engine_replicas_max`): one lease per id.

Without autoscaling an engine's id is its Serve replica rank, and a replica Serve starts in place of a dead one
gets the dead one's rank, so the same id (its rank actors, its aggregator, its statistics). Under autoscaling
ranks no longer name engines: after a scale-down Serve makes the ranks contiguous again by giving a live
replica another rank (Ray 2.60, `DeploymentRankManager`), so a replica started later could get the rank, and
so the id, of a live or draining one. The registry, one named actor per fleet, leases ids instead:

- `claim(rank, holder)`: the id of the replica's rank when that id is free (never leased, or its holder is
  dead: a replica Serve restarted keeps its own), else the lowest free id. Never an id whose holder lives
  (draining included: a replica holds its id until its engine has shut down) nor one gone less than
  `retention_s` ago (the ingresses still serve its records).
- `release(id, holder)`: the replica's engine has shut down (Serve scaled it down): the id is gone. Its
  aggregator lives `GONE_GRACE_S` more, so every ingress mirror reads its last records, then it is removed.
- `engines()`: every id and its state, for the ingresses' fleet view. Each call also sweeps: an id whose
  holder died and that no replica took again within `DEAD_GRACE_S` (Serve scaled it away while it was dead) is
  gone too, and what its engine left (rank actors, placement groups, aggregator) is removed.

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

import ray

log = logging.getLogger("kvfleet.engine")

GONE_GRACE_S = 10.0  # a gone engine's aggregator outlives it this long: the ingress mirrors read its last records
DEAD_GRACE_S = 30.0  # a dead holder's id waits this long for Serve's replacement before it is gone
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


def choose(leases: dict[str, Lease], base: str, rank: int, holder: str, alive: set[str], now: float,
           retention_s: float) -> str:
    """The id a replica of Serve rank `rank` gets (the rule in the module docstring). `alive`: the holders
    known to live."""
    def free(eid: str) -> bool:
        lease = leases.get(eid)
        if lease is None or lease.holder == holder:
            return True
        if lease.gone:
            return now - lease.since >= retention_s
        return lease.holder not in alive

    preferred = f"{base}-{rank}"
    if free(preferred):
        return preferred
    n = 0
    while not free(f"{base}-{n}"):
        n += 1
    return f"{base}-{n}"


class EngineRegistryImpl:
    """The registry's state and rules; `EngineRegistry` is the actor (tests use this class in-process)."""

    def __init__(self, base: str, retention_s: float, namespace: str = "serve", store: bool = True) -> None:
        self.base = base
        self.retention_s = retention_s
        self.namespace = namespace
        self._key = f"engine-registry/{base}" if store else None
        self.leases: dict[str, Lease] = self._load()
        self._sweeper: asyncio.Task | None = None

    def _load(self) -> dict[str, Lease]:
        """The leases a restarted registry actor had (Ray restarts it; they live in the GCS key-value store)."""
        from aggregator.actor import kv_store

        raw = kv_store().get(self._key) if self._key else None
        return {eid: Lease(**fields) for eid, fields in pickle.loads(raw).items()} if raw else {}

    def _save(self) -> None:
        from aggregator.actor import kv_store

        if self._key:
            kv_store().put(self._key, pickle.dumps({eid: dataclasses.asdict(x) for eid, x in self.leases.items()}))

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

    async def claim(self, rank: int, holder: str) -> str:
        self._sweeping()
        now = time.time()
        alive = {lease.holder for lease in self.leases.values() if not lease.gone and self._alive(lease.holder)}
        eid = choose(self.leases, self.base, rank, holder, alive, now, self.retention_s)
        before = self.leases.get(eid)
        self.leases[eid] = Lease(holder, since=now)
        self._save()
        if before is not None and before.gone and before.aggregator:  # a gone id taken again: a fresh engine
            await self._remove(eid)
        log.info("engine id %s leased to replica %s (Serve rank %d%s)", eid, holder, rank,
                 ", its dead holder's successor" if before is not None and not before.gone and before.holder != holder
                 else "")
        return eid

    async def release(self, eid: str, holder: str) -> None:
        self._sweeping()
        lease = self.leases.get(eid)
        if lease is None or lease.holder != holder or lease.gone:
            return
        lease.gone, lease.since = True, time.time()
        self._save()
        log.info("engine %s gone (its replica stopped); its aggregator goes in %.0f s", eid, GONE_GRACE_S)

    async def engines(self) -> dict[str, dict]:
        """{id: {"gone", "since", "aggregator"}} after a sweep; ids gone past the retention are forgotten."""
        now = time.time()
        for eid, lease in list(self.leases.items()):
            if lease.gone:
                if lease.aggregator and now - lease.since >= GONE_GRACE_S:
                    await self._remove(eid)
                if now - lease.since >= max(self.retention_s, GONE_GRACE_S):
                    del self.leases[eid]
                continue
            if self._alive(lease.holder):
                lease.dead_since = None
                continue
            lease.dead_since = lease.dead_since or now
            if now - lease.dead_since >= DEAD_GRACE_S:  # Serve did not start it again: scaled away while dead
                lease.gone, lease.since = True, now
                log.warning("engine %s gone: its replica died and none took its place in %.0f s", eid, DEAD_GRACE_S)
        self._save()
        return {eid: {"gone": lease.gone, "since": lease.since, "aggregator": lease.aggregator}
                for eid, lease in self.leases.items()}

    async def _remove(self, eid: str) -> None:
        """What a gone engine left: its rank actors and placement groups (a dead engine's; a clean shutdown
        removed them), its aggregator and the aggregator's checkpoint."""
        from aggregator.actor import remove_aggregator
        from engine import ranks

        self.leases[eid].aggregator = False
        self._save()
        await asyncio.to_thread(remove_aggregator, eid)
        left = await asyncio.to_thread(ranks.left_behind, eid)
        await asyncio.to_thread(ranks.remove_leftovers, eid, left)


EngineRegistry = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(EngineRegistryImpl)


def get_registry(engine_id: str, retention_s: float, resource: str = "") -> ray.actor.ActorHandle:
    """The fleet's registry, created on first use (detached and named, as the aggregators: it outlives any
    replica). `resource`: as the aggregators' (settings `engine_resource`)."""
    from aggregator.actor import NAMESPACE, SLIVER

    return EngineRegistry.options(name=registry_name(engine_id), namespace=NAMESPACE, get_if_exists=True,
                                  lifetime="detached", **({"resources": {resource: SLIVER}} if resource else {})
                                  ).remote(engine_id, retention_s)
