"""Routing across engine replicas: the same multi-tenant workload on fresh apps, one per routing setup.

    python bench/fleet_bench.py [--requests 96] [--tenants 8] [--blocks 48] [--replicas 2] [--salted]
                                [--restart]

A workload modelled on llm-d's precise-scheduling benchmark: tenants with long system prompts (Zipf over the
tenants), each request its tenant's system prompt + a short unique question, a `cache_salt` per tenant, the
tenants' prompts together more than one replica's primary cache (`--blocks` blocks per rank, random model, no
host tier), so placement decides what is evicted. `--salted`: the tenants share one product's system prompt
but salt their caches (the same text, blocks that cannot be shared: a router that sees text sends them all to
one replica). `--restart`: one engine replica is killed half way through (Serve replaces it, its cache
empty; the ingress re-sends its requests). Setups, each on a fresh app over HTTP with the same seeded
requests, 4 in flight: `kv` (exact, this project's router), `prefix_affinity` (Ray Serve LLM's router) and
`pow2` with `--replicas` engine replicas of dp 1, and one engine of dp `--replicas` (`routing=kv` across its
groups: what two levels of routing must not lose to). Prints the fleet hit rate over the run, TTFT p50/p99,
output tokens/s, requests per engine, predicted vs realized reuse, then `kv`'s ratios to the others. No
assertions on time.
"""

import argparse
import asyncio
import os
import random
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx  # noqa: E402
import ray  # noqa: E402

from deployment import build_app  # noqa: E402
from deployment.clients.client import StatsClient  # noqa: E402
from kvcache.stats import hit_rate  # noqa: E402

PORT = 8391
SYSTEM_TOKENS = 256
OUTPUT_TOKENS = 8
KV_BYTES_PER_TOKEN = 2048  # the built-in model: 4 layers x 2 KV heads x 32 dims x K+V x fp32


def setups(replicas: int) -> dict[str, dict[str, str]]:
    fleet = {"engine_replicas": str(replicas), "dp": "1"}
    return {"kv": {**fleet, "fleet_routing": "kv"},
            "prefix_affinity": {**fleet, "fleet_routing": "prefix_affinity"},
            "pow2": {**fleet, "fleet_routing": "pow2"},
            f"one engine, dp {replicas}": {"engine_replicas": "1", "dp": str(replicas), "routing": "kv"}}


def workload(n: int, tenants: int, salted: bool, seed: int = 0) -> list[tuple[int, str]]:
    """(tenant, prompt text) of every request, the same for every setup (bytes 32..126: one token each)."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        return "".join(chr(rng.randrange(32, 127)) for _ in range(k))

    product = text(SYSTEM_TOKENS)
    systems = [product if salted else text(SYSTEM_TOKENS) for _ in range(tenants)]
    weights = [1 / (k + 1) for k in range(tenants)]
    return [(t, systems[t] + text(rng.randint(16, 32)))
            for t in (rng.choices(range(tenants), weights)[0] for _ in range(n))]


async def one(http: httpx.AsyncClient, tenant: int, prompt: str) -> tuple[float, int]:
    """(time to the first streamed token, tokens) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "cache_salt": f"tenant-{tenant}"}
    t0, first, n = time.perf_counter(), None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                first = first or time.perf_counter() - t0
                n += 1
    return first or 0.0, n


def kill_one_engine_replica(app: str) -> None:
    """Kill an engine replica's actor (Serve starts another: its cache empty, the same engine id)."""
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{app}#KVFleetEngine"))
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)


async def run_setup(n: int, name: str, extra: dict, requests: list[tuple[int, str]], blocks: int,
                    restart: bool) -> dict:
    from ray import serve

    settings = {"model": "random", "engine_id": f"fleetbench{n}", "tp": "1", "num_cpus_per_rank": "0.5",
                "max_seq_len": "512", "host_cache_bytes": "0", "max_num_batched_tokens": "128",
                "kv_cache_bytes": str(blocks * 16 * KV_BYTES_PER_TOKEN), "placement_timeout_s": "120", **extra}
    serve.run(build_app(settings), name="fleetbench", route_prefix="/")
    url = f"http://127.0.0.1:{PORT}"
    with StatsClient(url) as stats:
        before = stats.reuse_counts()
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        sem, results = asyncio.Semaphore(4), []

        async def limited(i: int, t: int, p: str) -> None:
            async with sem:
                if restart and i == len(requests) // 2 and extra.get("engine_replicas") != "1":
                    kill_one_engine_replica("fleetbench")
                results.append(await one(http, t, p))

        t0 = time.perf_counter()
        await asyncio.gather(*(limited(i, t, p) for i, (t, p) in enumerate(requests)))
        wall = time.perf_counter() - t0
    with StatsClient(url) as stats:
        reused, missed = (a - b for a, b in zip(stats.reuse_counts(), before, strict=True))
        per_engine, reuse = stats.routing_summary()
    serve.delete("fleetbench")
    ttft = sorted(f for f, _ in results)
    return {"setup": name, "hit": hit_rate(reused, missed),
            "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "tok_s": sum(n for _, n in results) / wall, "per_engine": per_engine, "reuse": reuse}


async def main(args: argparse.Namespace) -> None:
    from ray import serve

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    requests = workload(args.requests, args.tenants, args.salted)
    chosen = {k: v for k, v in setups(args.replicas).items() if not args.setups or k.split(",")[0] in args.setups}
    common = dict(kv.split("=", 1) for kv in args.set or [])
    rows = [await run_setup(n, name, {**extra, **common}, requests, args.blocks, args.restart)
            for n, (name, extra) in enumerate(chosen.items())]
    print(f"{args.requests} requests, {args.tenants} tenants{' sharing one salted prompt' if args.salted else ''}, "
          f"{args.replicas} replicas, {args.blocks} primary blocks per rank"
          f"{', one replica restarted half way' if args.restart else ''}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'setup':<18} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>7} {'pred/real':>11}  "
          "requests per engine")
    for r in rows:
        print(f"{r['setup']:<18} {r['hit']:8.1%} {r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p99'] * 1e3:7.0f}ms "
              f"{r['tok_s']:7.1f} {r['reuse'][0]:>5}/{r['reuse'][1]:<5}  {list(r['per_engine'].values())}")
    by = {r["setup"].split(",")[0]: r for r in rows}
    if {"kv", "prefix_affinity", "pow2", "one engine"} <= by.keys():
        kv, one_engine = by["kv"], by["one engine"]
        print(f"kv hit rate: {kv['hit'] / by['prefix_affinity']['hit']:.2f}x prefix_affinity (target >= 1.3), "
              f"{kv['hit'] / by['pow2']['hit']:.2f}x pow2 (>= 1.5), {kv['hit'] / one_engine['hit']:.2f}x one "
              f"engine (>= 0.95); TTFT p50 {kv['ttft_p50'] / by['prefix_affinity']['ttft_p50']:.2f}x "
              "prefix_affinity (<= 0.8)")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=48, help="primary KV blocks per rank (16 tokens each)")
    ap.add_argument("--replicas", type=int, default=2, help="engine replicas (and the one engine's dp groups)")
    ap.add_argument("--salted", action="store_true", help="tenants share one system prompt, salted apart")
    ap.add_argument("--restart", action="store_true", help="kill one engine replica half way through")
    ap.add_argument("--setups", nargs="*", help="run only these (kv, prefix_affinity, pow2, 'one engine')")
    ap.add_argument("--set", nargs="*", help="settings for every setup, key=value (e.g. routing_load_weight=0.1)")
    asyncio.run(main(ap.parse_args()))
