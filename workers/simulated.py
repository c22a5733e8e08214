"""The simulated model (`model=simulated`): what a rank calls instead of a forward pass to measure the real
system at a GPU fleet's size on a machine without GPUs.

It is the only simulated part. The rank around it is the same `RankWorker` with its real KV cache manager
(blocks, reuse, eviction, the host tier, events and statistics; on the `meta` device, so a cache of a GPU's
size costs only its bookkeeping), the engine, its scheduler and placement, the stats channel and the
aggregators. A step waits (sleeps: it costs no CPU) for the time the cost profile gives for its batch
(workers/cost_model.py), divided by `speedup_ratio` (Dynamo's mocker's word: below 1 the simulated GPUs run
slower than real ones, so a fleet's control plane fits on fewer cores). Its tokens are a hash of the sequence's
last token and position, as logits with one clear maximum: any sampler picks it, so a sequence's tokens are the
same on every replica, in every batch and after a re-send; they are printable characters, never a special token
(requests run to their length, or to a stop string).
"""

from __future__ import annotations

import time

import torch

from workers.config import ModelConfig
from workers.cost_model import CostProfile
from workers.model import SeqInput

PEAK = 100.0  # the chosen token's logit, every other 0: sampled at any temperature a client sends


def next_token(last: int, position: int, choices: list[int]) -> int:
    """The simulated model's token after `last` at `position` (hash of ints: the same in every process)."""
    return choices[hash((last, position)) % len(choices)]


class SimulatedModel:
    """Callable as `workers.model.Model`: `(seqs, kv_manager) -> logits`, after sleeping the step's cost."""

    def __init__(self, profile: CostProfile, cfg: ModelConfig, speedup_ratio: float = 1.0) -> None:
        if speedup_ratio <= 0:
            raise ValueError(f"speedup_ratio must be > 0, got {speedup_ratio}")
        self.profile = profile
        self.config = cfg
        self.speedup_ratio = speedup_ratio
        # printable ASCII, the byte tokenizer's ids 32-126: whole characters, never a special token
        special = {cfg.bos_token_id, *cfg.eos_token_ids}
        self.choices = [t for t in range(32, min(127, cfg.vocab_size)) if t not in special]
        self.busy_s = 0.0  # simulated GPU seconds so far

    def kv_cache_place(self) -> dict:
        """Where the rank's KV cache lives and its default size (`loader.kv_cache_config`'s arguments): the
        profile's capacity on the `meta` device, real bookkeeping with no bytes."""
        return {"device": "meta", "default_tokens": (self.profile.kv_tokens, self.profile.host_kv_tokens)}

    def __call__(self, seqs: list[SeqInput], kv_manager: object = None) -> list[torch.Tensor]:
        if not seqs:
            raise ValueError("forward needs at least one sequence")
        seconds = self.profile.step_time([(len(s.tokens), s.start_pos) for s in seqs])
        self.busy_s += seconds
        out = [self._logits(i, s) for i, s in enumerate(seqs)]
        time.sleep(seconds / self.speedup_ratio)
        return out

    def _logits(self, i: int, s: SeqInput) -> torch.Tensor:
        vocab = self.config.vocab_size
        if min(s.tokens) < 0 or max(s.tokens) >= vocab:  # as the real model says it
            bad = next(t for t in s.tokens if not 0 <= t < vocab)
            raise ValueError(f"sequence {i}: token id {bad} is outside the vocabulary [0, {vocab})")
        positions = range(len(s.tokens)) if s.all_logits else [len(s.tokens) - 1]
        logits = torch.zeros(len(positions), vocab)
        for row, i in enumerate(positions):
            logits[row, next_token(s.tokens[i], s.start_pos + i + 1, self.choices)] = PEAK
        return logits if s.all_logits else logits[0]
