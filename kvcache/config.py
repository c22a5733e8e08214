"""Configuration of one rank's KV cache, and the life cycles and pool groups derived from it.

A life cycle is one distinct attention shape `(window_size, num_sink_tokens)`; a pool group is the set of
life cycles whose slots have the same size, so they can share one pool of slots per tier. Normalisations
(written down here because the spec leaves them open): a window `>= max_seq_len` is full attention, and full
attention ignores sink tokens, so `(None, s)` is the same life cycle as `(None, 0)`.
"""

from dataclasses import dataclass, field

import torch

from kvcache.attention import FullAttention, SlidingWindow, attention_policy


@dataclass(frozen=True)
class AttentionLayerConfig:
    layer_id: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    window_size: int | None = None
    num_sink_tokens: int = 0

    @property
    def block_layer_bytes(self) -> int:
        """Bytes of one token's K or V in this layer, times nothing: multiply by tokens and 2 (K and V)."""
        return self.num_kv_heads * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()


@dataclass
class KVCacheManagerConfig:
    tokens_per_block: int
    max_seq_len: int
    layers: list[AttentionLayerConfig]
    gpu_cache_bytes: int
    host_cache_bytes: int = 0
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    enable_stats: bool = True
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if self.max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        if not self.layers:
            raise ValueError("at least one attention layer is required")
        ids = [layer.layer_id for layer in self.layers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate layer ids: {ids}")
        for layer in self.layers:
            if layer.num_kv_heads < 1 or layer.head_dim < 1:
                raise ValueError(f"layer {layer.layer_id}: num_kv_heads and head_dim must be >= 1")
            if layer.window_size is not None and layer.window_size < 1:
                raise ValueError(f"layer {layer.layer_id}: window_size must be >= 1 or None")
            if layer.num_sink_tokens < 0:
                raise ValueError(f"layer {layer.layer_id}: num_sink_tokens must be >= 0")
        if self.gpu_cache_bytes < 0 or self.host_cache_bytes < 0:
            raise ValueError("cache byte budgets must be >= 0")


@dataclass
class LifeCycle:
    id: int
    window_size: int | None  # None = full attention
    num_sink_tokens: int
    window_key: str  # the window size, or max_seq_len for full attention
    attention: FullAttention | SlidingWindow  # which blocks go stale, and how many are held at once
    layers: list[AttentionLayerConfig] = field(default_factory=list)
    slot_bytes: int = 0
    pool_group: int = -1
    # byte offset of each layer's K inside a slot (V follows K)
    layer_offsets: dict[int, int] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """TensorRT-LLM's life cycle kind: every life cycle here is attention (full or sliding: see windowSize)."""
        return "attention"


@dataclass
class PoolGroup:
    id: int
    slot_bytes: int
    life_cycles: list[int]
    window_keys: list[int]  # sorted, as ints


def derive_layout(cfg: KVCacheManagerConfig) -> tuple[list[LifeCycle], list[PoolGroup]]:
    """Group layers into life cycles (in layer order) and life cycles into pool groups by slot size."""
    B = cfg.tokens_per_block
    by_shape: dict[tuple[int | None, int], LifeCycle] = {}
    life_cycles: list[LifeCycle] = []
    for layer in cfg.layers:
        window = layer.window_size
        if window is not None and window >= cfg.max_seq_len:
            window = None
        sinks = 0 if window is None else layer.num_sink_tokens
        shape = (window, sinks)
        cycle = by_shape.get(shape)
        if cycle is None:
            key = str(cfg.max_seq_len if window is None else window)
            cycle = LifeCycle(len(life_cycles), window, sinks, key, attention_policy(B, window, sinks))
            by_shape[shape] = cycle
            life_cycles.append(cycle)
        cycle.layer_offsets[layer.layer_id] = cycle.slot_bytes
        cycle.layers.append(layer)
        cycle.slot_bytes += 2 * B * layer.block_layer_bytes
    groups: dict[int, PoolGroup] = {}
    for cycle in life_cycles:
        group = groups.get(cycle.slot_bytes)
        if group is None:
            group = groups[cycle.slot_bytes] = PoolGroup(len(groups), cycle.slot_bytes, [], [])
        group.life_cycles.append(cycle.id)
        cycle.pool_group = group.id
    pool_groups = sorted(groups.values(), key=lambda g: g.id)
    for group in pool_groups:
        group.window_keys = sorted({int(life_cycles[lc].window_key) for lc in group.life_cycles})
    return life_cycles, pool_groups


def split_quota(quota_bytes: int, pool_groups: list[PoolGroup]) -> list[int]:
    """Slots per pool group for a byte quota: every life cycle gets the same number of slots.

    Solving n * sum(lcs_in_pg * slot_bytes) <= quota for n keeps the split fair between life cycles; a pool
    group holds n slots per life cycle it serves.
    """
    per_unit = sum(len(group.life_cycles) * group.slot_bytes for group in pool_groups)
    n = quota_bytes // per_unit if per_unit else 0
    return [n * len(group.life_cycles) for group in pool_groups]
