"""What one engine step costs on a GPU: the cost model of the simulated ranks (`model=simulated`).

A simulated rank runs everything a rank runs but the forward pass, which it replaces by a wait of the time this
model gives for the step's batch (workers/simulated.py). The model is a roofline over the step's terms, as Vidur
(MLSys'24) and Dynamo's mocker price a batch:

    step = step_s                                       fixed: scheduling, kernel launches, sampling
         + max(weights_s, new_tokens x token_s)         the linear layers: reading the weights once, or their
                                                        compute when the batch has enough tokens to hide it
         + sum over sequences of max(pairs x attn_pair_s, context x kv_token_s)
                                                        attention: compute over (query, key) pairs in prefill,
                                                        reading the context's K and V in decode

`pairs` is what causal attention computes for `n` new tokens after `start` cached ones: n x start + n(n+1)/2.
A profile names a GPU and a model (per tp rank: measured at the tp it serves) and its KV cache capacity in
tokens; `docs/simulation.md` derives the default's numbers and says how to measure your own
(`bench/gpu_profile.py`, run by `bench/gpu_check.sh` where a GPU is lent). No torch here: the app's builder
checks a profile before anything is deployed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class CostProfile:
    """One GPU serving one model at one tp: the cost model's terms (seconds) and the KV cache it holds."""

    name: str
    step_s: float  # fixed cost of every step
    weights_s: float  # reading the rank's weights once
    token_s: float  # the linear layers' compute per new token
    attn_pair_s: float  # attention compute per (query, key) pair
    kv_token_s: float  # reading one context token's K and V
    kv_tokens: int  # the primary KV cache's capacity in tokens
    host_kv_tokens: int = 0  # the host tier's (0: as the settings say)
    # the model's shape, for the KV cache's layout (bytes per block in the stats)
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 131_072
    layer_windows: tuple[int | None, ...] = ()  # per layer: its sliding window in tokens, None = full; () = all full

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))  # a JSON file gives a list
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "layer_windows"):
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"cost profile {self.name!r}: {f.name} must be a number >= 0, got {value!r}")
        if self.kv_tokens < 1 or self.num_layers < 1 or self.num_kv_heads < 1 or self.head_dim < 2:
            raise ValueError(f"cost profile {self.name!r}: kv_tokens and the model's shape must be positive")

    def step_time(self, batch: list[tuple[int, int]]) -> float:
        """Seconds one step takes for `batch`: (new tokens, tokens already cached) per sequence."""
        if not batch:
            return 0.0
        new_tokens = 0
        attention = 0.0
        for n, start in batch:
            new_tokens += n
            pairs = n * start + n * (n + 1) // 2
            attention += max(pairs * self.attn_pair_s, (start + n) * self.kv_token_s)
        return self.step_s + max(self.weights_s, new_tokens * self.token_s) + attention

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


# An H100 SXM serving Llama-3.1-8B-Instruct in bf16 at tp 1 (docs/simulation.md derives each number):
# 989.4 TFLOP/s dense bf16 and 3.35 TB/s HBM3 (NVIDIA's H100 datasheet), 8.03e9 parameters, 32 layers, 32 query
# and 8 KV heads of 128 (the model's config.json); 50% of peak FLOP/s and 80% of peak bandwidth achieved
# (assumed; measure yours). The KV cache: 0.9 of 80 GB less the weights and 4 GB of activations, 128 KiB a token.
H100_LLAMA_8B = CostProfile(
    name="h100-llama3.1-8b",
    step_s=1.5e-3,
    weights_s=16.06e9 / (3.35e12 * 0.8),
    token_s=2 * 8.03e9 / (989.4e12 * 0.5),
    attn_pair_s=4 * 32 * 32 * 128 / (989.4e12 * 0.5),
    kv_token_s=2 * 32 * 8 * 128 * 2 / (3.35e12 * 0.8),
    kv_tokens=int((0.9 * 80e9 - 16.06e9 - 4e9) / (2 * 32 * 8 * 128 * 2)),
    host_kv_tokens=0,
)

PROFILES = {H100_LLAMA_8B.name: H100_LLAMA_8B}
DEFAULT_PROFILE = H100_LLAMA_8B.name


def load_profile(name_or_path: str) -> CostProfile:
    """A named profile (`PROFILES`) or a JSON file of `CostProfile`'s fields; ValueError when it is neither."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.suffix != ".json" or not path.is_file():
        raise ValueError(f"cost profile {name_or_path!r} is neither a known name ({', '.join(PROFILES)}) nor a "
                         ".json file")
    try:
        data = json.loads(path.read_text())
        return CostProfile(**data)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"cost profile {name_or_path}: {exc}") from None
