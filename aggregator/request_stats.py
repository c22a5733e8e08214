"""What the engine adds to an iteration for vLLM's request metrics: per dp group, its queue, its token
counts and the times of the requests that produced a first token, a token or finished in the iteration.

Only the engine knows when a request arrived, was first scheduled, produced each token and finished
(engine/request_times.py records them); the aggregator observes these figures into vLLM's histograms
(aggregator/vllm_metrics.py). Plain data: it pickles small and the aggregator needs nothing but this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's FinishReason values, as its request_success counter labels them
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# PromptTokenStats.update_from_output's sources, in vLLM's order
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
PROMPT_COUNTERS = ("total", "cached") + PROMPT_SOURCES


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One finished request, as vLLM's FinishedRequestStats: the phase times are None for a request that was
    never scheduled (queue) or produced no token (prefill, decode, inference, time per output token)."""

    dp: int
    reason: str
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    computed_tokens: int  # prompt tokens its prefill computed (prompt - cached): prefill_kv_computed_tokens
    e2e_s: float
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None
    tpot_s: float | None = None


def prompt_counts(prompt: int, local: int, external: int) -> dict[str, int]:
    """A request's prompt tokens by source when its prefill completes, exactly as vLLM's PromptTokenStats
    counts them: a fully cached prompt still computes its last token, which vLLM books as both computed and
    a local cache hit (`recomputed`)."""
    cached = local + external
    recomputed = 1 if cached + 1 == prompt else 0
    return {"total": prompt, "cached": cached, "local_compute": prompt - cached,
            "local_cache_hit": local + recomputed, "external_kv_transfer": external}


@dataclass
class RequestFigures:
    """One iteration's request figures, lists indexed by dp group."""

    model_name: str
    max_model_len: int
    running: list[int]
    waiting: list[int]
    preempted: list[int]
    generated: list[int]  # tokens delivered
    queries: list[int]  # prompt tokens of the requests first admitted (their prefix lookups), vLLM's queries
    local_hits: list[int]  # of those, found cached on the primary tier (vLLM's prefix cache hits)
    host_hits: list[int]  # ... on the host tier (vLLM's CPU offloading connector: external hits)
    step_tokens: list[int]  # prompt tokens of prefills completed + tokens generated; -1 if it ran nothing
    prompt: list[dict[str, int]]  # PROMPT_COUNTERS summed over the prefills completed
    ttft: list[tuple[int, float]] = field(default_factory=list)  # (dp, seconds)
    itl: list[tuple[int, float]] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
