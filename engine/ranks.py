"""An engine's rank actors: one placement group per dp group, one `RankWorker` actor per rank in it.

A dp group is the unit that starts, rendezvous, stops and restarts together: its tp ranks are packed on one
node (`STRICT_PACK`), the tp rendezvous runs on tp rank 0's address, and what one group does never waits for
another's. Groups spread over nodes: each group's placement group has a soft target node (Ray's
`_soft_target_node_id`, STRICT_PACK only), the node that fits a whole group and holds the fewest of this
engine's groups (`spread_target`). Soft, so a group still starts when that node is full: Ray places it on any
node with room. Not one placement group of dp x tp bundles with STRICT_SPREAD over groups: Ray has no
"pack within, spread across" strategy, and a group must start, die and restart alone.

A restarted group gets a new placement group and new actors (new incarnations): Ray's own actor
restart (`max_restarts`) cannot help, because a restarted rank would come back without its tp group and
without the model, and its peers would still hold the dead rendezvous.

Rank actors and their placement groups are detached and named by engine id, as the aggregator is: they are
the model and the KV cache, and outlive a dead engine replica. The replica Serve starts in its place (same
replica rank, so same engine id) adopts every group whose ranks are all alive (`adopt_group`), with their
blocks cached, and starts only the others; what it does not adopt it removes (`remove_leftovers`). Serve
gives a rank to a new replica only once the replica that held it has stopped (ray/serve/_private/
deployment_state.py releases a rank after the replica stopped, so a draining one keeps its own), so two live
engines never share an engine id, and a successor never takes ranks a live predecessor steps. A graceful
shutdown kills them (`stop`); a replica killed outright leaves them for its successor, or for the next
engine of its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from aggregator.actor import NAMESPACE, TASK_EVENTS
from engine.config import EngineConfig
from engine.errors import EngineError, one_line
from workers.sampling_params import SamplingParams
from workers.step import NewRequest, RankSpec, StepPlan, StepResult, Work

log = logging.getLogger("kvfleet.engine")

SETUP_TIMEOUT_S = 600.0
ADOPT_TIMEOUT_S = 10.0  # a left rank that does not answer within this (a lost node, a hung step) is replaced
NODE_VERDICT_S = 60.0  # Ray's GCS marks a lost node dead after its health checks fail (~15-30 s by default)
PENDING_AFTER_S = 1.0  # a placement group not placed by then waits for resources: the group is pending
BACKOFF_MAX_S = 30.0


@dataclass
class Launched:
    """A dp group that is up: its placement group, its rank actors (tp rank order) and what their setup said."""

    pg: Any
    workers: list
    infos: list[dict[str, Any]]


def pg_name(engine_id: str, dp: int) -> str:
    return f"kvfleet-{engine_id}-dp{dp}"


def rank_name(engine_id: str, rank: int, launch: str) -> str:
    return f"kvfleet-rank-{engine_id}-{rank}-{launch}"


def left_by(engine_id: str, name: str) -> bool:
    """Whether a rank actor or placement group of this name is one of engine `engine_id`'s (not one of an
    engine whose id merely starts with it: `engine` must not take `engine-0`'s ranks)."""
    for prefix, rest in ((f"kvfleet-rank-{engine_id}-", r"\d+-[0-9a-f]{8}"), (f"kvfleet-{engine_id}-dp", r"\d+")):
        if name.startswith(prefix) and re.fullmatch(rest, name[len(prefix):]):
            return True
    return False


def device_of(config: EngineConfig) -> str:
    return resolve_device(config.device)


def resolve_device(device: str) -> str:
    """`device` as the ranks get it: "auto" is cuda when Ray sees GPUs in the cluster, else cpu."""
    if device != "auto":
        return device
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


def dtype_of(config: EngineConfig, device: str) -> str:
    return config.dtype if config.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")


def bundle_of(config: EngineConfig, device: str) -> dict[str, float]:
    return {"CPU": config.num_cpus_per_rank, **({"GPU": 1} if device == "cuda" else {})}


def unreachable(error: BaseException) -> bool:
    """A rank that could not be reached (its node may be lost), rather than one Ray knows is dead (killed)."""
    return isinstance(error, ray.exceptions.ActorUnavailableError)


async def node_gone(node_id: str, timeout_s: float = NODE_VERDICT_S) -> bool:
    """Until Ray's GCS has marked `node_id` dead (its raylet missed its health checks), at most `timeout_s`:
    whether it did. A restart waits for this when its ranks were unreachable, since until then Ray still
    places bundles on that node, and the new group would hang there in its setup."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.5)  # poll interval: Ray has no awaitable node-death event
    return True


def spread_target(config: EngineConfig, device: str, taken: list[str | None]) -> str | None:
    """The node a new group should prefer: alive, whose resources hold a whole group (tp bundles), with the
    fewest of `taken` (the nodes of this engine's other groups); ties to the node id, so a start is
    repeatable. None when no node holds a group (Ray then keeps the placement group pending)."""
    need = {k: v * config.tp for k, v in bundle_of(config, device).items()}
    fits = [n["NodeID"] for n in ray.nodes()
            if n["Alive"] and all(n["Resources"].get(k, 0) >= v for k, v in need.items())]
    return min(fits, key=lambda n: (taken.count(n), n)) if fits else None


@functools.cache
def rank_actor_class() -> Any:
    """The rank actor class, made once per process: every `ray.remote(cls)` exports the class anew to the GCS
    (a fresh class id, kept until the job ends), so a group restart per fault would grow the GCS by one each.
    Made on first use: the class imports torch, which the ingress has no use for."""
    from workers.worker import RankWorker

    return ray.remote(RankWorker)


async def start_group(config: EngineConfig, dp: int, device: str, dtype: str, target: str | None = None,
                      wait_s: float | None = SETUP_TIMEOUT_S,
                      pending: Any = None) -> tuple[Any, list[ray.actor.ActorHandle]]:
    """The placement group (on `target` if it has room) and the (not yet set up) rank actors of dp group `dp`.
    `wait_s`: how long its placement may wait for resources (None: as long as it takes); `pending(bool)` is
    told while it waits."""
    s = config
    pg = placement_group([bundle_of(s, device)] * s.tp, strategy="STRICT_PACK", name=pg_name(s.engine_id, dp),
                         lifetime="detached", _soft_target_node_id=target)
    try:
        ready = asyncio.ensure_future(pg.ready())
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # a removed group's error is seen
        try:
            await asyncio.wait_for(asyncio.shield(ready), PENDING_AFTER_S)
        except TimeoutError:  # no room now: pending until a node with room joins (or frees it)
            if pending is not None:
                pending(True)
            log.warning("dp group %d: waiting for resources to place its %d ranks (%s each)", dp, s.tp,
                        bundle_of(s, device))
            await asyncio.wait_for(ready, wait_s)
    except BaseException:  # not placed in time, or the launch was cancelled: the pending group must not stay
        stop([], [pg])
        raise
    finally:
        if pending is not None:
            pending(False)
    actor_cls = rank_actor_class()
    workers = []
    launch = uuid.uuid4().hex[:8]  # names stay unique while a killed predecessor's name is being released
    for tp_rank in range(s.tp):
        rank = dp * s.tp + tp_rank
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=tp_rank)
        workers.append(actor_cls.options(
            name=rank_name(s.engine_id, rank, launch), namespace=NAMESPACE, lifetime="detached",
            num_cpus=s.num_cpus_per_rank,
            num_gpus=1 if device == "cuda" else 0, scheduling_strategy=strategy, max_restarts=0,
            enable_task_events=TASK_EVENTS).remote(rank_spec(s, rank, device, dtype)))
    return pg, workers


def rank_spec(config: EngineConfig, rank: int, device: str, dtype: str) -> RankSpec:
    s = config
    return RankSpec(engine_id=s.engine_id, rank=rank, dp=s.dp, tp=s.tp, model=s.model, device=device, dtype=dtype,
                    seed=s.seed, cache=s.cache, max_num_batched_tokens=s.max_num_batched_tokens,
                    num_threads=max(1, int(s.num_cpus_per_rank)), simulation=s.simulation)


@dataclass
class Left:
    """What engines of one id left in the cluster: rank actors by (rank, launch), placement groups by name."""

    actors: dict[tuple[int, str], tuple[str, str]]  # -> (name, namespace)
    pgs: dict[str, str]  # name -> placement group id (hex), those not removed


def left_behind(engine_id: str) -> Left:
    """The rank actors and placement groups an engine of this id left (found by name)."""
    actors = {}
    prefix = f"kvfleet-rank-{engine_id}-"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        if left_by(engine_id, name):
            rank, _, launch = name[len(prefix):].partition("-")
            actors[(int(rank), launch)] = (name, actor["namespace"])
    pgs = {info["name"]: pg_id for pg_id, info in ray.util.placement_group_table().items()
           if left_by(engine_id, info.get("name") or "") and info.get("state") != "REMOVED"}
    return Left(actors, pgs)


async def adopt_group(config: EngineConfig, dp: int, device: str, dtype: str, left: Left,
                      timeout_s: float = ADOPT_TIMEOUT_S) -> Launched | None:
    """Group `dp` as a dead engine of this id left it, taken over (`RankWorker.adopt`), or None when any of
    its ranks is gone, does not answer in time, or was started with other settings (the group then starts
    anew, and `remove_leftovers` kills what is left of it)."""
    pg_id = left.pgs.get(pg_name(config.engine_id, dp))
    ranks = range(dp * config.tp, (dp + 1) * config.tp)
    launches = {launch for rank, launch in left.actors if rank == ranks[0]}
    launch = next((x for x in launches if all((r, x) in left.actors for r in ranks)), None)
    if pg_id is None or launch is None:
        return None
    try:
        workers = [ray.get_actor(*left.actors[(r, launch)]) for r in ranks]
        infos = await asyncio.wait_for(asyncio.gather(
            *[w.adopt.remote(rank_spec(config, r, device, dtype)) for w, r in zip(workers, ranks, strict=True)]),
            timeout_s)
    except Exception as e:  # gone, dying, or stuck (say, in a tp collective of a step its engine died sending
        # to only some of the group's ranks): the group starts anew
        log.warning("dp group %d: the ranks a previous engine left cannot be taken over (%s)", dp, one_line(e))
        return None
    if any(info is None for info in infos):
        log.warning("dp group %d: the ranks a previous engine left run other settings; starting anew", dp)
        return None
    return Launched(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))), workers, infos)


async def setup_group(workers: list[ray.actor.ActorHandle]) -> list[dict[str, Any]]:
    """Rendezvous a group's tp ranks on tp rank 0's address, load the model, build the caches."""
    addr = await workers[0].address.remote()
    setups = [w.setup.remote(addr["ip"], addr["port"]) for w in workers]
    return await asyncio.wait_for(asyncio.gather(*setups), SETUP_TIMEOUT_S)


async def launch_group(config: EngineConfig, dp: int, device: str, dtype: str, target: str | None = None,
                       wait_s: float | None = SETUP_TIMEOUT_S, pending: Any = None) -> Launched:
    """Start dp group `dp` (`start_group`) and set it up; on any failure, what was started is removed again."""
    pg, workers = await start_group(config, dp, device, dtype, target, wait_s, pending)
    try:
        infos = await setup_group(workers)
    except BaseException:
        stop(workers, [pg])
        raise
    return Launched(pg, workers, infos)


async def launch_all(launch: Any, n: int, stop: Any) -> list[Launched]:
    """Launch dp groups 0..n-1 at once with `launch(dp)`; if any fails, `stop` the others and raise."""
    out = await asyncio.gather(*[launch(dp) for dp in range(n)], return_exceptions=True)
    failed = [g for g in out if isinstance(g, BaseException)]
    if failed:
        for g in out:
            if not isinstance(g, BaseException):
                stop(g.workers, [g.pg])
        raise failed[0]
    return out


async def warm_up(workers: list) -> None:
    """A few steps of one group that no statistic records (first-call costs): before a group first serves."""
    params = SamplingParams(max_tokens=2, temperature=0.0)
    prompt = list(range(1, 9))
    new = NewRequest("warmup", prompt, params, None, warmup=True)
    res = await _warm_up_step(workers, StepPlan(-1, [new], [Work(new.request_id, len(prompt))], record=False))
    token = res.ran[new.request_id][1]
    await _warm_up_step(workers, StepPlan(-1, [], [Work(new.request_id, 1, token)], record=False))
    await _warm_up_step(workers, StepPlan(-1, close=[new.request_id], record=False))


async def _warm_up_step(workers: list, plan: StepPlan) -> StepResult:
    outs = await asyncio.gather(*[w.step.remote(plan) for w in workers], return_exceptions=True)
    for out in outs:
        if isinstance(out, BaseException) or out.failed:
            why = one_line(out) if isinstance(out, BaseException) else next(iter(out.failed.values()))
            raise EngineError(f"warm-up step failed: {why}")
    return outs[0]


def remove_leftovers(engine_id: str, left: Left, keep: list[Launched] = ()) -> int:
    """Kill the rank actors and remove the placement groups that an engine of this id left behind (its Serve
    replica died) but the groups in `keep` (adopted): a new engine starts every other group from a clean
    slate. Returns how many things it removed."""
    kept_actors = {w._actor_id for g in keep for w in g.workers}
    kept_pgs = {g.pg.id for g in keep}
    removed = 0
    for name, namespace in left.actors.values():
        with contextlib.suppress(Exception):
            actor = ray.get_actor(name, namespace=namespace)
            if actor._actor_id not in kept_actors:
                ray.kill(actor)
                removed += 1
    for pg_id in left.pgs.values():
        pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id)))
        if pg.id not in kept_pgs:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
                removed += 1
    if removed:
        log.warning("engine %s: removed %d rank actors and placement groups left by a previous engine",
                    engine_id, removed)
    return removed


def stop(workers: list[ray.actor.ActorHandle], pgs: list[Any]) -> None:
    """Kill rank actors and remove their placement groups (what is already gone is skipped)."""
    for w in workers:
        if w is None:
            continue
        with contextlib.suppress(Exception):
            ray.kill(w)
    for pg in pgs:
        if pg is None:
            continue
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
