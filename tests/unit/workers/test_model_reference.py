"""Our paged model against transformers on the same checkpoint: same logits (fp32, atol 1e-4).

Covers Llama (plain, and with biases + tied embeddings + llama3 RoPE scaling) and Qwen3 with mixed sliding
and full layers, through chunked prefill, step-by-step decode and a mixed batch, with sequences long
enough that sliding-window blocks go stale and are released by the cache.
"""

import pytest
import torch

from tests.support.model_support import hf_logits, make_manager, save_hf_model, step, teacher_forced_logits
from workers.loader import load_model
from workers.model import SeqInput

ATOL = 1e-4
SEQ = [int(x) for x in torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(7))]

CASES = {
    "llama": ("llama", {}),
    "llama-bias-tied-rope3": ("llama", dict(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen3-mixed-swa": ("qwen3", dict(use_sliding_window=True, sliding_window=6, head_dim=32,  # != 64 / 4
                                      layer_types=["full_attention", "sliding_attention", "full_attention"])),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(kind, path, seed=1, **overrides)
    ours, cfg = load_model(str(path), max_seq_len=128)
    return request.param, hf, ours, cfg


def test_config_read_from_the_checkpoint(pair):
    name, hf, _, cfg = pair
    assert cfg.num_layers == 3 and cfg.num_kv_heads == 2
    if name == "qwen3-mixed-swa":
        assert cfg.qk_norm and cfg.layer_windows == (None, 6, None) and cfg.head_dim == 32
    else:
        assert not cfg.qk_norm and cfg.layer_windows == (None, None, None)
    if name == "llama-bias-tied-rope3":
        assert cfg.tie_word_embeddings and cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
        assert cfg.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("chunks", [[40], [5, 7, 9], [3]], ids=["one-shot", "chunked", "short-then-decode"])
def test_logits_match_transformers(pair, chunks):
    _, hf, ours, cfg = pair
    ref = hf_logits(hf, SEQ)
    assert ref.std() > 0.5  # the weights are scaled so this comparison is sensitive
    mgr = make_manager(cfg, max_seq_len=64)
    got = teacher_forced_logits(ours, mgr, SEQ, chunks)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_sliding_window_blocks_are_released(pair):
    name, _, ours, cfg = pair
    if name != "qwen3-mixed-swa":
        pytest.skip("no sliding layer")
    mgr = make_manager(cfg, max_seq_len=64)
    kv = mgr.create_kv_cache("swa", SEQ)
    assert kv.resume()
    step(ours, mgr, kv, SEQ[:30])
    swa_lc = mgr.life_cycle_of_layer(1)
    ids = kv.block_ids(swa_lc)
    # window 6, B 4, history 30: blocks [0, (31 - 6) // 4) = [0, 6) are stale and must be gone
    assert ids[:6] == [-1] * 6 and all(i >= 0 for i in ids[6:])
    assert all(i >= 0 for i in kv.block_ids(mgr.life_cycle_of_layer(0)))
    kv.close()


def test_mixed_batch_matches_transformers(pair):
    """A decode of one request and prefill chunks of two others in one forward."""
    _, hf, ours, cfg = pair
    mgr = make_manager(cfg, max_seq_len=64, reuse=False)
    a, b, c = SEQ, SEQ[::-1], [(t * 7 + 3) % 97 for t in SEQ]
    kva, kvb, kvc = (mgr.create_kv_cache(n, s) for n, s in (("a", a), ("b", b), ("c", c)))
    assert kva.resume() and kvb.resume() and kvc.resume()
    step(ours, mgr, kva, a[:20])
    step(ours, mgr, kvb, b[:9])
    for kv, n in ((kva, 1), (kvb, 11), (kvc, 17)):
        assert kv.resize(kv.history_length + n)
    seqs = [SeqInput(a[20:21], 20, kva), SeqInput(b[9:20], 9, kvb, all_logits=True), SeqInput(c[:17], 0, kvc)]
    la, lb, lc = ours(seqs, mgr)
    assert la.shape == (cfg.vocab_size,) and lb.shape == (11, cfg.vocab_size) and lc.shape == (cfg.vocab_size,)
    torch.testing.assert_close(la, hf_logits(hf, a[:21])[20], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, hf_logits(hf, b[:20])[9:20], atol=ATOL, rtol=0)
    torch.testing.assert_close(lc, hf_logits(hf, c[:17])[16], atol=ATOL, rtol=0)


def test_prefix_reuse_matches_transformers(pair):
    """A second request reusing the first one's blocks (partially) gets the same logits as a cold run."""
    _, hf, ours, cfg = pair
    mgr = make_manager(cfg, max_seq_len=64)
    kv = mgr.create_kv_cache("first", SEQ[:30])
    assert kv.resume()
    step(ours, mgr, kv, SEQ[:30])
    kv.close()
    prompt = SEQ[:23] + [5, 6, 7, 8]
    kv2 = mgr.create_kv_cache("second", prompt)
    assert kv2.num_reused_tokens > 0
    assert kv2.resume()
    got = step(ours, mgr, kv2, prompt[kv2.history_length:], all_logits=True)
    ref = hf_logits(hf, prompt)[kv2.num_reused_tokens:]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    kv2.close()


def test_batched_decodes_of_different_lengths_match_transformers(pair):
    """Several one-token sequences attended in one padded batch; the cache starts as NaN garbage."""
    _, hf, ours, cfg = pair
    mgr = make_manager(cfg, max_seq_len=64, reuse=False)
    for layer in range(cfg.num_layers):
        for t in mgr.layer_kv(layer):
            t.fill_(float("nan"))  # never-written slot memory must never reach the logits
    lengths = [7, 23, 35, 1]
    seqs = [[(t + 11 * i) % 97 for t in SEQ[: n + 1]] for i, n in enumerate(lengths)]
    kvs = []
    for i, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        kv = mgr.create_kv_cache(f"d{i}", s)
        assert kv.resume()
        step(ours, mgr, kv, s[:n])
        assert kv.resize(n + 1)
        kvs.append(kv)
    got = ours([SeqInput(s[n:n + 1], n, kv) for s, n, kv in zip(seqs, lengths, kvs, strict=True)], mgr)
    for s, n, g in zip(seqs, lengths, got, strict=True):
        assert not g.isnan().any()
        torch.testing.assert_close(g, hf_logits(hf, s)[n], atol=ATOL, rtol=0)
