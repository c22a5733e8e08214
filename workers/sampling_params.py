"""How one request picks tokens (`SamplingParams`): plain data, no torch, so the HTTP layer and the engine build
and check it without the sampler (workers/sampling.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens (each field checked here, so a bad value never reaches a rank)."""

    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_BELOW_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k
    seed: int | None = None  # None: one is drawn at random for the request (its tp ranks and re-sends share it)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's extensions, with its semantics: repetition_penalty over prompt and output tokens (a positive logit
    # divided by it, a negative one multiplied), presence/frequency penalties over output tokens (OpenAI's),
    # min_p relative to the most likely token, and no end-of-sequence or stop token before min_tokens
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    # what min_tokens holds back (the engine fills it in: its eos ids unless ignore_eos, and stop_token_ids)
    all_stop_token_ids: tuple[int, ...] = ()

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
        object.__setattr__(self, "all_stop_token_ids", tuple(self.all_stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 1e6:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (penalties, or stop tokens held back)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or (self.min_tokens > 0 and bool(self.all_stop_token_ids)))

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflow to inf and sampling is argmax anyway (as vLLM does)
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
