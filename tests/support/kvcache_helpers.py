"""Small builders shared by the kvcache tests."""

import torch

from kvcache import AttentionLayerConfig, KVCacheManager, KVCacheManagerConfig
from kvcache.events import key_of

SLOT = 2 << 20  # one slot of the spec's worked examples: 2 * 4 tokens * 128 heads * 1024 dims * 2 bytes


def spec_manager(**overrides) -> KVCacheManager:
    """The spec's worked-example manager: B=4, one fp16 layer of 128x1024, max_seq_len 16, 4 primary slots."""
    cfg = dict(
        tokens_per_block=4,
        max_seq_len=16,
        layers=[AttentionLayerConfig(layer_id=0, num_kv_heads=128, head_dim=1024, dtype=torch.float16,
                                     window_size=None, num_sink_tokens=0)],
        gpu_cache_bytes=8 << 20,
        host_cache_bytes=0,
        enable_block_reuse=True,
        enable_partial_reuse=True,
        enable_stats=True,
        device="cpu",
    )
    cfg.update(overrides)
    return KVCacheManager(KVCacheManagerConfig(**cfg))


def small_manager(windows=(None,), sinks=0, primary_slots=8, host_slots=0, B=4, max_seq_len=64, **kw):
    """Tiny layers (1 head x 4 dims fp32 -> 2*B*16 bytes a layer) so tests allocate kilobytes."""
    layers = [AttentionLayerConfig(i, 1, 4, torch.float32, w, sinks if w else 0) for i, w in enumerate(windows)]
    lcs = len({(w if w and w < max_seq_len else None) for w in windows})
    per_lc = 2 * B * 16 * (len(layers) // lcs)
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=B, max_seq_len=max_seq_len, layers=layers,
        gpu_cache_bytes=primary_slots * per_lc * lcs, host_cache_bytes=host_slots * per_lc * lcs, **kw))


def bucket(mgr, window="16") -> dict:
    return mgr.get_iteration_stats().to_dict()["kvCacheIterationStats"][window]


def nonzero(d: dict) -> dict:
    return {k: v for k, v in d.items() if v and k.startswith("iter")}


def run_prompt(mgr, rid, prompt, extra=0, close=True, salt=None, resume=True):
    """One request's prefill: create, (resume,) resize to the prompt + extra, commit, commit stats, close."""
    kv = mgr.create_kv_cache(rid, prompt, cache_salt=salt)
    if resume:
        assert kv.resume()
    assert kv.resize(len(prompt) + extra)
    kv.commit(prompt[kv.history_length:])
    kv.commit_pending_stats()
    if close:
        kv.close()
    return kv


def track(kv, prompt: list[int], prompts: dict, caches: list, rng) -> None:
    """A random workload's new cache: remembered with its prompt; half of them start active."""
    prompts[id(kv)] = prompt
    caches.append(kv)
    if rng.random() < 0.5:
        kv.resume()


def random_cache_op(op: str, kv, rng, prompt: list[int], max_len: int) -> None:
    """One of the random workloads' operations on a live cache: resume, suspend, resize, or commit (when it
    has room) what follows `prompt` in its history."""
    if op == "resume":
        kv.resume()
    elif op == "suspend":
        kv.suspend()
    elif op == "resize":
        kv.resize(min(max_len, max(kv.history_length, kv.capacity + rng.randint(-6, 9))))
    elif op == "commit" and kv.is_active and kv.capacity > kv.history_length:
        k = rng.randint(1, kv.capacity - kv.history_length)
        h = kv.history_length
        kv.commit((prompt[h:] + [rng.randint(0, 3) for _ in range(k)])[:k])


def tree_blocks(mgr: KVCacheManager) -> dict[int, int]:
    """key -> tier of every block whose anchor page the manager holds (walking the tree itself)."""
    out = {}
    for root in mgr.reuse.roots.values():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            page = node.pages[mgr.anchor_lc]
            if page is not None:
                out[key_of(node)] = page.tier
            stack.extend(node.children.values())
    return out
