"""The messages between the engine and a rank: what a rank starts with (`RankSpec`), what the engine asks of it
each iteration (`StepPlan`: new requests, work, closes) and what it answers (`StepResult`). Plain data with no
torch, so the engine's side imports none (as vLLM keeps its scheduler output apart from the worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aggregator.delta import RankDelta
from kvcache.events import KVEvent
from workers.config import CacheSettings, Simulation
from workers.sampling_params import SamplingParams


@dataclass
class RankSpec:
    """What one rank needs to start; plain data so it pickles into the actor."""

    engine_id: str
    rank: int
    dp: int
    tp: int
    model: str
    device: str  # "cpu" or "cuda"
    dtype: str
    seed: int
    cache: CacheSettings
    max_num_batched_tokens: int
    num_threads: int = 1
    simulation: Simulation = field(default_factory=Simulation)  # read with model=simulated only

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp


@dataclass
class NewRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    warmup: bool = False  # warm-up requests are excluded from every statistic
    # of `prompt`, the last tokens that are output already sampled (a request re-prefilled on a new group): a
    # seeded sampler goes on from there
    num_output_tokens: int = 0
    block_keys: list[int] | None = None  # the prompt's full blocks' keys (kvcache.events), computed once


# `Work.new_token_id` of a step the engine sent before the last one's result came back (async scheduling): the
# token this rank sampled for the request in the step just before, which the engine does not know yet.
LAST_SAMPLED = -1


@dataclass
class Work:
    """Run up to `num_scheduled_tokens` tokens of a request (vLLM's word); `new_token_id` is the token sampled
    last step (None in prefill), which the rank appends first, or LAST_SAMPLED. With LAST_SAMPLED the rank skips
    the work when it sampled nothing for the request in the iteration before, or a token in `stop_ids` (the
    request finished there: the engine's stop rule, engine/scheduler.py apply_result)."""

    request_id: str
    num_scheduled_tokens: int
    new_token_id: int | None = None
    stop_ids: frozenset[int] = frozenset()


@dataclass
class StepPlan:
    iteration: int
    new: list[NewRequest] = field(default_factory=list)
    work: list[Work] = field(default_factory=list)  # highest priority first
    close: list[str] = field(default_factory=list)
    record: bool = True  # False for warm-up steps: no stats message
    kv_events: bool = False  # record KV events (tp rank 0 only: the others make the same decisions)
    kv_resync: bool = False  # start them with a snapshot of everything the cache holds
    threads: int = 0  # CPU threads for this step, the cores no other rank on its node steps on now; 0: its own


@dataclass
class StepResult:
    iteration: int
    ran: dict[str, tuple[int, int | None]]  # request id -> (history after, sampled token or None mid-prefill)
    deferred: list[str]  # scheduled but found no room this step
    recomputed: list[str]  # preempted by closing their cache: they prefill again (reusing what is cached)
    suspended: list[str]  # preempted by suspend(): their blocks may go to the host tier
    reused: dict[str, int]  # new request id -> tokens reused from the prefix cache
    step_s: float
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why; the rank has dropped it
    delta: RankDelta | None = None  # this rank's stats of the iteration (None: warm-up, or stats off)
    kv_events: list[KVEvent] | None = None  # this step's KV events (plan.kv_events, tp rank 0)
    first_reuse: dict[str, int] = field(default_factory=dict)  # request id -> reused blocks of its first commit
    free_blocks: int = -1  # free primary blocks after the step (with KV events)
    reused_host: dict[str, int] = field(default_factory=dict)  # new request id -> of its reused tokens, on host
