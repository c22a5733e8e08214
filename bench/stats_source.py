"""A stand-in statistics source for http_bench.py: the ingress over an actor that emits cluster records at a
GPU's rate (100 a second), with no engine, so that a row measures what readers cost the proxy and the ingress.

The records are the real shape: built once by `aggregator.assembler.Assembler` from fake dp 2 x tp 2 ranks
(tests/support/aggregator_support.py), then re-stamped (`iter`, `timestamp`) as they are emitted. The classes go to
Ray's workers by value (this file is not an installed module).
"""

import asyncio
import collections
import sys
import time
from typing import Any

import ray
from ray import cloudpickle, serve
from ray.serve import Application

from aggregator.assembler import Assembler, iso_timestamp
from aggregator.messages import AggregatorHealth, RankHealth
from deployment.ingress.serve import KVFleetIngress
from deployment.settings import Settings
from engine.messages import EngineHealth, EngineInfo

TEMPLATES = 50  # distinct records cycled through, so each emitted record's text differs like a real one's


def template_records(n: int = TEMPLATES) -> list[dict[str, Any]]:
    from aggregator_support import FakeCluster  # tests/ is on sys.path in http_bench

    cluster = FakeCluster(dp=2, tp=2, shapes=[1, 1])
    asm = Assembler("engine-sim", 4, 2)
    asm.register(cluster.layouts)
    return asm.ingest([cluster.iteration(i) for i in range(n)])


@ray.remote(num_cpus=0)
class SimulatedStats:
    """The aggregator's read API (query, wait_records, ...) over records emitted at `rate` a second."""

    def __init__(self, rate: float, templates: list[dict], capacity: int = 10_000) -> None:
        self.templates = templates
        self.records: collections.deque = collections.deque(maxlen=capacity)
        self.rate = rate
        self._new = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._emit())

    async def _emit(self) -> None:
        t0, n = time.monotonic(), 0
        while True:
            due = int((time.monotonic() - t0) * self.rate)  # catch up after a late wake: the rate stays exact
            for i in range(n, due):
                self.records.append(dict(self.templates[i % len(self.templates)], iter=i,
                                         timestamp=iso_timestamp(time.time())))
            if due > n:
                n = due
                self._new.set()
                self._new = asyncio.Event()
            await asyncio.sleep(1 / self.rate)

    def emitted(self) -> int:
        return self.records[-1]["iter"] + 1 if self.records else 0

    async def query(self, since: int = -1, limit: int | None = None, ranks: bool = False) -> list[dict]:
        out = [r for r in self.records if r["iter"] > since]
        return out[:limit] if limit is not None else out

    async def wait_records(self, since: int, timeout_s: float) -> list[dict]:
        if not self.records or self.records[-1]["iter"] <= since:
            try:
                await asyncio.wait_for(self._new.wait(), timeout_s)
            except TimeoutError:
                return []
        return await self.query(since, 1000)

    async def ranks(self) -> dict[str, RankHealth]:
        return {}

    async def kv_cache_stats(self) -> dict:
        return dict(self.records[-1]["kvCacheStats"]) if self.records else {}

    async def metrics_text(self) -> str:
        return ""

    async def health(self) -> AggregatorHealth:
        n = self.emitted()
        return AggregatorHealth(True, "engine-sim", 1, 4, 2, n - 1 if n else None, len(self.records),
                                self.records[0]["iter"] if self.records else None, self.records.maxlen, 4, {}, 0.0)


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class SimulatedEngine:
    """What the ingress asks of the engine's replica (its limits and its aggregator), and nothing else."""

    def __init__(self, rate: float, templates: list[dict]) -> None:
        self.stats = SimulatedStats.remote(rate, templates)

    async def info(self) -> EngineInfo:
        await self.stats.start.remote()
        return EngineInfo(256, 256, 512, self.stats)

    async def health(self) -> EngineHealth:
        return EngineHealth(True, 4, 0, 0, 0, 0, {}, {})


def simulated_app(rate: float) -> Application:
    """The real ingress over a SimulatedEngine (no ranks, no generation)."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return KVFleetIngress.bind(Settings(model="random"), SimulatedEngine.bind(rate, template_records()))
