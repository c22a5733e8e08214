"""Chaos benchmark (issue 15): traffic while rank actors die, and the aggregator once.

    python bench/chaos_bench.py [--duration 120] [--kill-every 20] [--model smollm2-135m-instruct]

Starts the app on a local Ray cluster with the CPU defaults (dp 2), sends shared-prefix completions from
`--clients` concurrent clients for `--duration` seconds, kills a random rank actor every `--kill-every`
seconds (one at a time: the next kill waits until every group is back) and the stats aggregator once, half
way. A follower reads every record as it is emitted. Prints requests completed / failed (and failed while no
dp group was up), the recovery time per rank kill (kill -> every group in service, p50 and max), the
incomplete records, and the conservation check: the sum of every emitted iteration counter equals the
change of the cumulative counter over the run. Targets: 100% complete while a group is up; back within 20 s
on CPU; 0 counts lost or doubled.
"""

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import ray  # noqa: E402

from deployment.loadgen import make_prompts  # noqa: E402

COUNTERS = {"iterAllocTotalBlocks": "allocTotalBlocks", "iterAllocNewBlocks": "allocNewBlocks",
            "iterReusedBlocks": "reusedBlocks", "iterMissedBlocks": "missedBlocks"}


async def traffic(url: str, stop: asyncio.Event, clients: int, max_tokens: int, down: list) -> dict:
    prompts = make_prompts(400, prefixes=6, prefix_words=40, seed=0)
    out = {"ok": 0, "failed": 0, "failed_all_down": 0, "errors": {}}

    async def client(c: int) -> None:
        rng = random.Random(c)
        async with httpx.AsyncClient(base_url=url, timeout=180) as http:
            while not stop.is_set():
                body = {"prompt": rng.choice(prompts), "max_tokens": max_tokens, "temperature": 0.0}
                try:
                    r = await http.post("/v1/completions", json=body)
                    code = r.status_code
                except httpx.HTTPError as e:
                    code = type(e).__name__
                if code == 200:
                    out["ok"] += 1
                else:
                    out["failed"] += 1
                    out["failed_all_down"] += bool(down[0])
                    out["errors"][str(code)] = out["errors"].get(str(code), 0) + 1

    await asyncio.gather(*[client(c) for c in range(clients)])
    return out


async def follow(url: str, stop: asyncio.Event, records: list) -> None:
    """Every record once, as it is emitted (the aggregator's buffer does not survive its restart)."""
    since = -1
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while True:
            try:
                got = (await http.get("/stats", params={"since": since})).json()
            except (httpx.HTTPError, ValueError):
                got = []
            records.extend(got)
            if got:
                since = got[-1]["iter"]
            elif stop.is_set():
                return
            await asyncio.sleep(0.25)  # poll interval


async def health(http: httpx.AsyncClient) -> dict:
    try:
        r = await http.get("/health")
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


async def chaos(url: str, engine_id: str, stop: asyncio.Event, every_s: float, duration_s: float,
                recoveries: list, down: list) -> None:
    rng = random.Random(7)
    t_start = time.monotonic()
    killed_aggregator = False
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while time.monotonic() - t_start + every_s < duration_s:
            await asyncio.sleep(every_s)  # the kill schedule
            if not killed_aggregator and time.monotonic() - t_start > duration_s / 2:
                ray.kill(ray.get_actor(f"kvfleet-stats-{engine_id}", namespace="kvfleet"), no_restart=False)
                killed_aggregator = True
                print(f"{time.monotonic() - t_start:6.1f} s  aggregator killed", flush=True)
            victims = [a for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith(f"kvfleet-rank-{engine_id}-")]
            victim = rng.choice(victims)
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
            t_kill = time.monotonic()
            print(f"{t_kill - t_start:6.1f} s  killed {victim['name']}", flush=True)
            while True:
                h = await health(http)
                groups = h.get("engine", {}).get("groups", {})
                down[0] = not any(g["up"] for g in groups.values()) if groups else True
                if groups and all(g["up"] for g in groups.values()) and time.monotonic() - t_kill > 0.5:
                    break
                await asyncio.sleep(0.2)  # poll interval
            recoveries.append(time.monotonic() - t_kill)
            print(f"{time.monotonic() - t_start:6.1f} s  back in service after {recoveries[-1]:.1f} s", flush=True)
    stop.set()


async def main_async(url: str, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        start_cum = (await http.get("/kv_cache_stats")).json()
        since = -1
        while True:  # the newest record: /stats pages, oldest first
            page = (await http.get("/stats", params={"since": since, "limit": 1000})).json()
            if not page:
                break
            since = page[-1]["iter"]
    stop, records, recoveries, down = asyncio.Event(), [], [], [False]
    follower = asyncio.ensure_future(follow(url, stop, records))
    t0 = time.monotonic()
    load, _ = await asyncio.gather(traffic(url, stop, args.clients, args.max_tokens, down),
                                   chaos(url, args.engine_id, stop, args.kill_every, args.duration, recoveries,
                                         down))
    took = time.monotonic() - t0
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        await asyncio.sleep(3.0)  # let the last iterations reach the aggregator and the follower
        end_cum = (await http.get("/kv_cache_stats")).json()
    await follower
    mine = [r for r in records if r["iter"] > since]
    iters = [r["iter"] for r in mine]
    summed = dict.fromkeys(COUNTERS.values(), 0)
    for r in mine:
        for bucket in r["kvCacheIterationStats"].values():
            for it, cum in COUNTERS.items():
                summed[cum] += bucket.get(it, 0)
    changed = {k: end_cum[k] - start_cum.get(k, 0) for k in summed}
    total = load["ok"] + load["failed"]
    print(f"\n{took:.0f} s of traffic, {args.clients} clients, load average {os.getloadavg()[0]:.1f}")
    print(f"requests: {load['ok']} completed, {load['failed']} failed ({load['failed_all_down']} while no dp "
          f"group was up) of {total}; errors {load['errors']}")
    if recoveries:
        print(f"rank kills: {len(recoveries)}; recovery p50 {statistics.median(recoveries):.1f} s, "
              f"max {max(recoveries):.1f} s (target <= 20 s)")
    print(f"records: {len(mine)} ({len(set(iters))} distinct iterations, in order: {iters == sorted(set(iters))}); "
          f"incomplete {sum(not r['complete'] for r in mine)}; epochs {sorted({r['aggregatorEpoch'] for r in mine})}")
    lost = {k: changed[k] - summed[k] for k in summed}
    print(f"conservation: summed iteration counters {summed}\n              cumulative change        {changed}\n"
          f"              lost (+) or doubled (-)   {lost} -> {'OK' if not any(lost.values()) else 'MISMATCH'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--kill-every", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--engine-id", default="chaos")
    args = ap.parse_args()
    from ray import serve

    from deployment import build_app

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8431})
    serve.run(build_app({"model": args.model, "engine_id": args.engine_id, "restart_backoff_s": 0.5}),
              name="chaos", route_prefix="/")
    url = "http://127.0.0.1:8431"
    deadline = time.monotonic() + 600
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the app never became healthy"
        time.sleep(0.5)  # poll interval
    try:
        asyncio.run(main_async(url, args))
    finally:
        t0 = time.monotonic()
        serve.delete("chaos")
        ranks_left = [a for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith(f"kvfleet-rank-{args.engine_id}-")]
        pgs_left = [p for p in ray.util.placement_group_table().values()
                    if (p.get("name") or "").startswith(f"kvfleet-{args.engine_id}-") and p["state"] != "REMOVED"]
        print(f"graceful shutdown (serve.delete): {time.monotonic() - t0:.1f} s; rank actors left "
              f"{len(ranks_left)}, placement groups left {len(pgs_left)}")
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
