"""All of kvfleet's settings in one pydantic-settings class.

Read from `KVFLEET_*` environment variables, or from `serve run deployment:build_app key=value` args
(which take precedence). The defaults run on a CPU-only laptop: the built-in random-weight model, dp=2 x tp=1
ranks (so the cluster merge is real from the first request) and a KV cache small enough that ordinary
traffic shows reuse, eviction and offload to the host tier.
"""

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVFLEET_", extra="forbid", frozen=True)

    model: str = Field("", description="Hugging Face model directory; empty = built-in random-weight model")
    served_model_name: str = Field("kvfleet-tiny", description="model name clients send in requests")
    engine_id: str = Field("engine-0", description="names the engine and its stats aggregator actor")
    dp: int = Field(2, ge=1, description="data-parallel groups (model copies)")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per group")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when Ray sees GPUs")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto = float32 on CPU, bfloat16 on CUDA"
    )
    tokens_per_block: int = Field(16, ge=1, description="tokens per KV cache block")
    max_seq_len: int = Field(1024, ge=2, description="longest prompt + generation, in tokens")
    kv_cache_bytes: int = Field(
        0, ge=0, description="primary KV cache bytes per rank; 0 = gpu_memory_fraction on CUDA, 2 MiB on CPU"
    )
    gpu_memory_fraction: float = Field(
        0.85, gt=0, le=1, description="share of free GPU memory for the KV cache"
    )
    host_cache_bytes: int = Field(
        4 << 20, ge=0, description="host-tier (secondary) KV bytes per rank; 0 = none"
    )
    enable_block_reuse: bool = Field(True, description="prefix reuse across requests")
    enable_partial_reuse: bool = Field(True, description="reuse a partly matching block")
    enable_stats: bool = Field(True, description="record KV cache statistics")
    max_num_batched_tokens: int = Field(256, ge=1, description="token budget of one engine step")
    max_num_seqs: int = Field(32, ge=1, description="requests running at once per dp group")
    max_tokens_default: int = Field(64, ge=1, description="max_tokens when a request names none")
    stats_buffer_size: int = Field(10_000, ge=1, description="cluster records kept for /stats readers")
    ingress_replicas: int = Field(1, ge=1, description="HTTP ingress replicas in front of the engine's replica")
    num_cpus_per_rank: float = Field(0.5, gt=0, description="Ray CPUs reserved by each rank actor")
    seed: int = Field(0, description="seed of the built-in model's weights")


def settings_table_markdown() -> str:
    """The README's settings table, generated from the fields so the two cannot drift apart."""
    rows = ["| setting | env var | default | meaning |", "|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = f'`"{default}"`' if isinstance(default, str) else f"`{default}`"
        rows.append(f"| `{name}` | `KVFLEET_{name.upper()}` | {shown} | {field.description} |")
    return "\n".join(rows) + "\n"
