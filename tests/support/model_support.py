"""Helpers shared by the model tests (no tests here): tiny transformers checkpoints, caches, greedy loops.

Random transformers models are re-initialised with unit-scale weights, so logits spread over several units
and an atol of 1e-4 is a real check (transformers' default init gives logits near zero).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from kvcache import KVCacheManager
from workers.config import CacheSettings, ModelConfig
from workers.loader import kv_cache_config
from workers.model import Model, SeqInput
from workers.sampling import sample
from workers.sampling_params import SamplingParams

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def unit_scale_(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter: norms ~1, biases small, matrices with unit-variance outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("norm.weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def save_hf_model(kind: str, path: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Build a random `LlamaForCausalLM` / `Qwen3ForCausalLM`, save it (safetensors) to `path`, return it."""
    import transformers

    kw = {**TINY, **overrides}
    if kind == "llama":
        cfg = transformers.LlamaConfig(**kw)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**kw)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    unit_scale_(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def make_manager(cfg: ModelConfig, *, tp_size: int = 1, tokens_per_block: int = 4, max_seq_len: int = 128,
                 kv_cache_bytes: int = 1 << 20, host_cache_bytes: int = 0, reuse: bool = True,
                 dtype: torch.dtype = torch.float32) -> KVCacheManager:
    cache = CacheSettings(tokens_per_block=tokens_per_block, max_seq_len=max_seq_len, kv_cache_bytes=kv_cache_bytes,
                          host_cache_bytes=host_cache_bytes, enable_block_reuse=reuse, enable_partial_reuse=reuse)
    return KVCacheManager(kv_cache_config(cfg, tp_size, cache, dtype=dtype))


def step(model: Model, mgr: KVCacheManager, kv, tokens: list[int], all_logits: bool = False) -> torch.Tensor:
    """Resize, run one forward of `tokens` for one request, commit; returns its logits."""
    assert kv.resize(kv.history_length + len(tokens))
    out = model([SeqInput(tokens, kv.history_length, kv, all_logits)], mgr)[0]
    kv.commit(tokens)
    return out


def teacher_forced_logits(model: Model, mgr: KVCacheManager, tokens: list[int], chunks: list[int],
                          request_id: str = "r") -> torch.Tensor:
    """Logits of every position of `tokens`: prefill in `chunks` (sizes), then one token per step."""
    kv = mgr.create_kv_cache(request_id, tokens)
    assert kv.resume()
    out = []
    pos = kv.history_length
    assert pos == 0, "teacher forcing wants a cold cache"
    for n in chunks:
        out.append(step(model, mgr, kv, tokens[pos:pos + n], all_logits=True))
        pos += n
    while pos < len(tokens):
        out.append(step(model, mgr, kv, [tokens[pos]])[None])
        pos += 1
    kv.close()
    return torch.cat(out)


def greedy(model: Model, mgr: KVCacheManager, prompt: list[int], n: int, request_id: str = "g",
           chunk: int | None = None) -> list[int]:
    """Greedy-generate `n` tokens (prefill from the reused prefix, in chunks of `chunk`)."""
    kv = mgr.create_kv_cache(request_id, prompt)
    assert kv.resume()
    pos = kv.history_length
    chunk = chunk or len(prompt)
    while pos < len(prompt):
        logits = step(model, mgr, kv, prompt[pos:pos + chunk])
        pos = kv.history_length
    params = SamplingParams(temperature=0)
    out: list[int] = []
    for _ in range(n):
        t = sample(logits[None], [params], [None])[0]
        out.append(t)
        if len(out) < n:
            logits = step(model, mgr, kv, [t])
    kv.close()
    return out
