"""Traffic for newcomers: a shared-prefix workload against a running app, then what the KV cache did.

    python -m deployment.clients.loadgen --url http://127.0.0.1:8000 --requests 64
    python -m deployment.clients.loadgen --trace ../shared/traces/mooncake_conversation_trace.jsonl \
        --limit 1000 --scale 0.125 --speed 4 --out results.json

`--trace` replays a Mooncake-format trace instead (deployment/clients/trace.py): its requests in order at the
trace's times / `--speed`, or `--concurrency` at a time; it prints TTFT, inter-token and end-to-end latency
(p50/p90/p99), output tokens/s, the hit rate over the run and the routers' predicted vs realized reuse, and
with `--out` writes every request's result (JSON) and a plot over time (HTML) next to it.

Requests share a few long "system prompt" prefixes and differ in a short suffix, the pattern that makes
prefix reuse pay off; with the demo-sized cache, enough distinct prefixes also force eviction and offload
to the host tier. At the end it prints the cluster hit rate over the run and the blocks reused and
offloaded, read back from /kv_cache_stats and /stats.
"""

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from deployment.clients.client import StatsClient
from deployment.clients.trace import read_trace, replay, summary, write_results

WORDS = ("cache block rank tensor prefix token window stream layer head shard query value key pool tier "
         "evict reuse offload decode batch").split()


@dataclass
class LoadResult:
    requests: int
    failures: int
    completion_tokens: int
    seconds: float
    hit_rate: float
    reused_blocks: int
    missed_blocks: int
    offloaded_blocks: int
    records: int


def make_prompts(n: int, prefixes: int, prefix_words: int, seed: int) -> list[str]:
    """`n` prompts over `prefixes` shared prefixes of `prefix_words` words, each with a unique suffix."""
    rng = random.Random(seed)
    heads = [" ".join(rng.choice(WORDS) for _ in range(prefix_words)) for _ in range(prefixes)]
    return [f"{heads[i % prefixes]} | question {i}: {rng.choice(WORDS)} {rng.choice(WORDS)}?"
            for i in range(n)]


async def _send_all(url: str, model: str | None, prompts: list[str], concurrency: int, max_tokens: int,
                    progress: bool) -> tuple[int, int]:
    sem = asyncio.Semaphore(concurrency)
    failures = tokens = 0
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=not progress)
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as http:
        async def one(prompt: str) -> None:
            nonlocal failures, tokens
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
            if model:
                body["model"] = model
            async with sem:
                try:
                    resp = await http.post("/v1/completions", json=body)
                    if resp.status_code == 200:
                        tokens += resp.json()["usage"]["completion_tokens"]
                    else:
                        failures += 1
                        bar.write(f"request failed: {resp.status_code} {resp.text[:200]}")
                except httpx.HTTPError as exc:
                    failures += 1
                    bar.write(f"request failed: {type(exc).__name__}: {exc}")
            bar.update(1)

        await asyncio.gather(*(one(p) for p in prompts))
    bar.close()
    return failures, tokens


def run_load(url: str, requests: int = 64, concurrency: int = 8, prefixes: int = 4, prefix_words: int = 60,
             max_tokens: int = 8, seed: int = 0, model: str | None = None, progress: bool = True,
             settle_s: float = 10.0) -> LoadResult:
    """Send the workload, wait for the stats of the run to be emitted, and summarise them."""
    with StatsClient(url) as stats:
        before, start_iter = stats.kv_cache_stats(), stats.latest_iter()
        t0 = time.perf_counter()
        prompts = make_prompts(requests, prefixes, prefix_words, seed)
        failures, tokens = asyncio.run(_send_all(url, model, prompts, concurrency, max_tokens, progress))
        seconds = time.perf_counter() - t0
        after = _settled_kv_stats(stats, settle_s)
        records = stats.get_all_stats(since=start_iter)
    reused = after["reusedBlocks"] - before["reusedBlocks"]
    missed = after["missedBlocks"] - before["missedBlocks"]
    offloaded = sum(bucket.get("iterOffloadBlocks", 0) for r in records
                    for bucket in r.get("kvCacheIterationStats", {}).values())
    hit = reused / (reused + missed) if reused and reused + missed else 0.0
    return LoadResult(requests, failures, tokens, seconds, hit, reused, missed, offloaded, len(records))


def _settled_kv_stats(stats: StatsClient, settle_s: float) -> dict:
    """The cumulative stats once they stop changing (the last iterations' records arrive asynchronously)."""
    deadline = time.monotonic() + settle_s
    prev = stats.kv_cache_stats()
    while time.monotonic() < deadline:
        time.sleep(0.5)  # poll interval while the aggregator catches up
        cur = stats.kv_cache_stats()
        if cur == prev:
            return cur
        prev = cur
    return prev


def run_trace(a: argparse.Namespace) -> int:
    """Replay `a.trace` and print what each request saw and what the caches did."""
    requests = read_trace(a.trace, a.limit, a.scale)
    with StatsClient(a.url) as stats:
        before = stats.reuse_counts()
        _, (pred0, real0) = stats.routing_summary()
        result = asyncio.run(replay(a.url, requests, speed=a.speed, concurrency=a.concurrency, model=a.model,
                                    progress=not a.no_progress))
        after = _settled_kv_stats(stats, 10.0)
        _, (pred1, real1) = stats.routing_summary()
    s = summary(result)
    reused = after.get("fleet", after)["reusedBlocks"] - before[0]
    missed = after.get("fleet", after)["missedBlocks"] - before[1]
    print(f"{s['requests']} requests ({s['failed']} failed), {s['output_tokens']} output tokens in "
          f"{s['seconds']:.1f}s: {s['output_tok_s']:.1f} tokens/s")
    print(f"{'':<12}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "itl", "e2e"):
        print(f"{name.upper() + ' ms':<12}" + "".join(f"{s[f'{name}_p{q}_s'] * 1e3:>10.1f}" for q in (50, 90, 99)))
    print(f"hit rate over the run: {reused / (reused + missed) if reused + missed else 0.0:.1%} (blocks reused "
          f"{reused}, missed {missed}); routed reuse predicted {pred1 - pred0}, realized {real1 - real0} blocks")
    failed = [r.error for r in result.results if r.error]
    if failed:
        print(f"first failure: {failed[0]}")
    if a.out:
        write_results(a.out, {"trace": a.trace, "limit": a.limit, "scale": a.scale, "speed": a.speed,
                              "concurrency": a.concurrency}, result)
        print(f"results in {a.out}, a plot in {a.out.rsplit('.', 1)[0]}.html")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvfleet-loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of a running kvfleet app")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (default 8; with --trace: "
                   "closed loop at this many instead of the trace's times)")
    p.add_argument("--prefixes", type=int, default=4, help="distinct shared prefixes")
    p.add_argument("--prefix-words", type=int, default=60, help="words per shared prefix")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--trace", help="replay this Mooncake-format trace (JSONL) instead")
    p.add_argument("--limit", type=int, default=None, help="--trace: its first N requests")
    p.add_argument("--scale", type=float, default=1.0, help="--trace: every length times this (0 < scale <= 1)")
    p.add_argument("--speed", type=float, default=1.0, help="--trace: arrivals at this many times the trace's pace")
    p.add_argument("--out", help="--trace: write every request's result here (JSON) and a plot next to it (HTML)")
    a = p.parse_args(argv)
    if a.trace:
        if a.speed <= 0 or (a.concurrency is not None and a.concurrency < 1) or not 0 < a.scale <= 1:
            p.error("--speed must be > 0, --concurrency >= 1 and --scale in (0, 1]")
        try:
            return run_trace(a)
        except (OSError, ValueError) as exc:
            print(f"cannot replay {a.trace}: {exc}", file=sys.stderr)
            return 2
        except httpx.HTTPError as exc:
            print(f"cannot reach {a.url}: {exc} (is the app running? `serve run deployment:app`)", file=sys.stderr)
            return 2
    a.concurrency = a.concurrency or 8
    if min(a.requests, a.concurrency, a.prefixes, a.prefix_words, a.max_tokens) < 1:
        p.error("--requests, --concurrency, --prefixes, --prefix-words and --max-tokens must be >= 1")
    try:
        r = run_load(a.url, a.requests, a.concurrency, a.prefixes, a.prefix_words, a.max_tokens, a.seed,
                     a.model, progress=not a.no_progress)
    except httpx.HTTPError as exc:
        print(f"cannot reach {a.url}: {exc} (is the app running? `serve run deployment:app`)",
              file=sys.stderr)
        return 2
    print(f"{r.requests} requests ({r.failures} failed), {r.completion_tokens} tokens in {r.seconds:.1f}s")
    print(f"cluster hit rate over the run: {r.hit_rate:.1%} "
          f"(blocks reused {r.reused_blocks}, missed {r.missed_blocks})")
    print(f"blocks offloaded to the host tier: {r.offloaded_blocks} (over {r.records} iteration records)")
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main())
