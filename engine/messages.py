"""The messages between the ingress, Serve's request router and the engine deployment (no torch, no Ray): what
a generate call carries, which the router reads and decides on (`GenerateRequest`), the first thing its stream yields
(`Admitted`), what the engine tells the ingress once, at its start (`EngineInfo`), and its answer to the fleet
router's long poll (`FollowReport`, with each dp group's `GroupState` and its `KVStreamEvent`s), and its `health`
(`EngineHealth`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvcache.events import KVEvent


@dataclass
class GenerateRequest:
    """One generate call of the ingress to an engine replica (`KVFleetEngine.generate`), and what the engine
    deployment's request router reads of it and decides on: the decision travels with the call.

    `token_ids`: the prompt (on a re-send, the prompt and the tokens already received); `params`: its
    `workers.sampling_params.SamplingParams` (on a re-send, `max_tokens` less those); `request_id` (None: the
    engine names it); `cache_salt`; `num_output_tokens`: how many of `token_ids` are output already sampled (a
    re-send; Engine.submit). `prompt`: the text Ray Serve
    LLM's PrefixCacheAffinityRouter reads (a `prompt` attribute of any positional argument: a chat's templated
    text), set only for it. `KVFleetRouter` keys and weighs `token_ids`, `cache_salt` and `max_tokens`, and writes
    `engine`, `dp`, `blocks` (the prompt blocks the group holds), `partial` (the prompt tokens past them its rank
    will reuse in part) and its ticket before Serve sends the call."""

    token_ids: list[int]
    params: Any = None
    request_id: str | None = None
    cache_salt: str | None = None
    num_output_tokens: int = 0
    prompt: str = ""
    engine: str | None = None
    dp: int = -1
    blocks: int = 0
    partial: int = 0
    router: str = ""  # the deciding router's view id, and its ticket for this request (ReplicaView.report)
    ticket: int = -1

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens if self.params is not None else 0

    def placed(self, engine_id: str) -> tuple[int, int, int] | None:
        """(dp group, blocks held, tokens reused in part past them) if the router chose a group of this engine."""
        return (self.dp, self.blocks, self.partial) if self.engine == engine_id and self.dp >= 0 else None


@dataclass(frozen=True)
class Admitted:
    """A generate stream's first event: the engine took the request (a refusal raises instead), so the ingress
    answers a refusal with its HTTP status before any response starts. Token events follow."""


ADMITTED = Admitted()


@dataclass(frozen=True)
class EngineInfo:
    """The engine's limits, which the ingress checks a request against before sending it (no round trip), and
    its stats aggregator's actor handle (the ingress's stats view follows it)."""

    max_model_len: int
    max_seq_len: int
    vocab_size: int
    aggregator: Any = None


@dataclass(frozen=True)
class GroupState:
    """What the fleet's router weighs besides the blocks, of one dp group: whether it is up, its load in tokens
    (as the `kv` policy counts it) and its room in blocks (free as its rank last reported, less what its waiting
    requests will take)."""

    up: bool
    load: int
    room: int


@dataclass(frozen=True)
class GroupHealth:
    """One dp group in the engine's health: up or why not, its failures in a row and restarts, whether it is
    restarting, stays down, or waits for resources to place its ranks (`pending`), and its node."""

    up: bool
    down: str | None
    failures: int
    restarts: int
    restarting: bool
    stays_down: bool
    pending: bool
    node_id: str | None


@dataclass(frozen=True)
class EngineHealth:
    """The engine's answer to `health` while some dp group serves (none: it raises EngineError, a 503): the
    /health `engine` object, field for field. Groups are keyed by dp rank as a string, as in JSON."""

    ok: bool
    ranks: int
    iteration: int
    steps: int
    running: int
    waiting: int
    down_groups: dict[str, str]
    groups: dict[str, GroupHealth]


class KVStreamEvent(NamedTuple):
    """One event of an engine's KV event stream (engine/kv_stream.py): one vLLM KV event of /kv_events, typed.
    `id` names it for a resume; `events` are what it stands for as a `KVIndex` applies them (one rank event, or
    a snapshot's blocks of one tier; a salted block's carry no tokens and no salt: the tenant's prompt never
    leaves); `resync` marks a snapshot's `AllBlocksCleared`. The fleet's router applies `events` as they are;
    /kv_events shows the vLLM shape (`kv_stream.vllm_event`)."""

    id: str
    dp: int
    ts: float
    events: tuple[KVEvent, ...]
    resync: bool = False


@dataclass
class FollowReport:
    """An engine replica's answer to the fleet router's long poll (`KVFleetEngine.follow`): its KV events after
    the id asked; its groups' state; the newest ticket of each router it admitted. Only `replica` is set when
    the call reached another replica than the one asked."""

    replica: str
    engine: str | None = None
    block_size: int = 0
    events: list[KVStreamEvent] = field(default_factory=list)
    groups: list[GroupState] = field(default_factory=list)
    tickets: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadReport:
    """An engine replica's load as Serve's autoscaling policy reads it (deployment/autoscale.py): what
    `KVFleetEngine.record_autoscaling_stats` reports, field for field, as Serve's custom metrics; Serve averages
    each one per replica over its look-back window. Exact, from the engine's own queues and KV index."""

    uncached_prompt_tokens: float  # prompt tokens waiting or still prefilling that no dp group of it holds
    running: float  # requests running
    waiting: float  # requests waiting for a place (in a group's queue, or for a group to come up)
    slots: float  # requests it can run at once: max_num_seqs per dp group up
    kv_usage: float  # share of its groups' primary KV blocks in use, 0..1 (as their ranks last reported)
    short_groups: float  # dp groups whose free blocks are fewer than their waiting requests need: they evict
    prefill_tokens_per_s: float  # prompt tokens computed per second of stepping over its recent steps (0: none)
    uncached_prompt_tokens_per_s: float  # uncached prompt tokens arriving a second, over the last DEMAND_WINDOW_S
