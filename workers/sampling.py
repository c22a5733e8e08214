"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeded generators.

`sample` works on a batch of logits rows, one `SamplingParams` and one optional `torch.Generator` per row.
Temperature 0 (or below 1e-5) is greedy (argmax; ties go to the lowest id). Otherwise logits are divided by the
temperature, cut to the top-k, then to the smallest set whose probability reaches top_p (the most likely
token always stays), and one token is drawn with the row's generator, so a seeded request draws the same
tokens whatever else shares its batch. Filtering is batched; rows without a generator share one draw from the
global RNG, seeded rows draw one by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens. `top_k` 0 (or -1) = no top-k; `seed` None = the engine's RNG."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1 = disabled), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(
                f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}"
            ) from None
        for t in stops:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflow to inf and sampling is argmax anyway (as vLLM does)
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def make_generator(self, device: str | torch.device = "cpu", draw: int = 0) -> torch.Generator | None:
        """The generator of the request's `draw`-th token on `device` (None when the request has no seed).
        Seeded per draw, not one stream per request, so a request re-prefilled on another rank after a fault
        draws the tokens it would have drawn (draw 0 is seeded with `seed` itself)."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed((self.seed + draw * _GOLDEN) % 2**64)


_GOLDEN = 0x9E3779B97F4A7C15  # spreads the draws' seeds over the 64-bit space


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


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
