"""Exact KV-aware routing across engine replicas (`fleet_routing: kv`): what Serve's `RequestRouter`
(deployment/router/request_router.py) decides with, fed by the replicas' own KV event streams.

Two levels, one rule. Each engine places a request on one of its dp groups with the `kv` score
(engine/placement.py); with several engine replicas this router scores every (replica, dp group) pair with
the same rule (`kv_rank`), from one `KVIndex` per replica built from that replica's `/kv_events` stream, and hands
the chosen replica the group it scored best (`GenerateRequest.dp`), so the engine does not route again.

- `FleetFollower` (in the ingress replica, on its event loop) long-polls each replica's `follow`: the events
  of its KV stream since the last id (a snapshot after a restart, a resync or a first call), and its groups'
  load and room. Serve's handle cannot address a replica, so the call carries `replica=<id>` and the router
  sends it to that replica.
- `KVFleetRouter` (Serve's router, on the ingress's event loop: deployment/build.py, INGRESS_ENV) decides with
  the views the follower writes (`place`). They share a `FleetView`: the router owns the set of live replicas
  (Serve tells it), the follower the per-replica views. Plain dict reads, appends and whole-object replacements
  only, so no lock, even where Serve runs the router on a thread of its own (its default elsewhere, and
  in tests): CPython's dict and list operations are atomic (a decision appended while a report replaces the
  list is lost, which only makes that replica's load look lighter until its next report).

Between a decision and the replica's next report the router counts what it sent there itself: each routed
request carries a ticket (this view's id, a sequence number); a replica reports the newest ticket of each
router it admitted, and the requests up to it are in its own load and room from then on. A decision whose
request did not go there leaves that replica's view when Serve says so: routed again (the replica rejected
it), or sent elsewhere (`went_to`: the chosen replica was full, Serve took one of the next rank); one Serve
says nothing of (cancelled before it was sent, or Serve without the rejection protocol) counts SENT_S at most.

No dp group up on any replica is not a reason to hold a request in Serve's router (a routing task spinning on
an empty choice): it goes to a replica all the same (those without a group up rank last) and waits there, in
the engine's `Orphans`, up to `placement_timeout_s` for a group to come back.

A replica that leaves Serve's replica set (died, replaced) is forgotten at once: its view is dropped, so no
request is sent its way for blocks that are gone; its successor (a new replica id, the same engine id) is
followed from a snapshot of its own empty cache. Salts are in the block keys (kvcache/events.py), so one
tenant's blocks never predict another's reuse.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.kv_index import KVIndex
from engine.messages import FollowReport, GenerateRequest, GroupState
from engine.placement import kv_rank
from kvcache.events import prompt_keys

logger = logging.getLogger("kvfleet.deployment")

POLL_S = 1.0  # a follow long poll's wait: the groups' load is at most this old while no event comes
RETRY_S = 0.5  # after a failed follow call (the replica is starting, or going away)
PUBLISH_S = 5.0  # how long a sent prompt's blocks count as coming without its replica's events showing them
# how long a decision counts in its replica's load without the replica reporting it admitted (reports come every
# POLL_S): its request went elsewhere, or nowhere, and Serve did not say
SENT_S = 10.0
DECISIONS_KEPT = 4096  # the router's latest decision times, for /metrics' quantiles


@dataclass
class Sent:
    """A request this router sent to a replica, until that replica's reports account for it."""

    ticket: int
    dp: int
    tokens: int  # what it adds to the group's load, and
    blocks: int  # takes of its room, until the replica reports having admitted it
    keys: list[int]  # its prompt's full blocks: held soon, until the replica's events say they are
    at: float


@dataclass
class ReplicaView:
    """One engine replica as its KV stream showed it: the blocks each dp group holds, and its groups' state."""

    engine: str
    block_size: int
    index: KVIndex
    groups: list[GroupState]
    sent: list[Sent] = field(default_factory=list)
    admitted: int = -1  # the newest of this router's tickets the replica reported admitted
    last_id: str | None = None

    def report(self, groups: list[GroupState], admitted: int) -> None:
        """The replica's groups now; `admitted`: the newest of this router's tickets it has admitted."""
        self.groups, self.admitted = groups, admitted
        self.prune(time.monotonic())

    def prune(self, now: float) -> None:
        """Forget the sent requests accounted for: admitted, with their prompt's blocks in the index (or after
        PUBLISH_S: it waited, failed or was evicted meanwhile); or never admitted within SENT_S (it went to
        another replica, or to none, and Serve did not say: without a bound it would weigh here for good)."""
        if self.sent:
            self.sent = [s for s in self.sent if self._counts(s, now)]

    def _counts(self, s: Sent, now: float) -> bool:
        if s.ticket > self.admitted:
            return now - s.at < SENT_S
        return now - s.at < PUBLISH_S and bool(s.keys) and s.keys[-1] not in self.index.blocks[s.dp]

    def drop(self, ticket: int) -> None:
        """Forget a decision whose request did not come here (a whole-list replacement: see FleetView)."""
        if any(s.ticket == ticket for s in self.sent):
            self.sent = [s for s in self.sent if s.ticket != ticket]

    def pending(self, dp: int) -> tuple[int, int]:
        """(tokens, blocks) sent to group `dp` that its last report did not count yet."""
        tokens = blocks = 0
        for s in self.sent:
            if s.dp == dp and s.ticket > self.admitted:
                tokens += s.tokens
                blocks += s.blocks
        return tokens, blocks

    def prefix(self, dp: int, keys: list[int]) -> tuple[int, int]:
        """(primary, host) blocks of the longest prefix of `keys` group `dp` holds, or will hold by the time
        this prompt is prefilled there: the blocks of the prompts sent to it whose events have not come yet
        (without them a tenant's burst would scatter over the replicas before its first blocks show)."""
        primary, host = self.index.prefix(dp, keys)
        if primary + host == len(keys) or not self.sent:
            return primary, host
        coming = {k for s in self.sent if s.dp == dp for k in s.keys}
        for key in keys[primary + host:]:
            if key not in coming and key not in self.index.blocks[dp]:
                break
            primary += 1
        return primary, host


class FleetView:
    """What the follower and the router share, per engine deployment in this process (see the module's doc)."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(6)  # names this process's router in the replicas' reports
        self.tickets = itertools.count()
        self.live: frozenset[str] = frozenset()  # the replica ids Serve routes to now (the router's)
        self.replicas: dict[str, ReplicaView] = {}  # by replica id (the follower's)
        self.on_change: Any = None  # the follower's wake-up, safe to call from the router's thread
        self.decision_s: deque[float] = deque(maxlen=DECISIONS_KEPT)  # how long each `place` took (the router's)
        self.decision_cpu_s: deque[float] = deque(maxlen=DECISIONS_KEPT)  # and its thread's CPU time in it
        self.follow_calls = 0  # follow calls answered (the follower's)

    def set_live(self, ids: frozenset[str]) -> None:
        if ids == self.live:
            return
        self.live = ids
        for rid in list(self.replicas):
            if rid not in ids:
                self.forget(rid)
        if self.on_change is not None:
            self.on_change()

    def unsend(self, ticket: int, kept: str | None = None) -> None:
        """Forget decision `ticket` everywhere but in replica `kept`'s view (where its request went)."""
        for rid, v in list(self.replicas.items()):
            if rid != kept:
                v.drop(ticket)

    def forget(self, rid: str) -> None:
        view = self.replicas.pop(rid, None)
        if view is not None:
            logger.info("fleet router: replica %s (engine %s) is gone: its %d blocks forgotten", rid, view.engine,
                        sum(len(b) for b in view.index.blocks))


_VIEWS: dict[tuple[str, str], FleetView] = {}


def fleet_view(app_name: str, deployment: str) -> FleetView:
    """The process's view of one engine deployment (the router and the follower find each other here)."""
    return _VIEWS.setdefault((app_name, deployment), FleetView())


def router_metrics(view: FleetView) -> str:
    """This process's router on /metrics: its decision time over the latest decisions, and its follower's calls
    (labelled by the ingress replica, as each replica routes and follows on its own)."""
    try:
        from ray import serve

        ingress = serve.get_replica_context().replica_id.unique_id
    except RuntimeError:  # not in a Serve replica (tests)
        ingress = "local"
    lines = []
    for name, values, what in (("decision_seconds", view.decision_s, "took to place a request"),
                               ("decision_cpu_seconds", view.decision_cpu_s, "computed (its thread's CPU time) "
                                "to place a request")):
        times = sorted(values)
        lines += [f"# HELP kvfleet_router_{name} how long the kv router {what} (its latest {DECISIONS_KEPT} "
                  "decisions)", f"# TYPE kvfleet_router_{name} gauge"]
        for q in (0.5, 0.9, 0.99):
            value = times[min(len(times) - 1, int(q * len(times)))] if times else 0.0
            lines.append(f'kvfleet_router_{name}{{ingress="{ingress}",quantile="{q}"}} {value:.6g}')
    lines += ["# HELP kvfleet_router_follow_calls_total follow calls the ingress's follower made to engine replicas",
              "# TYPE kvfleet_router_follow_calls_total counter",
              f'kvfleet_router_follow_calls_total{{ingress="{ingress}"}} {view.follow_calls}']
    return "\n".join(lines) + "\n"


def place(view: FleetView, weights: tuple[float, float, float, float], candidates: list[Any],
          routed: GenerateRequest) -> list[list[Any]]:
    """Serve's replicas (`RunningReplica`s) in ranks, best first: the one whose best dp group has the best `kv`
    score (that group written on `routed`), the other known replicas with a group up, those not followed yet
    (just started), last those with no group up (their engine keeps the request waiting for one). Never empty
    while there are candidates: on an empty answer Serve's routing task would try again at once, for good."""
    _undecide(view, routed)
    now = time.monotonic()
    scored: list[tuple[tuple, Any, ReplicaView]] = []
    fresh: list[Any] = []
    down: list[Any] = []
    keys: list[int] = []
    B = 0
    for order, r in enumerate(candidates):
        v = view.replicas.get(r.replica_id.unique_id)
        if v is None or not v.groups:
            fresh.append(r)
            continue
        v.prune(now)
        if v.block_size != B:  # every replica has the same block size: the keys are computed once
            B = v.block_size
            keys = prompt_keys(routed.token_ids, B, routed.cache_salt)[:max(0, (len(routed.token_ids) - 1) // B)]
        choice = _best_group(v, weights, keys, len(routed.token_ids), order)
        if choice is None:
            down.append(r)
        else:
            scored.append((choice, r, v))
    if not scored:
        return [rank for rank in (fresh, down) if rank]  # nothing to score: Serve takes the shortest queue
    scored.sort(key=lambda c: c[0][0])
    (_, blocks, dp), first, v = scored[0]
    _decide(view, v, routed, dp, blocks, keys, now)
    return [rank for rank in ([first], [c[1] for c in scored[1:]] + fresh, down) if rank]


def _best_group(v: ReplicaView, weights: tuple[float, float, float, float], keys: list[int], tokens: int,
                order: int) -> tuple[tuple, int, int] | None:
    """(rank, blocks held, dp) of the replica's best group that is up, or None while none is."""
    B = v.block_size
    need = -(-tokens // B)
    choice = None
    for dp, g in enumerate(v.groups):
        if not g.up:
            continue
        hits = v.prefix(dp, keys)
        sent_tokens, sent_blocks = v.pending(dp)
        load, room = g.load + sent_tokens, g.room - sent_blocks
        rank = kv_rank(weights, B, hits, load, need, room, len(v.index.blocks[dp])) + (order, dp)
        if choice is None or rank < choice[0]:
            choice = (rank, sum(hits), dp)
    return choice


def _decide(view: FleetView, v: ReplicaView, routed: GenerateRequest, dp: int, blocks: int, keys: list[int],
            now: float) -> None:
    """Write the decision on `routed` (it travels with the call), and count it in the replica's view until the
    replica reports it."""
    routed.engine, routed.dp, routed.blocks = v.engine, dp, blocks
    routed.partial = v.index.partial_tokens(dp, routed.token_ids, keys, blocks, routed.cache_salt)
    routed.router, routed.ticket = view.id, next(view.tickets)
    total = len(routed.token_ids) + routed.max_tokens  # what the engine's load and room count once it has it
    v.sent.append(Sent(routed.ticket, dp, total - blocks * v.block_size, -(-total // v.block_size) - blocks, keys,
                       now))


def _undecide(view: FleetView, routed: GenerateRequest) -> None:
    """A request Serve routes again (no rank took it: full, it rejected it, or found dead first): the last
    decision never reached a replica, so it leaves the view, and `routed` carries none until this one."""
    if routed.router == view.id and routed.ticket >= 0:
        view.unsend(routed.ticket)
    routed.engine, routed.dp, routed.blocks, routed.partial, routed.router, routed.ticket = None, -1, 0, 0, "", -1


def routed_of(pending_request: Any) -> GenerateRequest | None:
    """The generate call's `GenerateRequest` (its positional argument in Serve's `PendingRequest`), if any."""
    routed = next((a for a in pending_request.args if isinstance(a, GenerateRequest)), None)
    return routed if routed is not None and routed.token_ids is not None else None


def went_to(view: FleetView, routed: GenerateRequest, rid: str) -> None:
    """Serve sent the request to replica `rid` (its `on_request_routed`). Chosen for another replica (that one
    was full and Serve took the next rank), it leaves that one's load now; `rid`'s own report counts it."""
    if routed.router == view.id and routed.ticket >= 0:
        view.unsend(routed.ticket, kept=rid)


class FleetFollower:
    """Follows every live replica's KV stream into the shared view: one long poll per replica."""

    def __init__(self, handle: Any, view: FleetView) -> None:
        self._h = handle
        self.view = view
        self._tasks: dict[str, asyncio.Task] = {}
        self._changed = asyncio.Event()
        self._main: asyncio.Task | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.view.on_change = lambda: loop.call_soon_threadsafe(self._changed.set)
        self._main = loop.create_task(self._supervise())

    async def close(self) -> None:
        tasks = [t for t in (self._main, *self._tasks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def replica_of(self, engine: str) -> str | None:
        """The live replica that is engine `engine` now, as its last follow answer said."""
        for rid, v in list(self.view.replicas.items()):
            if v.engine == engine and rid in self.view.live:
                return rid
        return None

    async def _supervise(self) -> None:
        while True:
            self._changed.clear()
            live = self.view.live
            for rid in live - self._tasks.keys():
                self._tasks[rid] = asyncio.create_task(self._follow(rid))
            for rid in self._tasks.keys() - live:
                self._tasks.pop(rid).cancel()
            await self._changed.wait()

    async def _follow(self, rid: str) -> None:
        after: str | None = None
        while rid in self.view.live:
            try:
                got = await self._h.follow.remote(after, POLL_S, replica=rid)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # starting, or going away: Serve's replica set says which
                logger.info("fleet router: following replica %s failed (%s); retrying", rid, type(e).__name__)
                after = None
                await asyncio.sleep(RETRY_S)
                continue
            self.view.follow_calls += 1
            if got.replica != rid:  # another replica answered: this one is not (or no longer) there
                await asyncio.sleep(RETRY_S)
                continue
            after = self._apply(rid, got)

    def _apply(self, rid: str, got: FollowReport) -> str | None:
        """One follow answer into the replica's view; the id to resume after (None: ask for a snapshot)."""
        v = self.view.replicas.get(rid)
        if v is None or v.engine != got.engine:
            if rid not in self.view.live:
                return None
            v = ReplicaView(got.engine, got.block_size, KVIndex(len(got.groups), 1 << 30, got.block_size), got.groups)
            self.view.replicas[rid] = v
        ok = True
        for ev in got.events:
            try:
                ok = v.index.apply(ev.dp, ev.events) and ok
            except (IndexError, TypeError):  # not an event this stream sends (no such group): resync
                ok = False
            v.last_id = ev.id
        v.report(got.groups, got.tickets.get(self.view.id, -1))
        return v.last_id if ok else None
