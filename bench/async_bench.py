"""Async scheduling (issue 37): the engine with and without sending a decode step before the last one's result.

    python -m bench.async_bench [--seqs 1 16] [--rounds 2] [--tokens 64]

An engine in this process over Ray rank actors (the default model and settings, no Serve), each size served
with `async_scheduling` on and off, alternated within each round (a drifting machine favours neither), each
time by a new engine: `--seqs` concurrent greedy requests of 256 random prompt tokens and `--tokens` output
tokens (EOS ignored). Prints each run's TPOT p50 (a request's time between its first and last token, per
token) and output tokens/s, then the on/off ratios' medians over the rounds. No assertions.
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


async def serve(on: bool, seqs: int, tokens: int, seed: int) -> tuple[float, float]:
    """(TPOT p50 in ms, output tokens/s) of one engine serving `seqs` requests at once."""
    eng = Engine(Settings(engine_id=f"async-bench-{int(on)}-{seqs}-{seed}", async_scheduling=on).engine_config())
    await eng.start()
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40_000) for _ in range(256)] for _ in range(seqs)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> tuple[float, int]:
        times = [time.perf_counter() async for _ in eng.generate(None, prompt, params)]
        return (times[-1] - times[0]) / (len(times) - 1), len(times)

    try:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    finally:
        await eng.shutdown()
    return statistics.median(o[0] for o in outs) * 1000, sum(o[1] for o in outs) / wall


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    runs: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for seqs in args.seqs:
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                tpot, tps = await serve(on, seqs, args.tokens, r)
                runs.setdefault((seqs, on), []).append((tpot, tps))
                print(f"round {r + 1}, {seqs} sequences, async_scheduling={on}: TPOT p50 {tpot:.1f} ms, "
                      f"{tps:.1f} tok/s", flush=True)
    for seqs in args.seqs:
        on, off = runs[(seqs, True)], runs[(seqs, False)]
        tpot = statistics.median(a[0] / b[0] for a, b in zip(on, off, strict=True))
        tps = statistics.median(a[1] / b[1] for a, b in zip(on, off, strict=True))
        print(f"{seqs} sequences: on/off TPOT {tpot:.3f}x, tokens/s {tps:.3f}x (median of {args.rounds} rounds)")


if __name__ == "__main__":
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    asyncio.run(main())
