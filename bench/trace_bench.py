"""Routing judged by time to first token on a real trace: Mooncake's conversation trace replayed against simulated
GPU replicas (`model=simulated`) under each fleet router, and one engine of the same total dp.

    python bench/trace_bench.py [--trace ../shared/traces/mooncake_conversation_trace.jsonl] [--limit 400]
                                [--replicas 8] [--scale 0.125] [--speed 16] [--speedup 0.03]
                                [--concurrency N] [--setups kv prefix_affinity pow2 one oracle ceiling]
                                [--set key=value ...]
                                [--out DIR]

Each setup is a fresh app of `--replicas` engine replicas of dp 1 (or, `one`, a single engine of dp
`--replicas` placing with `routing=kv`), the default cost profile (an H100 serving Llama-3.1-8B) with its KV
cache scaled by `--scale` like the trace's lengths (so a request takes the same share of a replica's cache as
in the trace), no host tier. The first `--limit` requests of the trace, lengths times `--scale`
(deployment/clients/trace.py), arrive at the trace's times / `--speed` (profile time), or `--concurrency` at a
time (closed loop: the throughput at saturation); the simulated GPUs run at
`--speedup` of the profile's speed so the fleet's control plane fits on this machine, and every time is reported
in the profile's seconds (wall x speedup). The oracle (setup `oracle`) is the same replay through one engine of
dp 1 holding the whole fleet's KV cache, one request at a time in trace order (its GPU at `--oracle-speedup`):
every prompt's blocks are in one LRU cache of the fleet's size before the next prompt looks, which is what a
router that saw the fleet's caches as one would reach, counted by the same statistics as the fleet's hit rate
(reused / (reused + missed) blocks, partial reuse included); the ceiling (setup `ceiling`) is the same through
a cache that never evicts: what no router can pass. Prints per setup: TTFT p50/p90/p99, ITL p50,
end-to-end p50, output tokens/s, the fleet hit rate over the run, predicted/realized reuse of the routed requests
and the requests per engine; then `kv`'s ratios to `prefix_affinity` (targets: TTFT p50 <= 0.7x, p90 <= 0.5x, hit
rate >= 1.3x, tokens/s >= 1.1x) and each setup's hit rate against the oracle's (`kv`: within 10%). Writes each
setup's results (JSON) and plot (HTML) to `--out`. No assertions on time.
"""

import argparse
import asyncio
import os
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from deployment import build_app  # noqa: E402
from deployment.clients.client import StatsClient  # noqa: E402
from deployment.clients.trace import (  # noqa: E402
    MOONCAKE_BLOCK,
    TraceRequest,
    read_trace,
    replay,
    summary,
    write_results,
)
from kvcache.stats import hit_rate  # noqa: E402
from workers.cost_model import H100_LLAMA_8B  # noqa: E402
from workers.model_setting import simulated_config  # noqa: E402

PORT = 8392
TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
# the default profile's K and V a token, as a simulated rank sizes its cache (fp32 on CPU)
TOKEN_BYTES = simulated_config(H100_LLAMA_8B).kv_bytes_per_token(1, 4)
BLOCK = 16
ALONE = ("oracle", "ceiling")  # one engine, one request at a time: only their hit rates compare


def setups(args: argparse.Namespace, requests: list[TraceRequest]) -> dict[str, dict[str, str]]:
    fleet = {"engine_replicas": str(args.replicas), "dp": "1"}
    alone = {"engine_replicas": "1", "dp": "1", "simulated_speedup_ratio": str(args.oracle_speedup)}
    return {"kv": {**fleet, "fleet_routing": "kv"},
            "prefix_affinity": {**fleet, "fleet_routing": "prefix_affinity"},
            "pow2": {**fleet, "fleet_routing": "pow2"},
            "one": {"engine_replicas": "1", "dp": str(args.replicas), "routing": "kv"},
            "oracle": {**alone, "kv_cache_bytes": str(args.replicas * kv_bytes(args))},
            "ceiling": {**alone, "kv_cache_bytes": str(every_token(requests) * TOKEN_BYTES)}}


def every_token(requests: list[TraceRequest]) -> int:
    """A cache that never evicts in this replay: room for every prompt and output, a block each spare."""
    return sum(len(r.prompt) + r.max_tokens + BLOCK for r in requests)


def kv_bytes(args: argparse.Namespace) -> int:
    """One replica's KV cache: the profile's, times `--scale` like the lengths."""
    return int(H100_LLAMA_8B.kv_tokens * args.scale) * TOKEN_BYTES


async def run_setup(name: str, extra: dict, args: argparse.Namespace, requests) -> dict:
    from ray import serve

    settings = {"model": "simulated", "engine_id": f"trace-{name}", "tp": "1", "tokens_per_block": str(BLOCK),
                "max_seq_len": str(int(140_000 * args.scale) + 4096), "host_cache_bytes": "0",
                "kv_cache_bytes": str(kv_bytes(args)), "max_num_seqs": "256",
                "max_num_batched_tokens": "8192", "simulated_speedup_ratio": str(args.speedup),
                "num_cpus_per_rank": "0.01", "placement_timeout_s": "600", **extra}
    serve.run(build_app(settings), name="trace", route_prefix="/")
    url = f"http://127.0.0.1:{PORT}"
    with StatsClient(url) as stats:
        before = stats.reuse_counts()
    t0 = time.perf_counter()
    speedup = float(settings["simulated_speedup_ratio"])
    concurrency = 1 if name in ALONE else args.concurrency or None
    result = await replay(url, requests, speed=args.speed * speedup, concurrency=concurrency, progress=not args.quiet)
    with StatsClient(url) as stats:
        reused, missed = (a - b for a, b in zip(stats.reuse_counts(), before, strict=True))
        per_engine, reuse = stats.routing_summary()
    serve.delete("trace")
    for r in result.results:  # wall seconds -> the profile's
        r.at_s, r.ttft_s, r.itl_s, r.e2e_s = (v * speedup for v in (r.at_s, r.ttft_s, r.itl_s, r.e2e_s))
    result.seconds *= speedup
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_results(Path(args.out) / f"{name}.json", {"title": f"{name}: {len(requests)} requests of {args.trace}",
                      "setup": name, "settings": settings, "args": vars(args)}, result)
    return {"setup": name, **summary(result), "hit": hit_rate(reused, missed), "reuse": reuse,
            "per_engine": list(per_engine.values()), "wall_s": time.perf_counter() - t0}


async def main(args: argparse.Namespace) -> None:
    from ray import serve

    requests = read_trace(args.trace, args.limit, args.scale)
    ray.init(address="local", num_cpus=256, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    common = dict(kv.split("=", 1) for kv in args.set or [])
    rows = []
    for name, extra in setups(args, requests).items():
        if name in args.setups:
            rows.append(await run_setup(name, {**extra, **common}, args, requests))
    serve.shutdown()
    ray.shutdown()
    pace = f"{args.concurrency} in flight" if args.concurrency else f"arrivals at {args.speed}x the trace's pace"
    print(f"\n{len(requests)} requests of {Path(args.trace).name}, lengths x {args.scale} (a trace block "
          f"{round(MOONCAKE_BLOCK * args.scale)} tokens), {pace}, {args.replicas} simulated H100s at "
          f"{args.speedup}x; times in the profile's seconds")
    print(f"{'setup':<16}{'fail':>5}{'TTFT p50':>9}{'p90':>8}{'p99':>8}{'ITL p50':>9}{'E2E p50':>9}{'tok/s':>8}"
          f"{'hit':>7}{'pred/real':>13}  requests per engine")
    for r in rows:
        print(f"{r['setup']:<16}{r['failed']:>5}{r['ttft_p50_s'] * 1e3:>7.0f}ms{r['ttft_p90_s'] * 1e3:>6.0f}ms"
              f"{r['ttft_p99_s'] * 1e3:>6.0f}ms{r['itl_p50_s'] * 1e3:>7.1f}ms{r['e2e_p50_s']:>8.2f}s"
              f"{r['output_tok_s']:>8.0f}{r['hit']:>7.1%}{r['reuse'][0]:>7}/{r['reuse'][1]:<6} {r['per_engine']}")
    by = {r["setup"]: r for r in rows}
    if by.keys() & set(ALONE):
        print("(oracle: one request at a time through one cache of the fleet's size; ceiling: the same through a "
              "cache that never evicts; only their hit rates compare)")
    if {"kv", "prefix_affinity"} <= by.keys():
        kv, pa = by["kv"], by["prefix_affinity"]
        print(f"kv / prefix_affinity: TTFT p50 {kv['ttft_p50_s'] / pa['ttft_p50_s']:.2f}x (<= 0.7), p90 "
              f"{kv['ttft_p90_s'] / pa['ttft_p90_s']:.2f}x (<= 0.5), hit rate {kv['hit'] / max(pa['hit'], 1e-9):.2f}x "
              f"(>= 1.3), tokens/s {kv['output_tok_s'] / pa['output_tok_s']:.2f}x (>= 1.1)")
    if "oracle" in by:
        for name in ("kv", "prefix_affinity", "pow2", "one"):
            if name in by:
                print(f"{name}'s hit rate: {by[name]['hit'] / max(by['oracle']['hit'], 1e-9):.2f}x the oracle's"
                      + (" (>= 0.9)" if name == "kv" else ""))
    if {"ceiling", "prefix_affinity"} <= by.keys():
        print(f"the ceiling's hit rate is {by['ceiling']['hit'] / max(by['prefix_affinity']['hit'], 1e-9):.2f}x "
              "prefix_affinity's: no router reaches more")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--limit", type=int, default=400)  # bench/README.md's figures
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--scale", type=float, default=0.125, help="every length (and the KV cache) times this")
    ap.add_argument("--speed", type=float, default=16.0, help="arrivals at this many times the trace's pace")
    ap.add_argument("--speedup", type=float, default=0.03, help="the simulated GPUs' speed (of the profile's)")
    ap.add_argument("--concurrency", type=int, default=0, help="closed loop at this many in flight instead of the "
                    "trace's times: the fleet's throughput at saturation")
    ap.add_argument("--setups", nargs="*", default=["kv", "prefix_affinity", "pow2", "one", "oracle",
                                                          "ceiling"])
    ap.add_argument("--oracle-speedup", type=float, default=4.0, help="the oracle's GPU speed (of the profile's): "
                    "it serves one request at a time, so only its hit rate counts")
    ap.add_argument("--set", nargs="*", help="settings for every setup, key=value (e.g. routing_load_weight=0.1)")
    ap.add_argument("--out", help="a directory for each setup's results (JSON) and plot (HTML)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    asyncio.run(main(ap.parse_args()))
