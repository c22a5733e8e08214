"""The decoder: a Llama / Qwen2 / Qwen3 / Mistral-family transformer whose attention is paged through kvcache.

Dense layers see every scheduled token of every sequence at once, as one flat `[T, hidden]` tensor; only
attention loops over sequences. Attention writes the new tokens' K/V into the rank's KV cache through the
request's block ids and reads every past token through the same ids, so prefill in chunks, decode, prefix
reuse, offload/onboard and sliding windows all look alike here: a sequence is `start_pos` cached tokens plus
`len(tokens)` new ones. Per-layer sliding windows follow transformers: a query at position `i` sees keys
`j` with `i - w < j <= i`; a block that is wholly outside every new token's window may be stale (id -1) and is
never touched. The model never commits to the cache: the caller commits after `forward` returns.

Tensor parallelism: each rank holds `num_heads / tp` query heads and `num_kv_heads / tp` KV heads (its KV
cache holds only those), q/k/v and gate/up are column-parallel, o/down row-parallel with an all-reduce, and
the embedding and LM head are replicated, so every tp rank returns the same logits. q/k/v and gate/up each run
as one matmul over their stacked weights (workers/parallel.py `Stacked`), under the checkpoint's own names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.config import ModelConfig
from workers.cpu_kernels import cpu_decode_kernel, cpu_ops_for, cpu_paged_write
from workers.paged_batch import Batch, DecodePlan, SeqView
from workers.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, Stacked, param

NO_LSE = torch.empty(0)  # the kernel's `lse` where no log-sum-exp is wanted


@dataclass
class SeqInput:
    """One sequence's share of a forward pass.

    tokens: the new tokens to process (at least one). start_pos: tokens already in the cache; must equal
    `kv.history_length`. kv: the request's `kvcache` KVCache, resumed and resized to at least
    `start_pos + len(tokens)`. all_logits: return the logits of every new position ([n, V]) instead of only
    the last one ([V]).
    """

    tokens: list[int]
    start_pos: int
    kv: Any
    all_logits: bool = False


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, as transformers' Llama/Qwen3 do (weight * normed.to(input dtype))."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = param((dim,), None)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = cpu_ops_for(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # torch's one kernel: the same bits as the ops below, half their time
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before this norm and the norm, in one pass where the fused operator applies (it
        writes both in place): (norm of the sum, the sum)."""
        ops = cpu_ops_for(x)
        if ops is not None and residual.is_contiguous():
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half layout), with optional linear / llama3 frequency scaling."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", "default")
        if rope_type == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling (transformers' `_compute_llama3_parameters`)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


_ACTIVATIONS = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None):
        super().__init__()
        D = cfg.head_dim
        self.layer_id = layer_id
        self.head_dim = D
        self.num_heads = cfg.num_heads // tp_size
        self.num_kv_heads = cfg.num_kv_heads // tp_size
        self.scale = D**-0.5
        self.window = cfg.window_of_layer(layer_id)
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * D, cfg.qkv_bias, tp_rank, tp_size)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * D, cfg.qkv_bias, tp_rank, tp_size)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * D, cfg.qkv_bias, tp_rank, tp_size)
        self.qkv_proj = Stacked(self.q_proj, self.k_proj, self.v_proj)
        self.o_proj = RowParallelLinear(cfg.num_heads * D, cfg.hidden_size, cfg.o_bias, tp_rank, tp_size, group)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.paged_kernel = True  # decode attention through cpu_decode_kernel where it applies (benchmarks turn it off)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch) -> torch.Tensor:
        T, Hq, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.stacked(x)
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        ops = cpu_ops_for(qkv) if self.q_norm is None else None
        if ops is not None:  # q and k rotated in place, in one operator
            ops.rope_(qkv, Hq + Hkv, D, cos, sin)
            q, k = qkv[:, :Hq * D].view(T, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
        elif self.q_norm is None:  # q and k side by side in one rope call (half the small operators a layer)
            qk = apply_rope(qkv[:, :(Hq + Hkv) * D].view(T, Hq + Hkv, D), cos, sin)
            q, k = qk[:, :Hq], qk[:, Hq:]
        else:
            q, k = qkv[:, :Hq * D].view(T, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
            q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        out = self._paged_attention(q, k, v, batch)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))

    def _paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch) -> torch.Tensor:
        k_cache, v_cache = batch.mgr.layer_kv(self.layer_id)
        lc = batch.mgr.life_cycle_of_layer(self.layer_id)
        if tuple(k_cache.shape[2:]) != (self.num_kv_heads, self.head_dim):
            raise RuntimeError(
                f"layer {self.layer_id}: KV cache holds {tuple(k_cache.shape[2:])} (heads, head_dim) "
                f"per token, this rank's attention needs {(self.num_kv_heads, self.head_dim)}"
            )
        out = torch.empty_like(q)
        if batch.decodes:
            self._decode_attention(q, k, v, k_cache, v_cache, batch.decode_plan(lc, self.window), out)
        for s in batch.prefills:
            p = batch.plan(s, lc, self.window)
            rows = slice(s.offset, s.offset + s.n)
            self._write(k[rows], v[rows], k_cache, v_cache, p.write_slots, p.write_offsets)
            keys = k_cache[p.read_slots].reshape(-1, self.num_kv_heads, self.head_dim)
            vals = v_cache[p.read_slots].reshape(-1, self.num_kv_heads, self.head_dim)
            keys = keys[p.key_lo : p.key_lo + p.key_len].to(q.dtype).transpose(0, 1)  # [Hkv, L, D]
            vals = vals[p.key_lo : p.key_lo + p.key_len].to(q.dtype).transpose(0, 1)
            # with a batch dimension: 3-D inputs take SDPA's math path on CPU (bmm, softmax and mask ops; 4.5x
            # the time at 1,024 tokens), 4-D ones its flash kernel, GQA and mask included (bench/README.md)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None],
                keys[None],
                vals[None],
                attn_mask=p.mask,
                is_causal=p.causal,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[rows] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
               offsets: torch.Tensor) -> None:
        """The new tokens' K and V into their blocks: on CPU fp32 by our writer (torch's two-index index_put was
        ~3% of a 64-sequence decode step), elsewhere by torch."""
        if k.dtype == k_cache.dtype == torch.float32 and k.device.type == "cpu":
            write = cpu_paged_write()
            if write is not None:
                write(k, v, k_cache, v_cache, slots, offsets)
                return
        k_cache[slots, offsets] = k.to(k_cache.dtype)
        v_cache[slots, offsets] = v.to(v_cache.dtype)

    def _decode_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        d: DecodePlan,
        out: torch.Tensor,
    ) -> None:
        """One query per sequence: write its K/V, then on CPU (fp32) read every sequence's blocks in place with
        our kernel (workers/cpu_kernels.py); elsewhere gather them padded for one SDPA call."""
        rows = d.rows if d.rows.shape[0] < q.shape[0] else slice(None)  # all decodes: views, not index copies
        self._write(k[rows], v[rows], k_cache, v_cache, d.write_slots, d.write_offsets)
        if self.paged_kernel and q.device.type == "cpu" and q.dtype == k_cache.dtype == torch.float32:
            kernel = cpu_decode_kernel()
            if kernel is not None:
                qd = q[rows].contiguous()
                if d.shared is None:
                    out[rows] = kernel(qd, k_cache, v_cache, d.table, d.key_lo, d.key_len, self.scale, NO_LSE)
                else:
                    out[rows] = self._cascade(qd, k_cache, v_cache, d, kernel)
                return
        S, H, D = d.table.shape[0], self.num_kv_heads, self.head_dim
        # padding and unwritten slot memory may hold anything, NaN included: zero it, then mask it. In place on
        # the gathered copy, and only where invalid: a full masked_fill pass was a third of a decode step on CPU
        keys = k_cache[d.table].reshape(S, -1, H, D).to(q.dtype)
        vals = v_cache[d.table].reshape(S, -1, H, D).to(q.dtype)
        keys[d.invalid] = 0.0
        vals[d.invalid] = 0.0
        o = F.scaled_dot_product_attention(
            q[rows][:, :, None, :],  # [S, Hq, 1, D]
            keys.transpose(1, 2),  # [S, Hkv, L, D]
            vals.transpose(1, 2),
            attn_mask=d.valid[:, None, None, :],
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out[rows] = o[:, :, 0, :]

    def _cascade(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, d: DecodePlan,
                 kernel: Any) -> torch.Tensor:
        """Decode attention where groups of the sequences share a prefix's blocks (`d.shared`): the kernel reads
        each sequence's own keys past its group's prefix, and each group's prefix once for all its members'
        queries (a group one sequence to the kernel, each kv head's queries every member's query heads of it),
        and each member's two parts are merged by their log-sum-exps. The same attention, each shared key read
        once a step, not once a member. (Gathering each prefix for torch's flash attention instead took 1.12x
        this path's time: 64 sequences, 4 prefixes of 512 tokens, alternated in process; bench/README.md.)"""
        sp = d.shared
        S, Hq, D = q.shape
        Hkv, G = self.num_kv_heads, Hq // self.num_kv_heads
        lse = torch.empty(S, Hq)
        out = kernel(q, k_cache, v_cache, d.table, sp.suffix_lo, sp.suffix_len, self.scale, lse)
        n, M = sp.members.shape
        qg = q[sp.members].view(n, M, Hkv, G, D).transpose(1, 2).reshape(n, Hkv * M * G, D)
        lse_p = torch.empty(n, Hkv * M * G)
        o = kernel(qg, k_cache, v_cache, sp.slots, sp.prefix_lo, sp.prefix_len, self.scale, lse_p)
        o = o.view(n, Hkv, M, G, D).transpose(1, 2).reshape(n, M, Hq, D)[sp.member_valid]  # [members, Hq, D]
        lse_p = lse_p.view(n, Hkv, M, G).transpose(1, 2).reshape(n, M, Hq)[sp.member_valid]
        lse_s = lse[sp.rows]
        top = torch.maximum(lse_p, lse_s)
        w_p, w_s = (lse_p - top).exp_(), (lse_s - top).exp_()
        out[sp.rows] = (o * w_p[..., None] + out[sp.rows] * w_s[..., None]) / (w_p + w_s)[..., None]
        return out


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = ColumnParallelLinear(h, i, b, tp_rank, tp_size)
        self.up_proj = ColumnParallelLinear(h, i, b, tp_rank, tp_size)
        self.gate_up_proj = Stacked(self.gate_proj, self.up_proj)
        self.down_proj = RowParallelLinear(i, h, b, tp_rank, tp_size, group)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.silu = cfg.hidden_act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.stacked(x)
        ops = cpu_ops_for(gate_up) if self.silu else None
        if ops is not None:
            return self.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.gate_up_proj.sizes, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id, tp_rank, tp_size, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp_rank, tp_size, group)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the last layer's MLP output, whose residual add waits for this layer's first norm (one fused
        pass, as vLLM's layers do), or the embeddings with `residual` None. Returns this layer's MLP output
        and the residual stream before it."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add(x, residual)
        x, residual = self.post_attention_layernorm.add(self.self_attn(x, cos, sin, batch), residual)
        return self.mlp(x), residual


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = param((vocab_size, dim), None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig, tp_rank: int, tp_size: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp_rank, tp_size, group) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Model(nn.Module):
    """A causal LM whose parameter names match transformers' `*ForCausalLM` checkpoints.

    Build it through `workers.loader.load_model`, which fills the weights (the constructor leaves them
    uninitialised). With `tp_size > 1` the process must be in a torch.distributed group of `tp_size` ranks
    (`workers.parallel.init_tp_group`), or pass `group`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        max_seq_len: int | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        cfg.check_tp(tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
        if tp_size > 1:
            if not dist.is_initialized():
                raise RuntimeError(f"tp_size={tp_size} needs torch.distributed: call workers.parallel.init_tp_group")
            size = dist.get_world_size(group)
            if size != tp_size or dist.get_rank(group) != tp_rank:
                raise RuntimeError(
                    f"tp group mismatch: the process group has rank {dist.get_rank(group)} of "
                    f"{size}, the model was asked for rank {tp_rank} of {tp_size}"
                )
        self.config = cfg
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.max_seq_len = int(max_seq_len or cfg.max_position_embeddings)
        self.model = DecoderStack(cfg, tp_rank, tp_size, group)
        self.lm_head = ReplicatedLinear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], kv_manager: Any) -> list[torch.Tensor]:
        """Run the new tokens of every sequence; write their K/V into the cache; return fp32 logits.

        `kv_manager` is the rank's `kvcache.KVCacheManager`: its `layer_kv(layer_id)` gives the primary-tier
        K/V tensors [slots, tokens_per_block, kv_heads_per_rank, head_dim] and `life_cycle_of_layer` picks
        which of `kv.block_ids(lc)` a layer uses. Returns, per sequence, logits [V] of its last new token, or
        [n, V] for every new token when `all_logits`. Does not commit: call `kv.commit(tokens)` afterwards.
        """
        if not seqs:
            raise ValueError("forward needs at least one sequence")
        dev = self.device
        vocab = self.config.vocab_size
        flat: list[int] = []
        views: list[SeqView] = []
        for i, s in enumerate(seqs):
            n = len(s.tokens)
            if n == 0:
                raise ValueError(f"sequence {i}: no new tokens")
            if min(s.tokens) < 0 or max(s.tokens) >= vocab:
                bad = next(t for t in s.tokens if not 0 <= t < vocab)
                raise ValueError(f"sequence {i}: token id {bad} is outside the vocabulary [0, {vocab})")
            if s.start_pos != s.kv.history_length:
                raise ValueError(
                    f"sequence {i}: start_pos {s.start_pos} != the cache's history_length {s.kv.history_length}"
                )
            if s.start_pos + n > self.max_seq_len:
                raise ValueError(f"sequence {i}: {s.start_pos + n} tokens exceed max_seq_len {self.max_seq_len}")
            if s.kv.capacity < s.start_pos + n:
                raise ValueError(
                    f"sequence {i}: cache capacity {s.kv.capacity} < {s.start_pos + n} tokens; resize it before forward"
                )
            views.append(
                SeqView(
                    len(flat),
                    n,
                    s.start_pos,
                    s.kv,
                    torch.arange(s.start_pos, s.start_pos + n, device=dev),
                    {},
                )
            )
            flat.extend(s.tokens)
        batch = Batch(views, kv_manager, dev)

        ids = torch.tensor(flat, dtype=torch.long, device=dev)
        positions = torch.cat([v.positions for v in views])
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        h, residual = self.model.embed_tokens(ids), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos, sin, batch)

        rows: list[int] = []
        for s, v in zip(seqs, views, strict=True):
            rows.extend(range(v.offset, v.offset + v.n) if s.all_logits else [v.offset + v.n - 1])
        at = torch.tensor(rows, device=dev)
        logits = self.lm_head(self.model.norm.add(h[at], residual[at])[0]).float()
        out: list[torch.Tensor] = []
        r = 0
        for s, v in zip(seqs, views, strict=True):
            if s.all_logits:
                out.append(logits[r : r + v.n])
                r += v.n
            else:
                out.append(logits[r])
                r += 1
        return out
