"""One rank's decode step on the real model, in process (no Ray): where a step's time goes.

    python bench/decode_bench.py [--seqs 32] [--context 300] [--steps 8] [--threads 2] [--prefixes 0]

A RankWorker with the model (SmolLM2-135M from its GGUF by default) and a KV cache sized for every sequence
prefills `--seqs` requests of `--context` prompt tokens (sampled at temperature 0.8, seeded), then runs
`--steps` decode steps of all of them, the engine's own plans (StepPlan: one token each), stats on. The median
step with decode attention read in place by our CPU kernel (workers/cpu_kernels.py) against the same steps
gathering every sequence's blocks (the path before it), alternated in the same process; then a profile of the
kernel's steps by operator, so what is left shows. With `--prefixes N` the prompts share N prefixes (all but
their last 64 tokens, reused from the cache), and the kernel's steps with cascade attention (each shared prefix
attended once per group: workers/paged_batch.py `SharedPrefixes`) are timed against the same without. Then
csrc/cpu_ops.cpp's operators (fused norms, rope and silu, the matmul of up to 16 rows, the sampler's draw) against
torch's, alternated (`--seqs 1`: a request alone, the TPOT of vllm_compare's `single`). The rank steps on
`--threads` (its own threads: a step sets them). Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from deployment.settings import Settings  # noqa: E402
from engine import ranks  # noqa: E402
from workers import cpu_kernels, paged_batch  # noqa: E402
from workers.loader import load_model  # noqa: E402
from workers.parallel import TPGroup  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402
from workers.step import NewRequest, StepPlan, Work  # noqa: E402
from workers.worker import RankWorker, build_kv_cache, layout_of  # noqa: E402


def make_rank(model: str, seqs: int, context: int, steps: int, threads: int) -> RankWorker:
    tokens = seqs * (context + steps + 32)
    s = Settings(model=model, dp=1, tp=1, device="cpu", max_seq_len=max(1024, context + steps + 32),
                 kv_cache_bytes=0, max_num_batched_tokens=2048, num_cpus_per_rank=threads).engine_config()
    spec = ranks.rank_spec(s, 0, "cpu", "float32")
    w = RankWorker(spec)
    torch.set_num_threads(threads)
    w.model, cfg = load_model(model, max_seq_len=spec.cache.max_seq_len)
    kv_bytes = tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    spec = ranks.rank_spec(Settings(model=model, dp=1, tp=1, device="cpu", max_seq_len=spec.cache.max_seq_len,
                                    kv_cache_bytes=kv_bytes, max_num_batched_tokens=2048,
                                    num_cpus_per_rank=threads).engine_config(),
                           0, "cpu", "float32")
    w.spec = spec
    w.kv = build_kv_cache(spec, cfg, "cpu", torch.float32, TPGroup(0, 1, None, "", 0))
    w.layout = layout_of(w.kv, spec, w.incarnation, node_id="bench")
    return w


def prefill(w: RankWorker, seqs: int, context: int, vocab: int, prefixes: int = 0) -> dict[str, int]:
    """Every request prefilled (its first token sampled): request id -> the token to append next. With
    `prefixes`, request i's prompt is prefix i % prefixes (all but its last 64 tokens) and 64 of its own."""
    params = SamplingParams(max_tokens=10_000, temperature=0.8, seed=7, ignore_eos=True)
    last = {}
    for i in range(seqs):
        rid = f"r{i}"
        prompt = [(7 + 31 * i + 17 * k) % (vocab - 10) + 5 for k in range(context)]
        if prefixes:
            g, own = i % prefixes, min(64, context)
            prompt = [(3 + 29 * g + 13 * k) % (vocab - 10) + 5 for k in range(context - own)] + prompt[-own:]
        res = w.step(StepPlan(i, [NewRequest(rid, prompt, params, None)], [Work(rid, context)], record=True))
        last[rid] = res.ran[rid][1]
    return last


def decode_ms(w: RankWorker, last: dict[str, int], steps: int, it: int) -> list[float]:
    times = []
    for _ in range(steps):
        plan = StepPlan(it, [], [Work(rid, 1, tok) for rid, tok in last.items()], record=True)
        t0 = time.perf_counter()
        res = w.step(plan)
        times.append((time.perf_counter() - t0) * 1e3)
        last.update({rid: ran[1] for rid, ran in res.ran.items()})
        it += 1
    return times


def set_kernel(w: RankWorker, on: bool) -> None:
    for layer in w.model.model.layers:
        layer.self_attn.paged_kernel = on


def profile(w: RankWorker, last: dict[str, int], it: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_ms(w, last, 3, it)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    print("  where a kernel step's time goes (self CPU, 3 steps):")
    for e in ops[:8]:
        print(f"    {e.key:<48} {e.self_cpu_time_total / total:6.1%}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefixes", type=int, default=0,
                    help="prompts share this many prefixes (0: none); then also cascade attention on vs off")
    args = ap.parse_args()
    w = make_rank(args.model, args.seqs, args.context, 6 * args.steps + 8, args.threads)
    last = prefill(w, args.seqs, args.context, w.model.config.vocab_size, args.prefixes)
    it = args.seqs
    decode_ms(w, last, 2, it)  # first-call costs
    it += 2
    runs: dict[bool, list[float]] = {True: [], False: []}
    for on in (True, False, True, False):  # alternated: a drifting load favours neither
        set_kernel(w, on)
        runs[on] += decode_ms(w, last, args.steps, it)
        it += args.steps
    set_kernel(w, True)
    kernel, gather = statistics.median(runs[True]), statistics.median(runs[False])
    min_keys = paged_batch.CASCADE_MIN_KEYS
    print(f"{args.model}: {args.seqs} sequences decoding at ~{args.context} tokens of context, "
          f"{args.threads} threads; median ms per decode step over {2 * args.steps} steps")
    print(f"  paged kernel (in place) {kernel:8.1f} ms")
    print(f"  gather + SDPA           {gather:8.1f} ms")
    print(f"  kernel / gather         {kernel / gather:8.2f}x")
    if args.prefixes:
        cascade = {True: [], False: []}
        for on in (False, True, False, True):
            paged_batch.CASCADE_MIN_KEYS = min_keys if on else 1 << 62
            cascade[on] += decode_ms(w, last, args.steps, it)
            it += args.steps
        paged_batch.CASCADE_MIN_KEYS = min_keys
        on, off = statistics.median(cascade[True]), statistics.median(cascade[False])
        print(f"  {args.prefixes} shared prefixes: kernel with cascade {on:.1f} ms, without {off:.1f} ms "
              f"({on / off:.2f}x)")
    fused: dict[bool, list[float]] = {True: [], False: []}
    for on in (False, True, False, True):
        cpu_kernels.USE_CPU_OPS = on
        fused[on] += decode_ms(w, last, args.steps, it)
        it += args.steps
    on, off = statistics.median(fused[True]), statistics.median(fused[False])
    print(f"  csrc/cpu_ops.cpp's operators (fused, small-batch matmul, sampler) {on:.1f} ms, torch's operators "
          f"{off:.1f} ms ({on / off:.2f}x)")
    profile(w, last, it)


if __name__ == "__main__":
    main()
