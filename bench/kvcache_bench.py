"""KV cache manager throughput with statistics on vs off (issue 3's workload).

2,000 requests, each one of 50 shared 512-token prefixes plus a unique 128-token suffix; per request
create_kv_cache, resume, resize to the prompt, commit, then 32 decode steps of resize(capacity + 1) + commit
of one token, then close. Requests run as a continuous batch (`--concurrency` at once); every iteration
each running request takes one step, commits its pending stats, and the manager is drained once with
get_iteration_stats(), as the engine calls them. tokens_per_block 16, 8,192 primary blocks per life cycle
(8 KV heads x 128, fp16), once with one full-attention layer and once adding a 1,024-token window layer.
Throughput is requests per CPU-second of this process (time.process_time), and on/off runs alternate, best of
--repeats each, so that other load on a shared machine moves both sides alike; the stats cost is also counted
deterministically, as Python opcodes executed (--opcodes), since +-30% noise hides a 5% target.

`--against REV` compares this tree's kvcache with the one at git revision REV in one run, stats on: fresh
subprocesses alternate old and new (same driver, same workload), best of --repeats each, and count opcodes.
Run it as `python -m bench.kvcache_bench` from the checkout, or the kvcache on sys.path may be another tree's.

Ratios are printed against vLLM 0.33's v1 KVCacheManager on this workload (`VLLM_REF`; the figures and how
they were taken are in bench/README.md). Prints a table; no assertion on time.
"""

import argparse
import io
import json
import pathlib
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

from kvcache import AttentionLayerConfig, KVCacheManager, KVCacheManagerConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
B = 16
BLOCKS = 8192
VLLM_REF = {"full": (1100, 11.0), "full+swa": (720, 16.5)}


def make_manager(with_swa: bool, stats: bool) -> KVCacheManager:
    layers = [AttentionLayerConfig(0, 8, 128, torch.float16, None)]
    if with_swa:
        layers.append(AttentionLayerConfig(1, 8, 128, torch.float16, 1024))
    slot = 2 * B * 8 * 128 * 2
    return KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=B, max_seq_len=4096, layers=layers, gpu_cache_bytes=BLOCKS * slot * len(layers),
        host_cache_bytes=0, enable_block_reuse=True, enable_partial_reuse=True, enable_stats=stats))


def workload(n_requests: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32000) for _ in range(512)] for _ in range(50)]
    return [prefixes[rng.randrange(50)] + [rng.randrange(32000) for _ in range(128)] for _ in range(n_requests)]


def run(mgr: KVCacheManager, prompts: list[list[int]], concurrency: int, decode_steps: int) -> tuple[float, float]:
    """Returns (requests/s, median decode-step microseconds)."""
    pending = list(enumerate(prompts))
    pending.reverse()
    running: list[list] = []  # [kv, steps left]
    step_ns: list[int] = []
    clock = time.perf_counter_ns
    t0 = time.process_time()  # CPU seconds of this process: steadier than wall time on a shared machine
    while pending or running:
        while pending and len(running) < concurrency:
            rid, prompt = pending.pop()
            kv = mgr.create_kv_cache(rid, prompt)
            if not kv.resume() or not kv.resize(len(prompt)):
                raise RuntimeError("benchmark cache too small")
            kv.commit(prompt[kv.history_length:])
            kv.commit_pending_stats()
            running.append([kv, decode_steps])
        still = []
        for item in running:
            kv = item[0]
            s = clock()
            ok = kv.resize(kv.capacity + 1)
            kv.commit((7,))
            kv.commit_pending_stats()
            step_ns.append(clock() - s)
            if not ok:
                raise RuntimeError("benchmark cache too small")
            item[1] -= 1
            if item[1]:
                still.append(item)
            else:
                kv.close()
        running = still
        mgr.get_iteration_stats()
    elapsed = time.process_time() - t0
    return len(prompts) / elapsed, statistics.median(step_ns) / 1000


def count_opcodes(fn) -> int:
    """Python opcodes executed by fn(): a deterministic cost, unlike time on a shared, noisy machine."""
    n = 0

    def tracer(frame, event, arg):
        nonlocal n
        frame.f_trace_opcodes = True
        if event == "opcode":
            n += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n


def opcode_ratios(n_requests: int, concurrency: int, decode_steps: int) -> None:
    prompts = workload(n_requests)
    for name in ("full", "full+swa"):
        ops = {}
        for stats in (False, True):
            mgr = make_manager(name == "full+swa", stats)
            ops[stats] = count_opcodes(lambda m=mgr: run(m, prompts, concurrency, decode_steps))
        print(f"{name:<10} opcodes stats off {ops[False]:>10} on {ops[True]:>10}  on/off {ops[True] / ops[False]:.3f}"
              f" (target <= 1.05)")


# the child of --against: kvcache from argv[1], this driver from argv[2]; prints run()'s result or opcodes
_CHILD = """import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import kvcache, kvcache_bench as kb
assert kvcache.__file__.startswith(sys.argv[1]), kvcache.__file__
name, n, conc, steps, mode = sys.argv[3], *map(int, sys.argv[4:7]), sys.argv[7]
mgr, prompts = kb.make_manager(name == "full+swa", True), kb.workload(n)
work = lambda: kb.run(mgr, prompts, conc, steps)
print(json.dumps(work() if mode == "time" else kb.count_opcodes(work)))
"""


def _child(root: str, name: str, n: int, args, mode: str):
    argv = [sys.executable, "-c", _CHILD, root, str(ROOT / "bench"), name, str(n), str(args.concurrency),
            str(args.decode_steps), mode]
    return json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)


def against(rev: str, args) -> None:
    """Stats-on figures of this tree's kvcache and of the one at `rev`, measured in one run."""
    with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(["git", "archive", rev, "kvcache"], cwd=ROOT, check=True, capture_output=True)
        tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(old)
        sides = {rev: old, "this tree": str(ROOT)}
        print(f"{'config':<10} {'kvcache':<10} {'req/s':>8} {'decode us':>10} {'opcodes':>10}")
        for name in ("full", "full+swa"):
            best: dict = {}
            for i in range(args.repeats):
                for side in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                    rps, us = _child(sides[side], name, args.requests, args, "time")
                    if side not in best or rps > best[side][0]:
                        best[side] = (rps, us)
            ops = {side: _child(root, name, args.opcodes or 400, args, "opcodes") for side, root in sides.items()}
            for side in sides:
                print(f"{name:<10} {side:<10} {best[side][0]:>8.0f} {best[side][1]:>10.2f} {ops[side]:>10}")
            (o_rps, o_us), (n_rps, n_us) = best.values()
            print(f"{name:<10} new/old: req/s {n_rps / o_rps:.3f}, decode step {n_us / o_us:.3f}, "
                  f"opcodes {ops['this tree'] / ops[rev]:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=4, help="best of N runs per configuration")
    ap.add_argument("--opcodes", type=int, default=400, metavar="N",
                    help="also count Python opcodes for N requests, stats on vs off (0 = skip)")
    ap.add_argument("--against", metavar="REV", help="compare with the kvcache at git revision REV instead")
    args = ap.parse_args()
    if args.against:
        against(args.against, args)
        return
    prompts = workload(args.requests)
    print(f"{'config':<10} {'stats':<5} {'req/s':>8} {'decode us':>10} {'vs vLLM req/s':>14} {'vs vLLM step':>13}")
    for name in ("full", "full+swa"):
        results = {}
        for i in range(args.repeats):
            for stats in (False, True) if i % 2 == 0 else (True, False):
                rps, us = run(make_manager(name == "full+swa", stats), prompts, args.concurrency, args.decode_steps)
                if stats not in results or rps > results[stats][0]:
                    results[stats] = (rps, us)
        for stats in (False, True):
            best = results[stats]
            ref_rps, ref_us = VLLM_REF[name]
            print(f"{name:<10} {'on' if stats else 'off':<5} {best[0]:>8.0f} {best[1]:>10.2f} "
                  f"{best[0] / ref_rps:>13.2f}x {ref_us / best[1]:>12.2f}x")
        ratio_time = results[False][0] / results[True][0]
        ratio_step = results[True][1] / results[False][1]
        print(f"{name:<10} stats on/off: request time ratio {ratio_time:.3f}, decode step ratio {ratio_step:.3f}")
    if args.opcodes:
        opcode_ratios(args.opcodes, args.concurrency, args.decode_steps)


if __name__ == "__main__":
    main()
