"""An engine's rank actors: one placement group per dp group, one `RankWorker` actor per rank in it.

A dp group is the unit that starts, rendezvous and stops together: its tp ranks are packed on one node
(`STRICT_PACK`), the tp rendezvous runs on tp rank 0's address, and what one group does never waits for
another's.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .config import CacheSettings
from .worker import RankSpec, RankWorker

SETUP_TIMEOUT_S = 600.0


def device_of(settings: Any) -> str:
    if settings.device != "auto":
        return settings.device
    return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"


def dtype_of(settings: Any, device: str) -> str:
    return settings.dtype if settings.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")


async def start_group(settings: Any, dp: int, device: str, dtype: str) -> tuple[Any, list[ray.actor.ActorHandle]]:
    """The placement group and the (not yet set up) rank actors of dp group `dp`."""
    s = settings
    bundle = {"CPU": s.num_cpus_per_rank, **({"GPU": 1} if device == "cuda" else {})}
    pg = placement_group([bundle] * s.tp, strategy="STRICT_PACK", name=f"kvfleet-{s.engine_id}-dp{dp}")
    await asyncio.wait_for(pg.ready(), SETUP_TIMEOUT_S)
    actor_cls = ray.remote(RankWorker)
    cache = CacheSettings.of(s)
    workers = []
    for tp_rank in range(s.tp):
        rank = dp * s.tp + tp_rank
        spec = RankSpec(
            engine_id=s.engine_id, rank=rank, dp=s.dp, tp=s.tp, model=s.model, device=device, dtype=dtype,
            seed=s.seed, cache=cache, max_num_batched_tokens=s.max_num_batched_tokens,
            num_threads=max(1, int(s.num_cpus_per_rank)))
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=tp_rank)
        workers.append(actor_cls.options(
            name=f"kvfleet-rank-{s.engine_id}-{rank}", num_cpus=s.num_cpus_per_rank,
            num_gpus=1 if device == "cuda" else 0, scheduling_strategy=strategy, max_restarts=0).remote(spec))
    return pg, workers


async def setup_group(workers: list[ray.actor.ActorHandle]) -> list[dict[str, Any]]:
    """Rendezvous a group's tp ranks on tp rank 0's address, load the model, build the caches."""
    addr = await workers[0].address.remote()
    setups = [w.setup.remote(addr["ip"], addr["port"]) for w in workers]
    return await asyncio.wait_for(asyncio.gather(*setups), SETUP_TIMEOUT_S)


def stop(workers: list[ray.actor.ActorHandle], pgs: list[Any]) -> None:
    """Kill rank actors and remove their placement groups (what is already gone is skipped)."""
    for w in workers:
        with contextlib.suppress(Exception):
            ray.kill(w)
    for pg in pgs:
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
