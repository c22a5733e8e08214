"""Aggregator benchmark: merge cost per rank (pure), ingest throughput and emission lag through the real
StatsAggregator actor, for 8, 64 and 256 simulated ranks.

Targets (issue 5): >= 20,000 rank messages/s into one actor (batched), p99 emission lag < 50 ms at
64 ranks x 20 iterations/s, merge cost linear in ranks. The 8-rank rows are also the per-node stage of a
tree of aggregators (one per 8-GPU node): see aggregator/__init__.py.

Run: python bench/aggregator_bench.py [--quick]   (about a minute; starts its own local Ray)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
import uuid

from aggregator.merge import (
    BYTE_FIELDS,
    GAUGE_FIELDS,
    LIFECYCLE_VIEW,
    PEAK_FIELDS,
    POOL_VIEW,
    VIEW_COUNTERS,
    WINDOW_VIEW,
    merge_iteration,
)

ENGINE = "bench"


def report(rng: random.Random) -> dict:
    """A two-window, two-pool-group, two-life-cycle rank report (a Gemma-like SWA + full model)."""
    def bucket(view, extra):
        b = {f: rng.randint(0, 8) * (4096 if f in BYTE_FIELDS else 1) for f in VIEW_COUNTERS[view]}
        if view != LIFECYCLE_VIEW:
            b.update({f: rng.randint(0, 512) for f in GAUGE_FIELDS + PEAK_FIELDS})
        b.update(extra)
        return b

    return {
        WINDOW_VIEW: {w: bucket(WINDOW_VIEW, {"iterCacheHitRate": 0.5}) for w in ("512", "8192")},
        POOL_VIEW: {p: bucket(POOL_VIEW, {"poolGroupId": int(p), "slotSize": 65536, "windowSizes": [w]})
                    for p, w in (("0", 512), ("1", 8192))},
        LIFECYCLE_VIEW: {c: bucket(LIFECYCLE_VIEW, {"lifeCycleId": int(c), "poolGroupId": int(c),
                                                    "windowSize": w, "kind": "attention", "iterCacheHitRate": 0.5})
                         for c, w in (("0", 512), ("1", 8192))},
    }


def make_messages(n_ranks: int, n_iters: int, tp: int = 1, seed: int = 0, start_iter: int = 0) -> list[list[dict]]:
    """messages[i] = the n_ranks messages of iteration start_iter + i."""
    rng = random.Random(seed)
    incs = [uuid.uuid4().hex for _ in range(n_ranks)]
    reports = [report(rng) for _ in range(16)]  # reuse a few report bodies: generation is not measured
    stats = {"maxNumBlocks": 1024, "freeNumBlocks": 512, "usedNumBlocks": 512, "tokensPerBlock": 32,
             "allocTotalBlocks": 0, "allocNewBlocks": 0, "reusedBlocks": 0, "missedBlocks": 0, "cacheHitRate": 0.0}
    out = []
    for i in range(n_iters):
        it = start_iter + i
        out.append([{"engine_id": ENGINE, "rank": r, "dp_rank": r // tp, "tp_rank": r % tp, "incarnation": incs[r],
                     "iteration": it, "seq": it, "timestamp": time.time(), "report": reports[(r + it) % 16],
                     "kv_cache_stats": {**stats, "allocTotalBlocks": it * 8, "allocNewBlocks": it * 8}}
                    for r in range(n_ranks)])
    return out


def bench_merge(sizes) -> dict[int, float]:
    """Pure merge_iteration cost (no Ray), microseconds per iteration."""
    out = {}
    for n in sizes:
        msgs = make_messages(n, 1, tp=2)[0]
        reps = max(5, 4000 // n)
        t0 = time.perf_counter()
        for _ in range(reps):
            merge_iteration(msgs)
        out[n] = (time.perf_counter() - t0) / reps * 1e6
    return out


async def bench_throughput(ray, n: int, seconds: float, batch: int, inflight: int = 4) -> float:
    from aggregator import get_or_create_aggregator

    eng_iters = max(4, int(seconds * 24_000 / n))
    its = make_messages(n, eng_iters)
    flat = [m for it in its for m in it]
    agg = get_or_create_aggregator(ENGINE, n, 1, stats_timeout_s=2.0, name=f"bench-tp-{n}")
    await agg.health.remote()
    batches = [flat[i:i + batch] for i in range(0, len(flat), batch)]
    refs = [ray.put(b) for b in batches[:1]]  # warm the path
    await agg.ingest.remote(refs[0])
    t0 = time.perf_counter()
    pending: set = set()
    for b in batches[1:]:
        pending.add(asyncio.ensure_future(agg.ingest.remote(b)))
        if len(pending) >= inflight:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*pending)
    dt = time.perf_counter() - t0
    h = await agg.health.remote()
    assert h["counts"]["messages"] == len(flat), h["counts"]
    assert h["last_iter"] == eng_iters - 1 and h["counts"]["incomplete"] == 0, h
    ray.kill(agg)
    return (len(flat) - len(batches[0])) / dt


async def bench_lag(ray, n: int, rate_hz: float, seconds: float, ranks_per_call: int) -> list[float]:
    """Paced iterations; ranks send in groups of `ranks_per_call` (a node's ranks share one call).
    Lag = subscriber receives record i - the last message of iteration i was sent."""
    from aggregator import get_or_create_aggregator

    n_iters = int(rate_hz * seconds)
    its = make_messages(n, n_iters)
    agg = get_or_create_aggregator(ENGINE, n, 1, stats_timeout_s=2.0, name=f"bench-lag-{n}")
    await agg.health.remote()
    sent_at: dict[int, float] = {}
    got_at: dict[int, float] = {}

    async def subscriber():
        since = -1
        while since < n_iters - 1:
            recs = await agg.wait_records.remote(since, 5.0)
            now = time.perf_counter()
            for r in recs:
                got_at[r["iter"]] = now
                since = r["iter"]

    sub = asyncio.ensure_future(subscriber())
    t0 = time.perf_counter()
    for i, msgs in enumerate(its):
        due = t0 + i / rate_hz
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        calls = [agg.ingest.remote(msgs[k:k + ranks_per_call]) for k in range(0, n, ranks_per_call)]
        sent_at[i] = time.perf_counter()
        await asyncio.gather(*calls)
    await asyncio.wait_for(sub, 30)
    ray.kill(agg)
    return [(got_at[i] - sent_at[i]) * 1e3 for i in range(n_iters)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main_async(args) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sizes = (8, 64, 256)
    merge = bench_merge(sizes)
    print("merge_iteration (pure, no Ray)")
    print(f"{'ranks':>6} {'us/iteration':>13} {'us/rank':>8} {'per-rank cost vs 8':>19}")
    for n in sizes:
        print(f"{n:>6} {merge[n]:>13.0f} {merge[n] / n:>8.1f} {merge[n] / n / (merge[8] / 8):>19.2f}")

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=200 * 1024 * 1024)
    secs = 1.0 if args.quick else 1.5
    tput = {n: await bench_throughput(ray, n, secs, batch=max(n, 64)) for n in sizes}
    lag = {}
    for n in sizes:
        lag[n] = await bench_lag(ray, n, 20.0, 2.0 if args.quick else 3.0, ranks_per_call=8)
    ray.shutdown()

    print("\nStatsAggregator actor (one actor; batches of max(ranks, 64) messages, 4 calls in flight)")
    print(f"{'ranks':>6} {'msgs/s':>9} {'vs 8':>6} {'lag p50 ms':>11} {'lag p99 ms':>11} {'lag max ms':>11}"
          "   (20 it/s, one call per 8 ranks)")
    for n in sizes:
        print(f"{n:>6} {tput[n]:>9.0f} {tput[n] / tput[8]:>6.2f} {pct(lag[n], .5):>11.1f} {pct(lag[n], .99):>11.1f}"
              f" {max(lag[n]):>11.1f}")
    print(f"\ntargets: >= 20000 msgs/s: {'met' if max(tput.values()) >= 20_000 else 'NOT met'} "
          f"(best {max(tput.values()):.0f}); p99 lag < 50 ms at 64 ranks: "
          f"{'met' if pct(lag[64], .99) < 50 else 'NOT met'} ({pct(lag[64], .99):.1f} ms); "
          f"merge per-rank cost 256 vs 8: {merge[256] / 256 / (merge[8] / 8):.2f}x (1.0 = linear)")
    print(f"tree, per-node stage (8 ranks/node): {tput[8]:.0f} msgs/s = {tput[8] / 8:.0f} node-iterations/s; "
          f"a top aggregator over M nodes costs about what {sizes[0]}..M ranks cost above "
          f"(mean lag {statistics.mean(lag[8]):.1f} ms per stage)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter runs")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
