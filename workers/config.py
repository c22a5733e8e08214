"""The model's shape, read from a Hugging Face `config.json` (Llama / Qwen2 / Qwen3 / Mistral families).

One plain dataclass holds everything the decoder, the loader and the KV cache sizing need, so no other
module parses Hugging Face keys. Per-layer sliding windows come from `layer_types`
(`sliding_attention` / `full_attention`) with `sliding_window`; without `layer_types`, Qwen2/Qwen3's
`use_sliding_window` + `max_window_layers` (layers `>= max_window_layers` slide) and Mistral's global
`sliding_window` are honoured. As in `transformers`, `use_sliding_window: false` switches every window off.
A window of `w` tokens means a query at position `i` attends to keys `j` with `i - w < j <= i`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder-only model (full, unsharded sizes)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "qwen3"
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "llama3", ...}; None = plain RoPE
    max_position_embeddings: int = 4096
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    layer_windows: tuple[int | None, ...] = field(default=())  # per layer: window in tokens, None = full
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"model config: hidden_act {self.hidden_act!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"model config: {len(self.layer_windows)} layer windows for {self.num_layers} layers"
            )
        for i, w in enumerate(self.layer_windows):
            if w is not None and (not isinstance(w, int) or w <= 0):
                raise ValueError(
                    f"model config: layer {i} sliding window must be a positive int or None, got {w!r}"
                )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"model config: rope_type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )

    def window_of_layer(self, layer_id: int) -> int | None:
        """Sliding window (tokens) of layer `layer_id`, or None for full attention."""
        if not 0 <= layer_id < self.num_layers:
            raise IndexError(f"layer {layer_id} out of range [0, {self.num_layers})")
        return self.layer_windows[layer_id]

    def kv_bytes_per_token(self, tp_size: int = 1, dtype_bytes: int = 4) -> int:
        """K+V bytes one token takes over all layers on one tp rank."""
        return 2 * self.num_layers * (self.num_kv_heads // tp_size) * self.head_dim * dtype_bytes

    def check_tp(self, tp_size: int) -> None:
        """Raise ValueError when the heads or the MLP cannot be split evenly over `tp_size` ranks."""
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        for name, value in (
            ("num_kv_heads", self.num_kv_heads),
            ("num_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if value % tp_size:
                raise ValueError(
                    f"tensor parallelism: {name} ({value}) is not divisible by tp_size ({tp_size})"
                )

    def with_windows(self, windows: list[int | None] | tuple[int | None, ...]) -> ModelConfig:
        """A copy with other per-layer windows (tests, experiments)."""
        return replace(self, layer_windows=tuple(windows))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (transformers 4.x or 5.x key names)."""
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        try:
            hidden = int(d["hidden_size"])
            num_layers = int(d["num_hidden_layers"])
            num_heads = int(d["num_attention_heads"])
            vocab_size = int(d["vocab_size"])
            intermediate = int(d["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        num_kv_heads = int(d.get("num_key_value_heads") or num_heads)
        head_dim = int(d.get("head_dim") or hidden // num_heads)

        # RoPE: transformers 5 nests theta and scaling in `rope_parameters`; 4.x: `rope_theta`, `rope_scaling`
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        rope_scaling = None
        if rope_type != "default":
            rope_scaling = {"rope_type": rope_type, **rope}
            if rope_type == "llama3":
                rope_scaling.setdefault(
                    "original_max_position_embeddings",
                    d.get("original_max_position_embeddings", d.get("max_position_embeddings")),
                )

        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))

        eos = d.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        )
        bos = d.get("bos_token_id")

        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            model_type=model_type,
            hidden_act=d.get("hidden_act", "silu"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            qk_norm=model_type == "qwen3",
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            layer_windows=_layer_windows(d, num_layers),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json`."""
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
        with p.open() as f:
            return cls.from_hf(json.load(f))


def _layer_windows(d: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = d.get("sliding_window")
    if d.get("use_sliding_window") is False:  # transformers: Qwen2/Qwen3 drop the window when this is off
        window = None
    if window is not None:
        window = int(window)
        if window <= 0:
            raise ValueError(f"sliding_window must be positive, got {window}")
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        out: list[int | None] = []
        for i, t in enumerate(layer_types):
            if t == "full_attention":
                out.append(None)
            elif t == "sliding_attention":
                out.append(window)
            else:
                raise ValueError(
                    f"layer {i}: layer type {t!r} is not supported "
                    "(supported: full_attention, sliding_attention)"
                )
        return tuple(out)
    if window is None:
        return (None,) * num_layers
    if "max_window_layers" in d:  # Qwen2/Qwen3 without layer_types: the top layers slide
        first = int(d["max_window_layers"])
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers  # Mistral: every layer slides


@dataclass(frozen=True)
class CacheSettings:
    """Every rank's KV cache settings as the user gave them: one object from `Settings` to `kv_cache_config`
    (the loader turns them into a `KVCacheManagerConfig` for one tp rank of one model)."""

    tokens_per_block: int = 16
    max_seq_len: int = 1024
    kv_cache_bytes: int = 0  # 0 = gpu_memory_fraction of free memory on CUDA, a model-sized default on CPU
    gpu_memory_fraction: float = 0.85
    host_cache_bytes: int = 0  # -1 = a model-sized default
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    enable_stats: bool = True


@dataclass(frozen=True)
class Simulation:
    """The simulated ranks' settings (`model=simulated`, workers/simulated.py): the cost profile (a name in
    `workers.cost_model.PROFILES` or a .json file) and how much faster than it the simulated GPUs run."""

    profile: str = "h100-llama3.1-8b"
    speedup_ratio: float = 1.0
