"""Aggregator benchmark: merge cost per rank (pure), ingest throughput and emission lag through the real
StatsAggregator actor, for 8, 64 and 256 simulated ranks.

Targets (issue 5): >= 20,000 rank messages/s into one actor (batched), p99 emission lag < 50 ms at
64 ranks x 20 iterations/s, merge cost linear in ranks. Ranks reach the aggregator through one StatsRelay
per node (the first stage of the tree in aggregator/__init__.py): the lag rows show both the aggregator's
side (one call per 8-rank node) and the whole path (every rank its own call to a real relay actor).

Ranks send packed messages (aggregator/layout.py: a layout string and two number rows). Same-process
baselines, so runs on a loaded machine can be compared: the same messages in the dict form (nested report
dicts, as DESIGN.md names the fields) through the same actor (`dict` column, `packed/dict` ratio); a no-op
actor given the packed batches (`ceiling`: Ray transport alone); `calib` times a fixed pure-Python workload
before and after the runs (`norm`: msgs/s divided by calib ops/s); the merge table times the bucket-by-bucket
reference merge (the oracle) next to the row merge. Every message carries its own objects (as distinct
ranks send), so Ray pays for each one.

Run: python bench/aggregator_bench.py [--quick] [--real]   (about two minutes; starts its own local Ray)
     --real: reports from a genuine kvcache.KVCacheManager (two windows, host tier) instead of synthetic ones
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import random
import time
import uuid

import aggregator.merge as merge_mod
from aggregator.layout import packed
from aggregator.merge import (
    BYTE_FIELDS,
    GAUGE_FIELDS,
    LIFECYCLE_VIEW,
    PEAK_FIELDS,
    POOL_VIEW,
    VIEW_COUNTERS,
    WINDOW_VIEW,
    merge_iteration,
)

ENGINE = "bench"
BIG_BATCH = 1024
REPORTS: list[tuple[dict, dict | None]] = []  # (report, kv_cache_stats) templates; --real fills it


def report(rng: random.Random) -> dict:
    """A two-window, two-pool-group, two-life-cycle rank report (a Gemma-like SWA + full model)."""
    def bucket(view, extra):
        b = {f: rng.randint(0, 8) * (4096 if f in BYTE_FIELDS else 1) for f in VIEW_COUNTERS[view]}
        if view != LIFECYCLE_VIEW:
            b.update({f: rng.randint(0, 512) for f in GAUGE_FIELDS + PEAK_FIELDS})
        b.update(extra)
        return b

    return {
        WINDOW_VIEW: {w: bucket(WINDOW_VIEW, {"iterCacheHitRate": 0.5}) for w in ("512", "8192")},
        POOL_VIEW: {p: bucket(POOL_VIEW, {"poolGroupId": int(p), "slotSize": 65536, "windowSizes": [w]})
                    for p, w in (("0", 512), ("1", 8192))},
        LIFECYCLE_VIEW: {c: bucket(LIFECYCLE_VIEW, {"lifeCycleId": int(c), "poolGroupId": int(c),
                                                    "windowSize": w, "kind": "attention", "iterCacheHitRate": 0.5})
                         for c, w in (("0", 512), ("1", 8192))},
    }


def real_reports(n: int = 16, seed: int = 0) -> list[tuple[dict, dict]]:
    """Genuine kvcache reports: a full-attention and a sliding-window layer, a host tier, prefix reuse."""
    import torch

    from kvcache import AttentionLayerConfig, KVCacheManager, KVCacheManagerConfig

    B, slot = 4, 2 * 4 * 16 * 2
    mgr = KVCacheManager(KVCacheManagerConfig(
        tokens_per_block=B, max_seq_len=64, layers=[AttentionLayerConfig(0, 1, 4, torch.float32, None),
                                                    AttentionLayerConfig(1, 1, 4, torch.float32, 16)],
        gpu_cache_bytes=64 * slot * 2, host_cache_bytes=32 * slot * 2, enable_block_reuse=True,
        enable_partial_reuse=True, enable_stats=True))
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kvs = []
        for r in range(3):
            toks = [rng.randrange(50) for _ in range(rng.randrange(8, 40))]
            kv = mgr.create_kv_cache(f"r{i}-{r}", toks)
            if kv.resume() and kv.resize(len(toks)):
                kv.commit(toks[kv.history_length:])
                kv.commit_pending_stats()
            kvs.append(kv)
        for kv in kvs:
            kv.close()
        out.append((mgr.get_iteration_stats().to_dict(), mgr.get_kv_cache_stats().to_dict()))
    return out


def make_messages(n_ranks: int, n_iters: int, tp: int = 1, seed: int = 0, start_iter: int = 0,
                  form: str = "packed", engine: str = ENGINE) -> list[list[dict]]:
    """messages[i] = the n_ranks messages of iteration start_iter + i, each with its own report object, in
    the wire form ranks send (`packed`) or the dict form (`dict`)."""
    rng = random.Random(seed)
    incs = [uuid.uuid4().hex for _ in range(n_ranks)]
    reports = [r for r, _ in REPORTS] or [report(rng) for _ in range(16)]
    blobs = [pickle.dumps(r) for r in reports]  # copied per message: generation is not measured
    stats = {"maxNumBlocks": 1024, "freeNumBlocks": 512, "usedNumBlocks": 512, "tokensPerBlock": 32,
             "allocTotalBlocks": 0, "allocNewBlocks": 0, "reusedBlocks": 0, "missedBlocks": 0, "cacheHitRate": 0.0}
    out = []
    for i in range(n_iters):
        it = start_iter + i
        out.append([{"engine_id": engine, "rank": r, "dp_rank": r // tp, "tp_rank": r % tp, "incarnation": incs[r],
                     "iteration": it, "seq": it, "timestamp": time.time(),
                     "report": pickle.loads(blobs[(r // tp + it) % len(blobs)]),  # tp ranks agree
                     "kv_cache_stats": {**stats, "allocTotalBlocks": it * 8, "allocNewBlocks": it * 8}}
                    for r in range(n_ranks)])
    if form == "packed":
        out = [[pickle.loads(pickle.dumps(packed(m))) for m in it] for it in out]  # own objects per message
    return out


def calibrate(seconds: float = 0.3) -> float:
    """Ops/s of a fixed pure-Python workload (pickle round trip and field sums of one report): how fast this
    machine runs Python right now, the unit `norm` columns divide by."""
    rep = report(random.Random(1))
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        r = pickle.loads(pickle.dumps(rep))
        sum(v for view in r.values() for b in view.values() for v in b.values() if type(v) is int)
        n += 1
    return n / (time.perf_counter() - t0)


def _time_merge(fn, msgs, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(msgs)
    return (time.perf_counter() - t0) / reps * 1e6


def bench_merge(sizes) -> dict[int, tuple[float, float]]:
    """Pure merge cost (no Ray), microseconds per iteration: (merge_iteration of packed messages, the
    bucket-by-bucket reference merge of the same messages in the dict form), interleaved so that both see the
    same machine load."""
    out = {}
    for n in sizes:
        msgs = make_messages(n, 1, tp=2)[0]
        dicts = make_messages(n, 1, tp=2, form="dict")[0]
        reps = max(5, 2000 // n)
        fast, ref = [], []
        for _ in range(3):
            fast.append(_time_merge(merge_iteration, msgs, reps))
            ref.append(_time_merge(merge_mod.merge_iteration_reference, dicts, reps))
        out[n] = (min(fast), min(ref))
    return out


class NoopAggregator:
    """Takes ingest batches and does nothing with them: the Ray transport's own ceiling, measured with the
    same batches in the same process (the `ceiling` column)."""

    def __init__(self, n_iters: int) -> None:
        self.messages, self.n_iters = 0, n_iters

    async def ingest(self, messages: list[dict] | bytes) -> dict:
        if isinstance(messages, bytes):
            messages = pickle.loads(messages)
        self.messages += len(messages)
        return {"epoch": 1, "acked": []}

    async def health(self) -> dict:
        return {"counts": {"messages": self.messages, "incomplete": 0}, "last_iter": self.n_iters - 1}


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) used so far by process `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields_ = f.read().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


async def bench_throughput(ray, n: int, seconds: float, batch: int, inflight: int = 4, noop: bool = False,
                           form: str = "packed", put: bool = False) -> tuple[float, float]:
    """(msgs/s through the actor, msgs per CPU-second of the actor process). `put`: the batches are placed in
    the object store beforehand, so the timed loop does not spend this machine's CPU on serialising them (as
    ranks on other hosts would not)."""
    from aggregator import get_or_create_aggregator

    eng_iters = max(4, int(seconds * (24_000 if form == "packed" else 6_000) / n))
    its = make_messages(n, eng_iters, form=form)
    flat = [m for it in its for m in it]
    if noop:
        agg = ray.remote(num_cpus=0)(NoopAggregator).remote(eng_iters)
    else:
        agg = get_or_create_aggregator(ENGINE, n, 1, stats_timeout_s=2.0, name=f"bench-tp-{n}")
    await agg.health.remote()
    batches = [flat[i:i + batch] for i in range(0, len(flat), batch)]
    if form == "packed":  # as RankOutbox sends them: one pickle per batch
        batches = [pickle.dumps(b, protocol=5) for b in batches]
    if put:
        batches = [ray.put(b) for b in batches]
    await agg.ingest.remote(batches[0])  # warm the path
    pid = await agg.__ray_call__.remote(lambda self: os.getpid())
    cpu0 = proc_cpu_s(pid)
    t0 = time.perf_counter()
    pending: set = set()
    for b in batches[1:]:
        pending.add(asyncio.ensure_future(agg.ingest.remote(b)))
        if len(pending) >= inflight:
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*pending)
    deadline = time.monotonic() + 30
    while (h := await agg.health.remote())["last_iter"] < eng_iters - 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.002)  # the last records may wait out the checkpoint interval
    dt = time.perf_counter() - t0
    cpu = proc_cpu_s(pid) - cpu0
    assert h["counts"]["messages"] == len(flat), h["counts"]
    assert h["last_iter"] == eng_iters - 1 and h["counts"]["incomplete"] == 0, h
    ray.kill(agg)
    sent = len(flat) - batch
    return sent / dt, sent / max(cpu, 1e-9)


async def bench_lag(ray, n: int, rate_hz: float, seconds: float, ranks_per_call: int,
                    relays: int = 0) -> list[float]:
    """Paced iterations; ranks send in groups of `ranks_per_call` (one call per node: what the aggregator
    receives from the nodes' relays), or with `relays`, every rank its own call to its node's real
    StatsRelay actor (the deployment's path: n / relays ranks per node, all on this machine).
    Lag = subscriber receives record i - the last message of iteration i was sent."""
    from aggregator import StatsRelay, get_or_create_aggregator

    n_iters = int(rate_hz * seconds)
    engine = f"bench-lag-{n}-{relays}"
    its = make_messages(n, n_iters, engine=engine)
    agg = get_or_create_aggregator(engine, n, 1, stats_timeout_s=2.0)
    await agg.health.remote()
    nodes = [StatsRelay.options(num_cpus=0).remote(engine) for _ in range(relays)]  # find it by name
    await asyncio.gather(*(r.ingest.remote([]) for r in nodes))  # first contact made
    per_node = n // relays if relays else n
    sent_at: dict[int, float] = {}
    got_at: dict[int, float] = {}

    async def subscriber():
        since = -1
        while since < n_iters - 1:
            recs = await agg.wait_records.remote(since, 5.0)
            now = time.perf_counter()
            for r in recs:
                got_at[r["iter"]] = now
                since = r["iter"]

    sub = asyncio.ensure_future(subscriber())
    t0 = time.perf_counter()
    for i, msgs in enumerate(its):
        due = t0 + i / rate_hz
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        if relays:
            calls = [nodes[r // per_node].ingest.remote(pickle.dumps([m], protocol=5)) for r, m in enumerate(msgs)]
        else:
            calls = [agg.ingest.remote(pickle.dumps(msgs[k:k + ranks_per_call], protocol=5))
                     for k in range(0, n, ranks_per_call)]
        sent_at[i] = time.perf_counter()
        await asyncio.gather(*calls)
    await asyncio.wait_for(sub, 30)
    for a in (agg, *nodes):
        ray.kill(a)
    return [(got_at[i] - sent_at[i]) * 1e3 for i in range(n_iters)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main_async(args) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.real:
        REPORTS.extend(real_reports())
    calib0 = calibrate()
    sizes = (8, 64, 256)
    merges = bench_merge(sizes)
    merge = {n: f for n, (f, _) in merges.items()}
    print(f"merge_iteration of packed messages (pure, no Ray; {'kvcache' if args.real else 'synthetic'} reports,"
          " tp=2)")
    print(f"{'ranks':>6} {'us/iteration':>13} {'us/rank':>8} {'per-rank cost vs 8':>19} {'reference us/it':>16}"
          f" {'packed/reference':>17}")
    for n in sizes:
        f, r = merges[n]
        print(f"{n:>6} {f:>13.0f} {f / n:>8.1f} {f / n / (merge[8] / 8):>19.2f} {r:>16.0f} {f / r:>17.2f}")

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             object_store_memory=200 * 1024 * 1024)
    secs = 1.0 if args.quick else 1.5
    runs: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
    for n in sizes:  # interleaved, so that all see the same machine load
        for kind, batch in (("noop", BIG_BATCH), ("packed", BIG_BATCH), ("packed", 64), ("dict", 64)):
            runs.setdefault((kind, batch), {})[n] = await bench_throughput(
                ray, n, secs, batch=max(n, batch) if batch == 64 else batch, noop=kind == "noop",
                form="dict" if kind == "dict" else "packed")
    lag, lag_1 = {}, {}
    for n in sizes:
        lag[n] = await bench_lag(ray, n, 20.0, 2.0 if args.quick else 3.0, ranks_per_call=8)
    for n in (8,):  # one node (more relays on this one machine would measure its 2 cores, not the design)
        lag_1[n] = await bench_lag(ray, n, 20.0, 2.0 if args.quick else 3.0, ranks_per_call=1, relays=1)
    ray.shutdown()
    calib1 = calibrate()
    calib = (calib0 + calib1) / 2

    big, small, dicts, noop = (runs[k] for k in (("packed", BIG_BATCH), ("packed", 64), ("dict", 64),
                                                 ("noop", BIG_BATCH)))
    print("\nStatsAggregator actor ingest (one actor, 4 calls in flight; msgs/s, and msgs per CPU-second of the"
          " actor process in brackets)")
    print(f"{'ranks':>6} {'batch ' + str(BIG_BATCH):>17} {'norm':>6} {'no-op ceiling':>15} {'of ceil':>8}"
          f" {'batch max(n,64)':>17} {'dict form':>15} {'packed/dict':>12}")
    for n in sizes:
        print(f"{n:>6} {big[n][0]:>8.0f} [{big[n][1]:>6.0f}] {big[n][0] / calib:>6.3f} {noop[n][0]:>6.0f} "
              f"[{noop[n][1]:>6.0f}] {big[n][0] / noop[n][0]:>8.2f} {small[n][0]:>8.0f} [{small[n][1]:>6.0f}]"
              f" {dicts[n][0]:>6.0f} [{dicts[n][1]:>6.0f}] {small[n][0] / dicts[n][0]:>12.2f}")
    print(f"batch {BIG_BATCH}: what a node relay forwards while the aggregator is busy (relay.py); no-op ceiling: "
          "an actor that only unpickles the same batches (Ray's own cost); dict form: the same messages as nested "
          "report dicts, unpickled by Ray (the wire form before layout.py), vs packed at the same batch size")
    print(f"calib: {calib0:.0f} ops/s before, {calib1:.0f} after (norm = msgs/s / calib ops/s; compare runs by norm)")
    print(f"\nemission lag at 20 iterations/s, ms   {'p50':>6} {'p99':>6} {'max':>6}")
    for n in sizes:
        print(f"  {n:>3} ranks, one call per 8 ranks      {pct(lag[n], .5):>6.1f} {pct(lag[n], .99):>6.1f}"
              f" {max(lag[n]):>6.1f}")
    for n in lag_1:
        print(f"  {n:>3} ranks, each its own call to a relay  {pct(lag_1[n], .5):>6.1f}"
              f" {pct(lag_1[n], .99):>6.1f} {max(lag_1[n]):>6.1f}")
    best = max(v[0] for v in big.values())
    print(f"\ntargets: >= 20000 msgs/s: {'met' if best >= 20_000 else 'NOT met'} (best {best:.0f}, batch {BIG_BATCH});"
          f" p99 lag < 50 ms at 64 ranks: {'met' if pct(lag[64], .99) < 50 else 'NOT met'} ({pct(lag[64], .99):.1f}"
          f" ms); merge per-rank cost 256 vs 8: "
          f"{merge[256] / 256 / (merge[8] / 8):.2f}x (1.0 = linear)")
    print(f"tree, per-node stage: a relay taking one call per rank ({pct(lag_1[8], .5):.1f} ms p50 to the record of "
          f"one 8-rank node); the top aggregator then takes node batches at the rates above")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter runs")
    p.add_argument("--real", action="store_true", help="genuine kvcache reports instead of synthetic ones")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
