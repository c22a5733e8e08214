"""Aggregator benchmark: the one stats channel through the real StatsAggregator actor at 8, 64 and 256 ranks.

The engine's side is the real `workers.stats_channel.StatsChannel` in this process (one ingest call in flight,
batching by itself); the ranks are `tests.support.aggregator_support.FakeCluster` rows (pre-built, so making them is
not timed). Per rank count:
- `paced`: 20 iterations/s for `--seconds`; emission lag = when a reader's long poll (`wait_records`) sees the
  record minus when the engine handed the iteration over; p50 / p99.
- `max it/s`: iterations handed over as fast as possible, until all are acknowledged.
- `us/rank`: the actor's cost per iteration and rank at the max rate (1e6 / it/s / ranks): flat = linear.
The baseline, in the same run: a no-op actor taking the same batches (`ceiling`, Ray's own transport).
Targets (issue 12): 256 ranks x 20 it/s sustained, lag p99 < 50 ms; per-iteration cost linear in ranks.

Run: python bench/aggregator_bench.py [--seconds 5]   (starts its own local Ray)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

import numpy as np
import ray

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from aggregator import get_or_create_aggregator  # noqa: E402
from aggregator.messages import Ack  # noqa: E402
from engine.stats_channel import StatsChannel  # noqa: E402
from tests.support.aggregator_support import FakeCluster  # noqa: E402


@ray.remote(num_cpus=0)
class NoOp:
    async def register(self, layouts, session=None):
        return Ack(1, None, 1)

    async def ingest(self, iterations, session=None):
        return Ack(1, iterations[-1].iteration, 1)


def build(ranks: int, n: int) -> tuple[FakeCluster, list]:
    cluster = FakeCluster(ranks // 2, 2, seed=ranks)
    base = [cluster.iteration(i) for i in range(min(n, 50))]
    # distinct iteration numbers, shared rows: building 256-rank rows for every iteration would dominate
    return cluster, [dataclasses.replace(base[i % len(base)], iteration=i) for i in range(n)]


async def paced(agg, cluster, its, rate: float) -> list[float]:
    channel = StatsChannel(agg)
    await channel.register(cluster.layouts)
    handed: dict[int, float] = {}
    lags: list[float] = []
    done = asyncio.Event()

    async def reader():
        since = -1
        while not done.is_set() or since < its[-1].iteration:
            for rec in await agg.wait_records.remote(since, 1.0):
                lags.append(time.perf_counter() - handed[rec["iter"]])
                since = rec["iter"]

    task = asyncio.ensure_future(reader())
    t0 = time.perf_counter()
    for k, it in enumerate(its):
        await asyncio.sleep(max(0.0, t0 + k / rate - time.perf_counter()))
        handed[it.iteration] = time.perf_counter()
        channel.put(dataclasses.replace(it, timestamp=time.time()))
    await channel.drained()
    done.set()
    await task
    await channel.close()
    return lags


async def flat_out(agg, cluster, its) -> float:
    channel = StatsChannel(agg)
    await channel.register(cluster.layouts)
    t0 = time.perf_counter()
    for it in its:
        channel.put(it)
        await asyncio.sleep(0)
    await channel.drained()
    await channel.close()
    return len(its) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"{'ranks':>5} {'paced it/s':>10} {'lag p50 ms':>10} {'lag p99 ms':>10} {'max it/s':>9} "
          f"{'us/rank':>8} {'ceiling it/s':>12} {'max/ceiling':>11}")
    for ranks in (8, 64, 256):
        agg = get_or_create_aggregator(f"bench-{ranks}", ranks, 2)
        cluster, its = build(ranks, int(20 * args.seconds))
        lags = asyncio.run(paced(agg, cluster, its, 20.0))
        cluster, its = build(ranks, 400)
        ray.kill(agg, no_restart=True)
        agg = get_or_create_aggregator(f"bench-max-{ranks}", ranks, 2)
        rate = asyncio.run(flat_out(agg, cluster, its))
        ceiling = asyncio.run(flat_out(NoOp.remote(), cluster, its))
        ray.kill(agg, no_restart=True)
        p50, p99 = np.percentile(np.array(lags) * 1e3, [50, 99])
        print(f"{ranks:>5} {len(lags) / args.seconds:>10.1f} {p50:>10.1f} {p99:>10.1f} {rate:>9.0f} "
              f"{1e6 / rate / ranks:>8.1f} {ceiling:>12.0f} {rate / ceiling:>11.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
