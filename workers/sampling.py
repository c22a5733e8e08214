"""The sampler: greedy, temperature, top-k, top-p, per-request seeded generators.

`sample` works on a batch of logits rows, one `SamplingParams` and one optional `torch.Generator` per row.
Temperature 0 (or below 1e-5) is greedy (argmax; ties go to the lowest id). Otherwise logits are divided by the
temperature, cut to the top-k, then to the smallest set whose probability reaches top_p (the most likely
token always stays), and one token is drawn with the row's generator, so a seeded request draws the same
tokens whatever else shares its batch. Filtering is batched; rows without a generator share one draw from the
global RNG, seeded rows draw one by one.
"""

from __future__ import annotations

import torch

from workers.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: str | torch.device = "cpu", draw: int = 0) -> torch.Generator | None:
    """The generator of a request's `draw`-th token on `device` (None when the request has no seed).
    Seeded per draw, not one stream per request, so a request re-prefilled on another rank after a fault
    draws the tokens it would have drawn (draw 0 is seeded with `seed` itself)."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed((params.seed + draw * _GOLDEN) % 2**64)


_GOLDEN = 0x9E3779B97F4A7C15  # spreads the draws' seeds over the 64-bit space


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None] | None = None
) -> list[int]:
    """Pick one token per row of `logits` [N, V] with the row's params and generator."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if generators is None:
        generators = [None] * n
    if len(params) != n or len(generators) != n:
        raise ValueError(f"{n} logits rows but {len(params)} params and {len(generators)} generators")
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    x = logits[rows] / torch.tensor([params[i].temperature for i in rows], device=logits.device)[:, None]
    top_k = torch.tensor(
        [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows], device=logits.device
    )
    top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device)
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
    drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    picks = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    shared = [j for j, i in enumerate(rows) if generators[i] is None]
    if shared:  # rows without their own generator: one draw from the global RNG
        picks[shared] = torch.multinomial(probs[shared], 1).squeeze(1)
    for j, i in enumerate(rows):
        if generators[i] is not None:
            picks[j] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    tokens = order.gather(1, picks[:, None]).squeeze(1).tolist()
    for j, i in enumerate(rows):
        out[i] = tokens[j]
    return out
