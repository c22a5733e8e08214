"""The sampler at a decode step's batch, against the one it replaced, on the same logits in the same process.

    python bench/sampler_bench.py            # 32 rows of SmolLM2's 49,152 logits, temperature 0.8

Every sampled request the engine serves is seeded (Engine.submit draws a seed), so each row has its own
generator, made per draw as the rank makes it. The baseline is the sampler before 2026-12-06, kept here: a sort
of every row and a torch.multinomial per seeded row. Prints ms per step and the ratios.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from workers.sampling import make_generator, sample  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402


def previous_sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """The sampler this one replaced (sampled rows only): sort, top-k/top-p masks, multinomial per seeded row."""
    vocab = logits.shape[1]
    x = logits / torch.tensor([p.temperature for p in params])[:, None]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    sorted_x, order = x.sort(dim=-1, descending=True)
    drop = torch.arange(vocab)[None, :] >= top_k[:, None]
    probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False
    probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
    picks = torch.stack([torch.multinomial(probs[j], 1, generator=g)[0] for j, g in enumerate(generators)])
    return order.gather(1, picks[:, None]).squeeze(1).tolist()


def per_step_ms(fn, logits: torch.Tensor, params: SamplingParams, steps: int) -> float:
    rows = [SamplingParams(**{**params.__dict__, "seed": 1000 + i}) for i in range(logits.shape[0])]
    fn(logits, rows, [make_generator(p) for p in rows])  # first-call costs
    t0 = time.perf_counter()
    for step in range(steps):
        fn(logits, rows, [make_generator(p, draw=step) for p in rows])  # what the rank makes per draw
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49_152)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab) * 3
    print(f"{args.rows} seeded rows x {args.vocab} logits, {torch.get_num_threads()} threads (ms per step)")
    for name, params in (("temperature 0.8", SamplingParams(temperature=0.8)),
                         ("temperature 0.8, top_p 0.95", SamplingParams(temperature=0.8, top_p=0.95))):
        now = per_step_ms(sample, logits, params, args.steps)
        before = per_step_ms(previous_sample, logits, params, args.steps)
        print(f"  {name:<28} now {now:7.2f}  before {before:7.2f}  now / before {now / before:.2f}x")


if __name__ == "__main__":
    main()
