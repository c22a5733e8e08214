"""Engine benchmarks on CPU: decode throughput with stats on vs off, and time to first token with prefix
reuse on vs off (issue 4). Each pair runs in this process, alternating A/B rounds to share the machine's noise.

    python bench/engine_bench.py [--rounds 4] [--device cpu|cuda]

Prints tokens/s per round and the median of the per-round stats off/on ratios (target: overhead <= 3%; the
median of paired rounds resists this machine's +-30% noise better than best-of), and median TTFT with the
reuse-on/off ratio (what the prefix cache saves). No assertions on time.
"""

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from deployment.settings import Settings  # noqa: E402
from engine.core import Engine  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402


async def decode_tokens_per_s(eng: Engine, n_requests: int, gen: int) -> float:
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> int:
        prompt = eng.tokenizer.encode(f"decode benchmark request {i}: ")
        return sum([1 async for _ in eng.generate(None, prompt, params)])

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*[one(i) for i in range(n_requests)]))
    return tokens / (time.perf_counter() - t0)


async def ttft_ms(eng: Engine, n_requests: int, prefix_tokens: int) -> float:
    prefix = [(7 * i) % 250 + 1 for i in range(prefix_tokens)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(n_requests):
        prompt = prefix + eng.tokenizer.encode(f" question {i}?")
        t0 = time.perf_counter()
        async for _ in eng.generate(None, prompt, params):
            times.append((time.perf_counter() - t0) * 1000)
            break
    return statistics.median(times[1:])  # the first request fills the cache in both modes


async def with_engine(settings: Settings, fn, *args) -> float:
    eng = Engine(settings.engine_config())
    await eng.start()
    try:
        return await fn(eng, *args)
    finally:
        await eng.shutdown()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--gen", type=int, default=48)
    args = ap.parse_args()
    base = dict(model="random", dp=1, tp=1, device=args.device, max_seq_len=1024,
                kv_cache_bytes=8 << 20 if args.device == "cpu" else 0,
                host_cache_bytes=0, num_cpus_per_rank=1, max_num_batched_tokens=512)
    tps = {True: [], False: []}
    ttft = {True: [], False: []}
    for r in range(args.rounds):
        for stats in (True, False) if r % 2 == 0 else (False, True):
            s = Settings(**base, engine_id=f"bench-stats-{stats}-{r}", enable_stats=stats)
            tps[stats].append(await with_engine(s, decode_tokens_per_s, args.requests, args.gen))
        for reuse in (True, False) if r % 2 == 0 else (False, True):
            s = Settings(**base, engine_id=f"bench-reuse-{reuse}-{r}", enable_block_reuse=reuse)
            ttft[reuse].append(await with_engine(s, ttft_ms, 9, 768))
    on, off = statistics.median(tps[True]), statistics.median(tps[False])
    paired = statistics.median(b / a for a, b in zip(tps[True], tps[False], strict=True))
    print(f"decode ({args.requests} concurrent x {args.gen} tokens, 1 rank on {args.device}):")
    rounds = zip(tps[True], tps[False], strict=True)
    print("  per round, stats on / off tok/s: " + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in rounds))
    print(f"  median: stats on {on:8.1f} tok/s, stats off {off:8.1f} tok/s; median of the per-round off/on ratios "
          f"{paired:.3f} (target <= 1.03)")
    ron, roff = statistics.median(ttft[True]), statistics.median(ttft[False])
    print("time to first token (768-token shared prefix + unique question, one at a time):")
    print(f"  reuse on  {ron:8.1f} ms      reuse off {roff:8.1f} ms      reuse saves {roff / ron:.1f}x")


if __name__ == "__main__":
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    asyncio.run(main())
