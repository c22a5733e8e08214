"""Helpers for the GGUF tests (no tests here): tiny GGUF files written from HF-layout weights, and the
transformers reference for the packaged SmolLM2 file, loaded once per session (import the fixtures)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from workers.config import ModelConfig

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, model_type="llama", rms_norm_eps=1e-5, rope_theta=100000.0,
                   max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q/K rows (written from its description, the inverse of ours)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def tiny_hf_weights(cfg: ModelConfig = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    out = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g),
           "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                  "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                  "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
        for name, shape in shapes.items():
            out[p + name] = torch.randn(*shape, generator=g) / shape[1] ** 0.5
        out[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        out[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    return out


GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight"}


def write_gguf(path: Path, weights: dict[str, torch.Tensor], cfg: ModelConfig = TINY, *, arch: str = "llama",
               quant: str = "F32", skip: tuple[str, ...] = (), rope_scaling: tuple[str, float] | None = None) -> Path:
    """A GGUF file in llama.cpp's layout: GGUF names, Q/K permuted, 2-D tensors stored as `quant`;
    `rope_scaling` = (rope.scaling.type, factor)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    qtype = gguf.GGMLQuantizationType[quant]
    for name, t in weights.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[rest]}"
            if rest == "self_attn.q_proj.weight":
                t = llama_cpp_permute(t, cfg.num_heads)
            elif rest == "self_attn.k_proj.weight":
                t = llama_cpp_permute(t, cfg.num_kv_heads)
        if gname in skip:
            continue
        data = t.numpy().astype(np.float32)
        if data.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            try:
                raw = gguf.quants.quantize(data, qtype)
            except NotImplementedError:  # a type gguf only reads: zero blocks of the right size will do
                block, size = gguf.GGML_QUANT_SIZES[qtype]
                raw = np.zeros((data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(gname, raw, raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- the transformers reference for the packaged SmolLM2 file (slow tests) -------------------------------------

@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from workers.gguf_model import packaged_gguf

    try:
        return packaged_gguf("smollm2-135m-instruct")
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
    """transformers' own GGUF loader on the same file, in fp32: the reference for logits and generation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()


def hf_greedy(hf_model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generation; the ids it produced, EOS included when it stopped on one."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()
