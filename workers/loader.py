"""Loading a model (a name, a GGUF file, a Hugging Face directory, or the built-in random one) and sizing its
KV cache.

What a `KVFLEET_MODEL` setting names is `workers/model_setting.py`'s (no torch). A model directory holds
`config.json`, `*.safetensors` and `tokenizer.json`. Each tp rank reads only its slice of every sharded tensor
(`safe_open(...).get_slice`), straight into parameters created on the target device and dtype. The built-in
model ("random") is a small Qwen3-style model with one sliding-window layer and the byte tokenizer's
vocabulary; its full weights are drawn from a fixed seed and then sliced like a checkpoint, so tp=2 is the
same model as tp=1 and every rank of every run agrees without a download.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from workers.config import CacheSettings, ModelConfig, Simulation
from workers.cost_model import load_profile
from workers.gguf_model import GGUFSource, check_gguf, read_gguf
from workers.model import Model
from workers.model_setting import RANDOM_MODEL, SIMULATED_MODEL, default_config, resolve_model, simulated_config
from workers.simulated import SimulatedModel

log = logging.getLogger("kvfleet.worker")

# CPU defaults, in tokens of the model's KV so they suit any model: the built-in one gets 2 MiB and 4 MiB,
# SmolLM2-135M (45 KiB a token in fp32) 45 MiB and 90 MiB
CPU_DEFAULT_KV_TOKENS = 1024
DEFAULT_HOST_KV_TOKENS = 2048


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) fp32 weights drawn from `seed`, scaled so logits have unit spread (clear argmaxes)."""
    g = torch.Generator().manual_seed(seed)
    model = _build(cfg, 0, 1, torch.device("meta"), torch.float32, cfg.max_position_embeddings)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith("bias"):
            t = 0.02 * torch.randn(p.shape, generator=g)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(p.shape, generator=g)
        else:  # [out, in]: unit-variance outputs for unit-variance inputs
            t = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
        out[name] = t
    return out


def load_model(
    path: str | None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_seq_len: int | None = None,
    group: Any = None,
    simulation: Simulation | None = None,
) -> tuple[Model | SimulatedModel, ModelConfig]:
    """Build the model for tp rank `tp_rank` of `tp_size` and fill its weights.

    path: a model setting (see `resolve_model`); None / "" / "random" is the built-in model (weights from `seed`).
    max_seq_len: longest sequence the model will serve (default: the config's max_position_embeddings).
    With tp_size > 1, torch.distributed must already be initialised (`workers.parallel.init_tp_group`).
    simulation: the cost profile and speed of `simulated` (default: `Simulation()`'s).
    Returns (model in eval mode, the full unsharded ModelConfig).
    """
    device = torch.device(device)
    kind, file = resolve_model(path)
    if kind == SIMULATED_MODEL:
        sim = simulation or Simulation()
        profile = load_profile(sim.profile)
        cfg = simulated_config(profile)
        cfg.check_tp(tp_size)
        log.info("simulated model: profile %s at %gx its speed", profile.name, sim.speedup_ratio)
        return SimulatedModel(profile, cfg, sim.speedup_ratio), cfg
    if kind == RANDOM_MODEL:
        cfg = default_config()
        source: _Source = _DictSource(random_weights(cfg, seed))
    elif kind == "gguf":
        cfg = check_gguf(file)
        source = GGUFSource(read_gguf(file), cfg, file)  # type: ignore[assignment]
    else:
        cfg = ModelConfig.from_dir(file)
        source = _SafetensorsSource(Path(file))
    cfg.check_tp(tp_size)
    if max_seq_len is not None and max_seq_len > cfg.max_position_embeddings:
        log.warning(
            "max_seq_len %d exceeds the model's max_position_embeddings %d",
            max_seq_len,
            cfg.max_position_embeddings,
        )
    model = _build(cfg, tp_rank, tp_size, device, dtype, max_seq_len, group)
    _load_weights(model, cfg, source, tp_rank, tp_size)
    model.eval()
    log.info(
        "model loaded: %s, %d layers, tp %d/%d, %s %s",
        file or "built-in random",
        cfg.num_layers,
        tp_rank,
        tp_size,
        device,
        dtype,
    )
    return model, cfg


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _build(
    cfg: ModelConfig,
    tp_rank: int,
    tp_size: int,
    device: torch.device,
    dtype: torch.dtype,
    max_seq_len: int | None,
    group: Any = None,
) -> Model:
    with _default_dtype(dtype), device:
        return Model(cfg, tp_rank=tp_rank, tp_size=tp_size, max_seq_len=max_seq_len, group=group)


class _Source:
    names: set[str]

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        raise NotImplementedError


class _DictSource(_Source):
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.names = set(tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensors[name][index]


class _SafetensorsSource(_Source):
    """Every *.safetensors file of a directory; tensors are read lazily, slice by slice."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in model directory {str(path)!r}")
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
        self._where: dict[str, Any] = {}
        for h in self._handles:
            for name in h.keys():
                self._where[name] = h
        self.names = set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return self._where[name].get_slice(name)[index]


def _load_weights(model: Model, cfg: ModelConfig, source: _Source, tp_rank: int, tp_size: int) -> None:
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    missing = [n for n in params if n not in source.names]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weight(s), e.g. {missing[:5]}")
    for name, param in params.items():
        dim = getattr(param, "shard_dim", None)
        full = source.shape(name)
        expect = list(param.shape)
        if dim is not None:
            expect[dim] *= tp_size
        if list(full) != expect:
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(full)} does not match the model's "
                f"{tuple(expect)} (config.json and the weights disagree)"
            )
        index = [slice(None)] * len(full)
        if dim is not None:
            size = param.shape[dim]
            index[dim] = slice(tp_rank * size, (tp_rank + 1) * size)
        with torch.no_grad():
            param.copy_(source.read(name, tuple(index)).to(param.dtype))
    unused = sorted(source.names - set(params) - {"lm_head.weight"})
    if unused:
        log.debug("checkpoint tensors not used by the model: %s", unused[:10])


def kv_cache_config(
    model_cfg: ModelConfig,
    tp_size: int,
    cache: CacheSettings,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    free_memory: Callable[[torch.device], int] | None = None,
    default_tokens: tuple[int, int] = (CPU_DEFAULT_KV_TOKENS, DEFAULT_HOST_KV_TOKENS),
) -> Any:
    """The `kvcache.KVCacheManagerConfig` of one tp rank of this model.

    One attention layer config per model layer: `num_kv_heads / tp_size` heads of `head_dim`, `dtype`, the
    layer's sliding window (None = full attention), no sink tokens. Primary bytes: `kv_cache_bytes` when > 0;
    else on CUDA `gpu_memory_fraction` of the device's free memory (call this after the model is loaded, so
    the weights are not counted as free), on any other device room for `default_tokens[0]` tokens. Host bytes:
    `host_cache_bytes`, or room for `default_tokens[1]` tokens when -1 (a simulated rank's: its profile's).
    `free_memory(device) -> bytes` overrides the CUDA query (tests). Whether one `max_seq_len` request fits
    is the cache's call: check `KVCacheManager(cfg).fits(max_seq_len, chunk_tokens)` (kvcache splits the budget
    over life cycles).
    """
    from kvcache import AttentionLayerConfig, KVCacheManagerConfig

    tokens_per_block, max_seq_len, gpu_memory_fraction = cache.tokens_per_block, cache.max_seq_len, \
        cache.gpu_memory_fraction
    kv_cache_bytes, host_cache_bytes = cache.kv_cache_bytes, cache.host_cache_bytes
    model_cfg.check_tp(tp_size)
    if tokens_per_block < 1 or max_seq_len < 1:
        raise ValueError(
            f"tokens_per_block ({tokens_per_block}) and max_seq_len ({max_seq_len}) must be >= 1"
        )
    if not 0 < gpu_memory_fraction <= 1:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction}")
    if kv_cache_bytes < 0 or host_cache_bytes < -1:
        raise ValueError("kv_cache_bytes must be >= 0 and host_cache_bytes >= -1 (-1 = default)")
    device = torch.device(device)
    token_bytes = model_cfg.kv_bytes_per_token(tp_size, torch.empty((), dtype=dtype).element_size())
    if kv_cache_bytes == 0:
        if device.type == "cuda":
            free = (free_memory or _cuda_free_bytes)(device)
            kv_cache_bytes = int(free * gpu_memory_fraction)
        else:
            kv_cache_bytes = default_tokens[0] * token_bytes
    if host_cache_bytes == -1:
        host_cache_bytes = default_tokens[1] * token_bytes
    kv_heads = model_cfg.num_kv_heads // tp_size
    layers = [
        AttentionLayerConfig(
            layer_id=i,
            num_kv_heads=kv_heads,
            head_dim=model_cfg.head_dim,
            dtype=dtype,
            window_size=model_cfg.window_of_layer(i),
            num_sink_tokens=0,
        )
        for i in range(model_cfg.num_layers)
    ]
    return KVCacheManagerConfig(
        tokens_per_block=tokens_per_block,
        max_seq_len=max_seq_len,
        layers=layers,
        gpu_cache_bytes=kv_cache_bytes,
        host_cache_bytes=host_cache_bytes,
        enable_block_reuse=cache.enable_block_reuse,
        enable_partial_reuse=cache.enable_partial_reuse,
        enable_stats=cache.enable_stats,
        device=str(device),
    )


def _cuda_free_bytes(device: torch.device) -> int:
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
