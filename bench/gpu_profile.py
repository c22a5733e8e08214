"""Measure a cost profile (workers/cost_model.py) for the simulated ranks: the real model's forward pass timed on
the device it serves on, over a grid of decode and prefill batches, and the terms fitted to it.

    python bench/gpu_profile.py [--model smollm2-135m-instruct] [--device cuda] [--dtype bfloat16]
                                [--name mine] [--out profile.json] [--quick]

Decode batches (B sequences of C tokens each, one new token each) fit `weights_s` (the intercept) and
`kv_token_s` (per context token); single prefills of n tokens after s cached ones fit `token_s` and
`attn_pair_s` (least squares, each on the points where its term is the larger one). `step_s` is 0: a simulated
rank's own step (scheduling, sampling, bookkeeping) is real and runs on top of the sleep. Prints every point's
measured and fitted time and the fit's mean error; writes the JSON that `simulated_profile` reads. `kv_tokens`
is the cache this device holds for the model at `gpu_memory_fraction` (on CPU: `--kv-tokens`).
"""

import argparse
import statistics
import time
import zlib

import numpy as np
import torch

from workers.config import CacheSettings
from workers.cost_model import CostProfile
from workers.loader import kv_cache_config, load_model
from workers.model import SeqInput
from workers.worker import DTYPES


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(model, kv, seqs, device: str, repeat: int) -> float:
    """Median seconds of one forward pass over `seqs` (their caches sized, nothing committed)."""
    times = []
    for _ in range(repeat + 1):
        sync(device)
        t0 = time.perf_counter()
        model(seqs, kv)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first warms up


def with_history(kv, rid: str, model, tokens: int, vocab: int, chunk: int = 2048):
    """A request's cache holding `tokens` tokens of history (prefilled in chunks)."""
    g = torch.Generator().manual_seed(zlib.crc32(rid.encode()))  # distinct tokens: nothing reused
    ids = torch.randint(0, vocab, (tokens + 1,), generator=g).tolist()
    cache = kv.create_kv_cache(rid, ids, exclude_from_stats=True)
    done = cache.history_length
    while done < tokens:
        n = min(chunk, tokens - done)
        assert cache.resize(done + n), "the cache is too small for the grid: lower --contexts"
        model([SeqInput(ids[done:done + n], done, cache)], kv)
        cache.commit(ids[done:done + n])
        done += n
    return cache, ids


def main(args: argparse.Namespace) -> None:
    dtype = DTYPES[args.dtype]
    model, cfg = load_model(args.model, device=args.device, dtype=dtype, max_seq_len=max(args.contexts) + 4096)
    kv_bytes = args.kv_bytes
    if not kv_bytes and not args.device.startswith("cuda"):  # room for the grid (twice: windows split the bytes)
        tokens = max(args.batches) * (max(args.contexts) + 16) + max(args.starts) + max(args.prefills) + 64
        kv_bytes = 2 * tokens * cfg.kv_bytes_per_token(1, torch.empty((), dtype=dtype).element_size())
    cache = CacheSettings(max_seq_len=max(args.contexts) + 4096, kv_cache_bytes=kv_bytes, host_cache_bytes=0,
                          enable_block_reuse=False, enable_stats=False)
    from kvcache import KVCacheManager

    kv = KVCacheManager(kv_cache_config(cfg, 1, cache, device=args.device, dtype=dtype))
    capacity = args.kv_tokens
    if args.device.startswith("cuda") and not args.kv_bytes:  # what this GPU holds at gpu_memory_fraction
        capacity = kv.get_kv_cache_stats().max_num_blocks * kv.tokens_per_block
    vocab = cfg.vocab_size
    points: list[tuple[list[tuple[int, int]], float]] = []  # (batch as (new, start) per sequence, seconds)
    for c in args.contexts:
        held = [with_history(kv, f"d{c}-{i}", model, c, vocab) for i in range(max(args.batches))]
        for b in args.batches:
            seqs = []
            for cache_i, ids in held[:b]:
                assert cache_i.resize(c + 1)
                seqs.append(SeqInput([ids[c]], c, cache_i))
            points.append(([(1, c)] * b, timed(model, kv, seqs, args.device, args.repeat)))
        for cache_i, _ in held:
            cache_i.close()
    for s in args.starts:
        for n in args.prefills:
            cache_i, ids = with_history(kv, f"p{s}-{n}", model, s, vocab) if s else (None, None)
            if cache_i is None:
                g = torch.Generator().manual_seed(zlib.crc32(f"p0-{n}".encode()))
                ids = torch.randint(0, vocab, (n,), generator=g).tolist()
                cache_i = kv.create_kv_cache(f"p0-{n}", ids, exclude_from_stats=True)
            else:
                ids = ids[:s] + torch.randint(0, vocab, (n,)).tolist()
            assert cache_i.resize(s + n), "the cache is too small for the grid"
            points.append(([(n, s)], timed(model, kv, [SeqInput(ids[s:s + n], s, cache_i)], args.device,
                                           args.repeat)))
            cache_i.close()
    profile = fit(points, args.name, capacity, cfg)
    print(f"{'batch':<28}{'measured ms':>12}{'fitted ms':>11}{'error':>8}")
    errors = []
    for batch, t in points:
        f = profile.step_time(batch)
        errors.append(abs(f - t) / t)
        n, start = batch[0]
        label = f"decode {len(batch)} x {start}" if n == 1 else f"prefill {n} after {start}"
        print(f"{label:<28}{t * 1e3:>12.3f}{f * 1e3:>11.3f}{errors[-1]:>8.1%}")
    print(f"mean error {statistics.mean(errors):.1%}, worst {max(errors):.1%}")
    print(profile.to_json())
    if args.out:
        with open(args.out, "w") as f:
            f.write(profile.to_json())


def fit(points: list[tuple[list[tuple[int, int]], float]], name: str, kv_tokens: int, cfg) -> CostProfile:
    """The profile's terms by least squares: decode points give weights_s and kv_token_s, prefills the rest."""
    decode = [(b, t) for b, t in points if b[0][0] == 1]
    prefill = [(b, t) for b, t in points if b[0][0] > 1]
    # decode: t = weights_s + kv_token_s x (the batch's context)
    a = np.array([[1.0, sum(s + n for n, s in b)] for b, _ in decode])
    weights_s, kv_token_s = np.linalg.lstsq(a, np.array([t for _, t in decode]), rcond=None)[0]
    # prefill: t = token_s x n + attn_pair_s x pairs
    a = np.array([[n, n * s + n * (n + 1) // 2] for ((n, s),), _ in prefill], dtype=float)
    token_s, attn_pair_s = np.linalg.lstsq(a, np.array([t for _, t in prefill]), rcond=None)[0]
    return CostProfile(name=name, step_s=0.0, weights_s=max(float(weights_s), 0.0), token_s=max(float(token_s), 0.0),
                       attn_pair_s=max(float(attn_pair_s), 0.0), kv_token_s=max(float(kv_token_s), 0.0),
                       kv_tokens=kv_tokens, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                       layer_windows=cfg.layer_windows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32", choices=DTYPES)
    ap.add_argument("--name", default="measured")
    ap.add_argument("--out", help="write the profile's JSON here")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--prefills", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--starts", type=int, nargs="+", default=[0, 4096])
    ap.add_argument("--kv-bytes", type=int, default=0, help="the cache for the grid (0: gpu_memory_fraction)")
    ap.add_argument("--kv-tokens", type=int, default=400_000, help="the profile's cache capacity in tokens")
    ap.add_argument("--quick", action="store_true", help="a small grid (a CPU's)")
    a = ap.parse_args()
    if a.quick:
        a.batches, a.contexts, a.prefills, a.starts, a.repeat = [1, 4, 16], [128, 512], [64, 256], [0, 256], 3
    main(a)
