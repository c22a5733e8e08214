"""The stats view's upstream: one engine's StatsAggregator actor, called from the ingress replica."""

import time
from typing import Any

from aggregator.messages import AggregatorHealth, RankHealth

# how long the aggregator gathers records once a long poll has one, while they come fast (the last reply was less
# than this ago): an engine emits a record a step, so without it each mirror makes an actor call a record at a GPU's
# step rate (most of the ingress's CPU a record: bench/fleet_scale.py); with it, a call a LINGER_S at most. The
# first record after a quiet spell is not held: an idle engine's next record reaches readers at once
LINGER_S = 0.1


class AggregatorClient:
    """The mirror's upstream: the StatsAggregator actor handle, given (the engine named it), or found by the
    engine's id: then looked up on first use and again after a failed call, since an engine that has not
    started yet has no aggregator, and one replaced by a new actor of the same name has a new handle."""

    def __init__(self, handle: Any = None, engine_id: str | None = None) -> None:
        if handle is None and engine_id is None:
            raise ValueError("AggregatorClient needs the aggregator's handle or its engine's id")
        self._h, self._engine_id = handle, engine_id
        self._last_records = float("-inf")  # when a long poll last brought records

    def _handle(self) -> Any:
        if self._h is None:
            import ray

            from aggregator.actor import NAMESPACE, aggregator_name

            self._h = ray.get_actor(aggregator_name(self._engine_id), namespace=NAMESPACE)
        return self._h

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await getattr(self._handle(), method).remote(*args, **kwargs)
        except Exception:
            if self._engine_id is not None:
                self._h = None  # look it up again next time
            raise

    async def query(self, since: int, limit: int | None, ranks: bool) -> list[dict]:
        return await self._call("query", since=since, limit=limit, ranks=ranks)

    async def wait_records(self, since: int, timeout_s: float) -> list[dict]:
        fast = time.monotonic() - self._last_records < LINGER_S
        got = await self._call("wait_records", since, timeout_s=timeout_s, linger_s=LINGER_S if fast else 0.0)
        if got:
            self._last_records = time.monotonic()
        return got

    async def ranks(self) -> dict[str, RankHealth]:
        return await self._call("ranks")

    async def kv_cache_stats(self) -> dict:
        return await self._call("kv_cache_stats")

    async def metrics_text(self) -> str:
        return await self._call("metrics_text")

    async def health(self) -> AggregatorHealth:
        return await self._call("health")
