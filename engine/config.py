"""`EngineConfig`: what the engine replica's loop reads of the settings, typed and frozen. Built once from the
user's `deployment.settings.Settings` (`Settings.engine_config()`), so the engine depends on no settings
framework and every field it reads is named here."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.config import CacheSettings, Simulation


@dataclass(frozen=True)
class RoutingConfig:
    """Placement across dp groups (engine/placement.py): the policy and the `kv` score's weights."""

    policy: str = "kv"  # kv | least_loaded | round_robin
    primary_weight: float = 1.0
    host_weight: float = 0.5
    load_weight: float | None = 0.5  # None: by the ranks' device, once the engine has resolved it (load_weight_for)
    free_weight: float = 1.0


# `routing_load_weight` when unset, by the ranks' device (deployment/settings.py `Settings.load_weight` says why)
CPU_LOAD_WEIGHT, GPU_LOAD_WEIGHT = 0.5, 0.1


def load_weight_for(weight: float | None, device: str) -> float:
    """A set load weight, or the default for ranks on `device` ("cpu" or "cuda", resolved)."""
    if weight is not None:
        return weight
    return GPU_LOAD_WEIGHT if device == "cuda" else CPU_LOAD_WEIGHT


@dataclass(frozen=True)
class KVEventsConfig:
    """The ranks' KV events beyond routing: the /kv_events SSE stream (engine/kv_stream.py) and the ZMQ
    publisher in vLLM's wire format (engine/kv_publisher.py; the fields as vLLM's KVEventsConfig names them)."""

    always: bool = False  # record them for /kv_events even with no listener and a policy other than kv
    buffer: int = 10_000  # events kept for /kv_events replay
    publisher: str = "null"  # null | zmq
    endpoint: str = "tcp://*:5557"  # dp group d publishes on the port + first_group + d
    replay_endpoint: str = ""
    topic: str = ""
    buffer_steps: int = 10_000
    first_group: int = 0  # the fleet-wide index of this engine's group 0 (replica rank x dp): its offset


@dataclass(frozen=True)
class EngineConfig:
    engine_id: str = "engine-0"
    model: str = "random"  # a model setting (workers/model_setting.py)
    served_model_name: str = "kvfleet-tiny"
    dp: int = 1
    tp: int = 1
    device: str = "auto"  # auto = cuda when Ray sees GPUs
    dtype: str = "auto"
    seed: int = 0
    cache: CacheSettings = field(default_factory=CacheSettings)
    max_num_batched_tokens: int = 1024
    max_prefill_tokens_while_decoding: int = 0
    max_num_seqs: int = 128
    num_cpus_per_rank: float = 0.5
    stats_buffer_size: int = 10_000
    max_waiting_requests: int = 256
    placement_timeout_s: float = 30.0
    max_group_restarts: int = 3
    restart_backoff_s: float = 0.5
    step_transport: str = "actor_calls"
    async_scheduling: bool = True
    engine_resource: str = ""  # the aggregator asks for a sliver of it, as the engine's replica does
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    simulation: Simulation = field(default_factory=Simulation)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp
