"""The sampler: penalties, greedy, temperature, min-p, top-k, top-p, per-request seeded generators.

`sample` works on a batch of logits rows, one `SamplingParams` and one optional `torch.Generator` per row.
First the logits of rows with penalties (vLLM's: repetition over prompt and output, presence and frequency over
the output) or with stop tokens held back (`min_tokens`) are adjusted from the row's token history. Temperature 0
(or below 1e-5) is then greedy (argmax; ties go to the lowest id). Otherwise logits are divided by the
temperature, tokens less likely than min_p times the most likely are dropped, the rest cut to the top-k, then to
the smallest set whose probability reaches top_p (the most likely token always stays), and one token is drawn
with the row's generator, so a seeded request draws the same tokens whatever else shares its batch. Rows with
neither top-k nor top-p skip the sort (a full sort of the vocabulary was most of the sampler's time). Filtering
is batched; rows without a generator share one draw from the global RNG, seeded rows (every sampled request the
engine serves: it seeds them) draw their one number one by one.
"""

from __future__ import annotations

import torch

from workers.cpu_kernels import cpu_ops_for
from workers.sampling_params import SamplingParams

# per row: (prompt tokens, output tokens), what the penalties and min_tokens read
History = tuple[list[int], list[int]]


def make_generator(params: SamplingParams, device: str | torch.device = "cpu", draw: int = 0) -> torch.Generator | None:
    """The generator of a request's `draw`-th token on `device` (None when the request has no seed).
    Seeded per draw, not one stream per request, so a request re-prefilled on another rank after a fault
    draws the tokens it would have drawn (draw 0 is seeded with `seed` itself)."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed((params.seed + draw * _GOLDEN) % 2**64)


_GOLDEN = 0x9E3779B97F4A7C15  # spreads the draws' seeds over the 64-bit space


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None] | None = None,
    histories: list[History | None] | None = None,
) -> list[int]:
    """Pick one token per row of `logits` [N, V] with the row's params, generator and token history (needed
    for the rows whose params are `penalized`)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if generators is None:
        generators = [None] * n
    if len(params) != n or len(generators) != n:
        raise ValueError(f"{n} logits rows but {len(params)} params and {len(generators)} generators")
    logits = logits.float()
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        if histories is None or len(histories) != n or any(histories[i] is None for i in penalized):
            raise ValueError("rows with penalties or min_tokens need their token history")
        logits = logits.clone()  # the caller's logits stay as they were
        for i in penalized:
            logits[i] = penalize(logits[i], params[i], *histories[i])
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if len(rows) < n:
        out = logits.argmax(dim=-1).tolist()
    else:  # no greedy row: no argmax over the vocabulary
        out = [0] * n
    if not rows:
        return out
    x = logits[rows] if len(rows) < n else logits
    temperature = torch.tensor([params[i].temperature for i in rows], device=logits.device)
    min_p = torch.tensor([params[i].min_p for i in rows], device=logits.device)
    if bool((min_p > 0).any()):
        x, temperature = x / temperature[:, None], None
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    top_k = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows]
    top_p = [params[i].top_p for i in rows]
    if all(k == vocab for k in top_k) and all(p >= 1 for p in top_p):
        return _draw(out, rows, x, None, generators, temperature)
    if temperature is not None:
        x = x / temperature[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= torch.tensor(top_k, device=logits.device)[:, None]
    probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each token
    cut = torch.tensor(top_p, device=logits.device)[:, None]
    drop |= (before >= cut) & (cut < 1)
    drop[:, 0] = False
    return _draw(out, rows, sorted_x.masked_fill(drop, float("-inf")), order, generators)


def _draw(out: list[int], rows: list[int], x: torch.Tensor, order: torch.Tensor | None,
          generators: list[torch.Generator | None], temperature: torch.Tensor | None = None) -> list[int]:
    """One token per row of logits `x` (over the vocabulary, or over `order`'s sorted ids; -inf never drawn;
    divided by `temperature` first where given) into `out`, by inverting the row's cumulative distribution at
    one uniform draw: one random number per row from its generator: far cheaper than torch.multinomial with a
    row's generator, or the Gumbel-max draw's noise for every token (bench/README.md, sampler_bench.py). On
    CPU fp32 without `order`, csrc/cpu_ops.cpp's `sample_rows` does the rest in one pass a row."""
    u = torch.empty(len(rows), device=x.device)
    shared = [j for j, i in enumerate(rows) if generators[i] is None]
    if shared:  # rows without their own generator: one draw from the global RNG
        u[shared] = torch.rand(len(shared), device=x.device)
    for j, i in enumerate(rows):
        if generators[i] is not None:
            u[j] = torch.rand(1, generator=generators[i], device=x.device)[0]
    ops = cpu_ops_for(x) if order is None else None
    if ops is not None:
        if temperature is None:
            temperature = torch.ones(len(rows))
        tokens = ops.sample_rows(x, temperature.float().contiguous(), u).tolist()
    else:
        if temperature is not None:
            x = x / temperature[:, None]
        cdf = x.softmax(dim=-1).cumsum_(dim=-1)
        total = cdf[:, -1]
        # below the total, so the pick is a token of positive probability: a zero one adds nothing to the sum,
        # and side="right" passes over every index whose sum equals the one before it
        u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        picks = torch.searchsorted(cdf, u[:, None], side="right").squeeze(1)
        tokens = (picks if order is None else order.gather(1, picks[:, None]).squeeze(1)).tolist()
    for j, i in enumerate(rows):
        out[i] = tokens[j]
    return out


def penalize(row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row's logits [V] after vLLM's penalties and min_tokens (its `apply_penalties` and min-tokens
    processor): a token seen in the prompt or the output has a positive logit divided by repetition_penalty
    and a negative one multiplied; each output occurrence costs frequency_penalty, any costs presence_penalty;
    before min_tokens output tokens, end-of-sequence and stop tokens cannot be drawn."""
    vocab = row.shape[0]
    dev = row.device
    counts = torch.bincount(torch.tensor(output, dtype=torch.long, device=dev), minlength=vocab)[:vocab] \
        if output else torch.zeros(vocab, dtype=torch.long, device=dev)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        if prompt:
            seen[torch.tensor(prompt, dtype=torch.long, device=dev)] = True
        scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row = torch.where(seen, scaled, row)
    if p.frequency_penalty:
        row = row - p.frequency_penalty * counts.to(row.dtype)
    if p.presence_penalty:
        row = row - p.presence_penalty * (counts > 0).to(row.dtype)
    if len(output) < p.min_tokens and p.all_stop_token_ids:
        held = [t for t in p.all_stop_token_ids if t < vocab]
        row = row.index_fill(0, torch.tensor(held, dtype=torch.long, device=dev), float("-inf"))
    return row
