"""Placement across dp groups: the same multi-tenant workload under `kv`, `least_loaded` and `round_robin`.

    python bench/routing_bench.py [--requests 256] [--dps 2,4] [--blocks 320] [--zipf 1.0] [--device cpu|cuda]

16 tenants, each with its own 512-token system prompt, pick their requests Zipf-distributed; each request is its
tenant's system prompt + a unique 16-48-token question, 16 output tokens, 4-8 requests in flight (the limit
moves through 4..8 every 12 requests). `model=random`, no host tier, and a primary cache of `--blocks` blocks
per rank (320: one group holds about half the tenants' prompts). One run: every policy on the same seeded
workload, dp 2 and dp 4, one engine each. Prints the cluster hit rate, TTFT p50/p99, output tokens/s, requests
per group and predicted/realized reused blocks, and kv's ratios to least_loaded (targets: hit rate >= 1.5x,
TTFT p50 <= 0.7x, tokens/s >= 1.0x, predicted within 5% of realized). No assertions on time.
"""

import argparse
import asyncio
import os
import random
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from deployment.settings import Settings  # noqa: E402
from engine.core import Engine  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402

TENANTS = 16
SYSTEM_TOKENS = 512
OUTPUT_TOKENS = 16
KV_BYTES_PER_TOKEN = 2048  # the built-in model: 4 layers x 2 KV heads x 32 dims x K+V x fp32


def workload(n: int, zipf: float, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(tenant, prompt) of every request, the same for every policy."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 250) for _ in range(SYSTEM_TOKENS)] for _ in range(TENANTS)]
    weights = [1 / (k + 1) ** zipf for k in range(TENANTS)]
    out = []
    for _ in range(n):
        t = rng.choices(range(TENANTS), weights)[0]
        out.append((t, systems[t] + [rng.randrange(1, 250) for _ in range(rng.randint(16, 48))]))
    return out


async def run_policy(settings: Settings, requests: list[tuple[int, list[int]]]) -> dict:
    eng = Engine(settings.engine_config())
    await eng.start()
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    tokens = 0
    inflight = [0]  # requests running now
    changed = asyncio.Condition()

    async def one(i: int, tenant: int, prompt: list[int]) -> None:
        nonlocal tokens
        try:
            t0 = time.perf_counter()
            first = True
            async for _ in eng.generate(f"r{i}", prompt, params, f"tenant-{tenant}"):
                if first:
                    ttft.append(time.perf_counter() - t0)
                    first = False
                tokens += 1
        finally:
            async with changed:
                inflight[0] -= 1
                changed.notify_all()

    try:
        t0 = time.perf_counter()
        tasks = []
        for i, (tenant, prompt) in enumerate(requests):
            limit = 4 + (i // 12) % 5
            async with changed:
                await changed.wait_for(lambda limit=limit: inflight[0] < limit)
                inflight[0] += 1
            tasks.append(asyncio.ensure_future(one(i, tenant, prompt)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        await asyncio.wait_for(eng.stats.drained(), 30)
        records = await eng.aggregator.query.remote(-1, None, False)
    finally:
        await eng.shutdown()
    routing = [r["routing"] for r in records if r.get("routing")]
    per_group = [sum(r["perGroupRequests"][dp] for r in routing) for dp in range(settings.dp)]
    stats = records[-1]["kvCacheStats"]
    return {"hit": stats["cacheHitRate"], "p50": statistics.median(ttft) * 1000,
            "p99": statistics.quantiles(ttft, n=100)[98] * 1000, "tps": tokens / wall, "groups": per_group,
            "predicted": sum(r["predictedReusedBlocks"] for r in routing),
            "realized": sum(r["realizedReusedBlocks"] for r in routing),
            "resyncs": sum(r["indexResyncs"] for r in routing)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--dps", default="2,4")
    ap.add_argument("--blocks", type=int, default=320, help="primary blocks per rank")
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    requests = workload(args.requests, args.zipf)
    print(f"{args.requests} requests, {TENANTS} tenants x {SYSTEM_TOKENS}-token system prompts (Zipf {args.zipf}), "
          f"{args.blocks} primary blocks per rank, no host tier, {args.device}")
    for dp in (int(x) for x in args.dps.split(",")):
        results = {}
        for policy in ("kv", "least_loaded", "round_robin"):
            s = Settings(model="random", dp=dp, tp=1, device=args.device, max_seq_len=1024, routing=policy,
                         kv_cache_bytes=args.blocks * 16 * KV_BYTES_PER_TOKEN, host_cache_bytes=0,
                         engine_id=f"routing-bench-{dp}-{policy}-{os.getpid()}", num_cpus_per_rank=0.5)
            results[policy] = await run_policy(s, requests)
        print(f"dp {dp}:")
        print(f"  {'policy':<13} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'out tok/s':>9}  "
              f"{'predicted/realized':>18}  requests per group")
        for policy, r in results.items():
            pr = f"{r['predicted']}/{r['realized']}"
            print(f"  {policy:<13} {r['hit']:8.3f} {r['p50']:7.0f}ms {r['p99']:7.0f}ms {r['tps']:9.1f}  {pr:>18}  "
                  f"{r['groups']}")
        kv, base = results["kv"], results["least_loaded"]
        gap = abs(kv["predicted"] - kv["realized"]) / max(1, kv["realized"])
        print(f"  kv / least_loaded: hit rate {kv['hit'] / max(base['hit'], 1e-9):.2f}x (target >= 1.5), "
              f"TTFT p50 {kv['p50'] / base['p50']:.2f}x (<= 0.7), tokens/s {kv['tps'] / base['tps']:.2f}x (>= 1.0); "
              f"kv predicted vs realized {gap:.1%} apart (<= 5%), index resyncs {kv['resyncs']}")


if __name__ == "__main__":
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    asyncio.run(main())
