"""The built-in model through the real kvcache: reuse on/off, suspend/offload/resume, batching, bad input."""

import pytest
import torch
import torch.nn.functional as F

from tests.support.model_support import greedy, make_manager, step, teacher_forced_logits
from workers.loader import load_model
from workers.model import SeqInput
from workers.model_setting import load_tokenizer
from workers.sampling import sample
from workers.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def builtin():
    model, cfg = load_model(None, max_seq_len=256)
    return model, cfg


PROMPT = load_tokenizer(None).encode("The quick brown fox jumps over the lazy dog. " * 2)


def test_builtin_model_shape(builtin):
    model, cfg = builtin
    assert cfg.num_layers == 4 and cfg.hidden_size == 128 and cfg.num_heads == 4 and cfg.num_kv_heads == 2
    assert cfg.head_dim == 32 and cfg.qk_norm and cfg.vocab_size == load_tokenizer(None).vocab_size
    assert [cfg.window_of_layer(i) for i in range(4)] == [None, 64, None, None]


def test_builtin_model_is_deterministic_per_seed():
    a, _ = load_model(None, seed=3)
    b, _ = load_model(None, seed=3)
    c, _ = load_model(None, seed=4)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_greedy_is_identical_with_block_reuse_on_and_off(builtin):
    """Long enough (> window 64 + a few blocks) that the sliding layer's blocks go stale."""
    model, cfg = builtin
    off = make_manager(cfg, max_seq_len=256, reuse=False)
    on = make_manager(cfg, max_seq_len=256, reuse=True)
    want = greedy(model, off, PROMPT, 40, chunk=16)
    first = greedy(model, on, PROMPT, 40, "first", chunk=16)
    # the second run on the warm cache reuses the prompt's blocks (and the first run's generated ones)
    kv = on.create_kv_cache("probe", PROMPT)
    reused = kv.num_reused_tokens
    kv.close()
    second = greedy(model, on, PROMPT, 40, "second", chunk=16)
    assert reused == len(PROMPT) - 1
    assert first == want and second == want
    assert len(set(want)) > 3  # not a degenerate constant output


def test_suspended_and_offloaded_request_resumes_with_the_same_tokens(builtin):
    model, cfg = builtin
    ref = greedy(model, make_manager(cfg, max_seq_len=256, reuse=False), PROMPT, 30)

    # primary holds ~36 blocks per life cycle: not enough for both requests, so A must go to the host tier
    mgr = make_manager(cfg, max_seq_len=128, reuse=False, kv_cache_bytes=36 * 4 * cfg.kv_bytes_per_token(),
                       host_cache_bytes=1 << 20)
    mgr.get_iteration_stats()
    kv = mgr.create_kv_cache("A", PROMPT)
    assert kv.resume()
    logits = step(model, mgr, kv, PROMPT)
    params = SamplingParams(temperature=0)
    out = []
    for i in range(30):
        t = sample(logits[None], [params], [None])[0]
        out.append(t)
        if i == 10:
            kv.suspend()
            other = mgr.create_kv_cache("B", list(range(100, 200)))
            assert other.resume()
            step(model, mgr, other, list(range(100, 200)))
            other.close()
            assert kv.resume()
        if i < 29:
            logits = step(model, mgr, kv, [t])
    kv.close()
    totals = {}
    for bucket in mgr.get_iteration_stats().to_dict()["kvCacheIterationStats"].values():
        for k in ("iterOffloadBlocks", "iterOnboardBlocks"):
            totals[k] = totals.get(k, 0) + bucket[k]
    assert totals["iterOffloadBlocks"] > 0 and totals["iterOnboardBlocks"] > 0, totals
    assert out == ref


def test_batched_forward_equals_separate_forwards(builtin):
    model, cfg = builtin
    prompts = [PROMPT[:30], PROMPT[5:50], PROMPT[:7]]
    mgr = make_manager(cfg, max_seq_len=256, reuse=False)
    alone = []
    for i, p in enumerate(prompts):
        kv = mgr.create_kv_cache(f"alone{i}", p)
        assert kv.resume()
        alone.append(step(model, mgr, kv, p))
        kv.close()
    kvs = [mgr.create_kv_cache(f"batch{i}", p) for i, p in enumerate(prompts)]
    for kv, p in zip(kvs, prompts, strict=True):
        assert kv.resume() and kv.resize(len(p))
    batched = model([SeqInput(p, 0, kv) for p, kv in zip(prompts, kvs, strict=True)], mgr)
    for a, b in zip(alone, batched, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_forward_rejects_bad_input(builtin):
    model, cfg = builtin
    mgr = make_manager(cfg, max_seq_len=256, reuse=False)
    kv = mgr.create_kv_cache("bad", PROMPT)
    assert kv.resume() and kv.resize(8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model([SeqInput([1, cfg.vocab_size], 0, kv)], mgr)
    with pytest.raises(ValueError, match="start_pos 3 != the cache's history_length 0"):
        model([SeqInput([1, 2], 3, kv)], mgr)
    with pytest.raises(ValueError, match="capacity 8 < 9"):
        model([SeqInput(list(range(9)), 0, kv)], mgr)
    with pytest.raises(ValueError, match="no new tokens"):
        model([SeqInput([], 0, kv)], mgr)
    with pytest.raises(ValueError, match="at least one sequence"):
        model([], mgr)
    assert kv.history_length == 0  # nothing was committed


def test_kv_cache_of_another_model_is_rejected(builtin):
    model, cfg = builtin
    other = cfg.with_windows([None] * 4)
    from dataclasses import replace

    mgr = make_manager(replace(other, num_kv_heads=4, num_heads=4), max_seq_len=256, reuse=False)
    kv = mgr.create_kv_cache("x", [1, 2, 3])
    assert kv.resume() and kv.resize(3)
    with pytest.raises(RuntimeError, match="KV cache holds"):
        model([SeqInput([1, 2, 3], 0, kv)], mgr)


def decode_together(model, mgr, kvs: list, steps: int, stride: int) -> list[torch.Tensor]:
    """`steps` decode steps of every sequence in one batch (sequence i's n-th token (stride * n + i) % 200 + 1),
    committed after each: the batch's logits per step."""
    runs = []
    for n in range(steps):
        for kv in kvs:
            assert kv.resize(kv.history_length + 1)
        toks = [[(stride * n + i) % 200 + 1] for i in range(len(kvs))]
        runs.append(torch.stack(model([SeqInput(t, kv.history_length, kv) for t, kv in zip(toks, kvs, strict=True)],
                                      mgr)))
        for t, kv in zip(toks, kvs, strict=True):
            kv.commit(t)
    return runs


def test_decode_attention_in_place_equals_the_gather(builtin):
    """The CPU kernel that reads the cache's blocks in place (workers/cpu_kernels.py) against the gather +
    SDPA path, on a decode batch of sequences of different lengths, one past the sliding layer's window (its
    first blocks stale): the same logits, step after step. The kernel must build here (CI has a compiler)."""
    from workers.cpu_kernels import cpu_decode_kernel

    assert cpu_decode_kernel() is not None
    model, cfg = builtin
    prompts = [PROMPT[:90], PROMPT[3:40], PROMPT[:9]]  # 90 + decode steps > window 64: stale blocks
    logits = {}
    for on in (True, False):
        for layer in model.model.layers:
            layer.self_attn.paged_kernel = on
        mgr = make_manager(cfg, max_seq_len=256, reuse=False)
        kvs = [mgr.create_kv_cache(f"r{i}", p) for i, p in enumerate(prompts)]
        for kv, p in zip(kvs, prompts, strict=True):
            step(model, mgr, kv, p)
        logits[on] = decode_together(model, mgr, kvs, 6, 7)
    for layer in model.model.layers:
        layer.self_attn.paged_kernel = True
    for a, b in zip(logits[True], logits[False], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block,head_dim,kv_heads,group,seqs",
                         [(16, 64, 3, 3, 5), (8, 64, 2, 2, 1), (32, 128, 2, 4, 3), (16, 48, 1, 1, 2)])
def test_decode_kernel_equals_sdpa_over_a_block_table(block, head_dim, kv_heads, group, seqs):
    """The kernel alone, on the shapes its fast paths take and those they leave to the plain loop (16-key tiles
    need a block of a multiple of 16 tokens; registers hold a head of 64 or 128): each sequence's keys from a
    first position inside its first block, its blocks scattered over a cache whose free slots hold NaN."""
    from workers.cpu_kernels import cpu_decode_kernel

    kernel = cpu_decode_kernel()
    assert kernel is not None
    g = torch.Generator().manual_seed(block + head_dim + seqs)
    width = 7
    slots = seqs * width + 3
    k_cache = torch.full((slots, block, kv_heads, head_dim), float("nan"))
    v_cache = torch.full((slots, block, kv_heads, head_dim), float("nan"))
    table = torch.randperm(slots, generator=g)[: seqs * width].view(seqs, width).contiguous()
    lo = torch.randint(0, block, (seqs,), generator=g)
    length = torch.randint(1, width * block - block, (seqs,), generator=g)
    q = torch.randn(seqs, kv_heads * group, head_dim, generator=g)
    for s in range(seqs):
        for p in range(int(lo[s]), int(lo[s] + length[s])):
            slot, off = table[s, p // block], p % block
            k_cache[slot, off] = torch.randn(kv_heads, head_dim, generator=g)
            v_cache[slot, off] = torch.randn(kv_heads, head_dim, generator=g)
    lse = torch.empty(seqs, kv_heads * group)
    out = kernel(q, k_cache, v_cache, table, lo, length, head_dim**-0.5, lse)
    torch.testing.assert_close(kernel(q, k_cache, v_cache, table, lo, length, head_dim**-0.5, torch.empty(0)), out)
    for s in range(seqs):
        keys = k_cache[table[s]].reshape(-1, kv_heads, head_dim)[lo[s] : lo[s] + length[s]].transpose(0, 1)
        vals = v_cache[table[s]].reshape(-1, kv_heads, head_dim)[lo[s] : lo[s] + length[s]].transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[s][:, None, :], keys, vals, scale=head_dim**-0.5,
                                             enable_gqa=group > 1)[:, 0, :]
        torch.testing.assert_close(out[s], ref, atol=1e-5, rtol=1e-5)
        scores = q[s].view(kv_heads, group, head_dim) @ keys.transpose(1, 2) * head_dim**-0.5  # [Hkv, G, L]
        torch.testing.assert_close(lse[s], scores.logsumexp(-1).reshape(-1), atol=1e-5, rtol=1e-5)


def test_paged_write_puts_each_new_token_where_index_put_does_and_refuses_a_slot_outside_the_cache():
    from workers.cpu_kernels import cpu_paged_write

    write = cpu_paged_write()
    assert write is not None
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(6, 2, 2, 16, 3, 8, generator=g)  # every layer's K and V of a block in one slot
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    qkv = torch.randn(4, (6 + 3 + 3) * 8, generator=g)  # the new tokens' q, k, v side by side
    k, v = qkv[:, 48:72].view(4, 3, 8), qkv[:, 72:].view(4, 3, 8)
    slots, offsets = torch.tensor([5, 0, 5, 2]), torch.tensor([0, 15, 1, 7])
    want = pool.clone()
    want[:, 1, 0][slots, offsets] = k
    want[:, 1, 1][slots, offsets] = v
    write(k, v, k_cache, v_cache, slots, offsets)
    assert torch.equal(pool, want)  # the other layers' and blocks' bytes untouched
    with pytest.raises(RuntimeError, match="paged_write: row 1 goes to slot 6 offset 0, outside the cache's 6 slots"):
        write(k[:2], v[:2], k_cache, v_cache, torch.tensor([0, 6]), torch.tensor([0, 0]))
    assert torch.equal(pool, want)  # refused before any byte was written


def test_a_shared_prefix_attended_once_per_group_gives_the_same_logits(builtin, monkeypatch):
    """Cascade decode attention (paged_batch.SharedPrefixes): sequences reusing a prefix's blocks from the cache,
    in two groups of different prefix lengths and beside one that shares nothing, decode step after step with
    each group's prefix attended once and merged with each member's own keys, against every sequence read
    whole by the kernel: the same logits. The sliding layer's sequences are never grouped (its window)."""
    import workers.paged_batch as paged_batch
    from workers.model import Attention

    model, cfg = builtin
    tok = load_tokenizer(None)
    long, short = PROMPT * 2, tok.encode("Pack my box with five dozen liquor jugs. " * 2)
    prompts = [long + [7 + i] for i in range(3)] + [short[:24] + [9 + i] for i in range(2)] + [PROMPT[5:30]]
    cascades = []
    original = Attention._cascade

    def counted(self, *args):
        cascades.append(len(args[3].shared.rows))
        return original(self, *args)

    monkeypatch.setattr(Attention, "_cascade", counted)
    logits = {}
    for cascade in (True, False):
        monkeypatch.setattr(paged_batch, "CASCADE_MIN_KEYS", 0 if cascade else 10**9)
        mgr = make_manager(cfg, max_seq_len=256, reuse=True)
        kvs = []
        for i, p in enumerate(prompts):  # one after another: each finds its group's prefix published
            kv = mgr.create_kv_cache(f"r{i}", p)
            assert kv.resume()
            step(model, mgr, kv, p[kv.history_length:])
            kvs.append(kv)
        assert all(kvs[i].num_reused_tokens >= 24 for i in (1, 2, 4))  # their group's prefix, from the cache
        logits[cascade] = decode_together(model, mgr, kvs, 5, 5)
    assert cascades and set(cascades) == {5}  # both groups' members, every step, on the full-attention layers
    for a, b in zip(logits[True], logits[False], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_prompt_from_position_0_attends_causally_without_a_mask_and_gives_the_masked_logits(builtin, monkeypatch):
    """A whole prompt from position 0 takes SDPA's is_causal (no mask built); a prompt in chunks masks every
    chunk after the first. Every position's logits agree, the sliding layer's window (64) included."""
    import workers.model as model_module

    model, cfg = builtin
    tokens = (PROMPT * 4)[:60]  # within the window: the window does not shape the mask
    calls = []
    real = F.scaled_dot_product_attention

    def sdpa(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", sdpa)
    whole = teacher_forced_logits(model, make_manager(cfg, max_seq_len=256, reuse=False), tokens, [60])
    assert calls and all(causal and not masked for causal, masked in calls[:cfg.num_layers])
    calls.clear()
    chunked = teacher_forced_logits(model, make_manager(cfg, max_seq_len=256, reuse=False), tokens, [7, 20, 33])
    first, later = calls[:cfg.num_layers], calls[cfg.num_layers:2 * cfg.num_layers]
    assert all(c and not m for c, m in first) and all(m and not c for c, m in later)
    torch.testing.assert_close(whole, chunked, atol=1e-5, rtol=1e-5)
