"""Chaos soak (issues 15, 27): steady streaming traffic on a real multi-node Ray cluster while things die.

    python bench/chaos_bench.py --duration 240            # the CI-sized run (4 min)
    python bench/chaos_bench.py --duration 3600           # the hour-long run

Starts a multi-node cluster on this machine (`ray.cluster_utils.Cluster`,
tests/support/multinode_support.py: a head with
no CPUs that runs the Serve replicas and the aggregator, `--nodes` worker nodes of `--node-cpus` CPUs for the
ranks) and the app on it (dp 2 x tp 2 by default, the random model unless `--model`). `--clients` clients stream
shared-prefix completions the whole time. Every `--fault-every` seconds one fault, in turn: kill a rank, kill
the aggregator, kill the engine replica, kill the ingress replica, remove a worker node holding a group and add
a fresh one. One line per fault with its recovery time (the fault -> every group up and a request served), then
the summary:
- requests, read as deployment/clients/client.py's `stream_completion` reads them (a refusal before any response retried
  after Retry-After, a stream cut by its ingress replica's death resumed with Last-Event-ID): completed (with how
  many cuts and refusals they went through); refused for good (no replica answered within RECOVERY_S); lost
  (chunks, then an error or no replica to resume on): the target is 0;
- the conservation law over the whole run: every record read once, as it is emitted, and the sum of their
  iteration counters against the change of the cumulative counters; the cumulative never backwards (sampled);
- the RSS of every long-lived process (alive from `--rss-from` to the end, sampled every `--rss-every`):
  growth, the target < 10%; and the metric series the head's Ray metrics agent exports at each sample;
- rank actors and placement groups left after the app is deleted (GCS tables), the target 0.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402

from deployment.clients.client import Streamed, StreamError, stream_completion  # noqa: E402
from deployment.clients.loadgen import make_prompts  # noqa: E402
from tests.support import multinode_support as mns  # noqa: E402

COUNTERS = {"iterAllocTotalBlocks": "allocTotalBlocks", "iterAllocNewBlocks": "allocNewBlocks",
            "iterReusedBlocks": "reusedBlocks", "iterMissedBlocks": "missedBlocks"}
FAULTS = ("rank", "aggregator", "engine_replica", "ingress_replica", "node")
APP = "chaos"
RECOVERY_S = 300


class Tally:
    def __init__(self) -> None:
        self.ok = self.refused = self.lost = 0
        self.resumed = self.retried = 0  # cuts the client resumed over, refusals it retried (both then completed)
        self.why: dict[str, int] = {}
        self.lost_at: list[tuple[float, str]] = []  # (wall time, why): lost and refused

    def add(self, kind: str, why: str = "") -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if why:
            self.why[f"{kind}: {why}"] = self.why.get(f"{kind}: {why}", 0) + 1
            self.lost_at.append((time.time(), f"{kind}: {why}"))


def stream_one(url: str, body: dict) -> tuple[str, str, Streamed | None]:
    """One streamed completion as a client of a server of replicas reads it (deployment/clients/client.py): refusals
    before any response retried, a cut stream resumed with Last-Event-ID. ("ok", ...): it ended with a finish
    reason and [DONE]; "refused": a status (or no connection) before any chunk, after the client gave up;
    "lost": chunks came, then it failed (an error chunk, or no replica took it again)."""
    try:
        got = stream_completion(url, body, give_up_s=RECOVERY_S, timeout_s=300)
    except StreamError as e:
        return "lost" if e.streamed.chunks else "refused", f"{e.status} {e.code or ''}".strip(), e.streamed
    except Exception as e:  # a bug of the client's: counted, not the end of the soak
        return "lost", type(e).__name__, None
    finish = [c["choices"][0]["finish_reason"] for c in got.chunks if c.get("choices")]
    return ("ok", "", got) if finish and finish[-1] else ("lost", "no finish reason", got)


async def traffic(url: str, stop: asyncio.Event, clients: int, max_tokens: int, tally: Tally, t0: float) -> None:
    prompts = make_prompts(400, prefixes=6, prefix_words=40, seed=0)
    loop = asyncio.get_running_loop()
    # the clients' own threads: in asyncio's default pool they would queue the fault injection behind streams
    pool = ThreadPoolExecutor(clients, thread_name_prefix="client")

    async def client(c: int) -> None:
        rng = random.Random(c)
        while not stop.is_set():
            body = {"prompt": rng.choice(prompts), "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True}
            kind, why, got = await loop.run_in_executor(pool, stream_one, url, body)
            tally.add(kind, why)  # here, on the loop: one thread counts
            if got is not None:
                tally.resumed += got.resumed
                tally.retried += got.retried
            if kind == "refused":
                await asyncio.sleep(0.5)  # nothing answers: do not spin

    try:
        await asyncio.gather(*[client(c) for c in range(clients)])
    finally:
        pool.shutdown(wait=False)


async def follow(url: str, stop: asyncio.Event, records: dict, cumulative: list) -> None:
    """Every record once, as it is emitted (an aggregator restart keeps only its newest records), and the
    cumulative counters now and then (they must never go backwards)."""
    since = -1
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while True:
            try:
                got = (await http.get("/stats", params={"since": since, "limit": 1000})).json()
                cum = (await http.get("/kv_cache_stats")).json()
            except (httpx.HTTPError, ValueError):
                got, cum = [], None
            if isinstance(got, list):
                for r in got:
                    records.setdefault(r["iter"], r)
                if got:
                    since = got[-1]["iter"]
            if isinstance(cum, dict) and "allocTotalBlocks" in cum:
                cumulative.append(cum)
            if not got and stop.is_set():
                return
            await asyncio.sleep(0.25)  # poll interval


async def restarts(http: httpx.AsyncClient) -> int:
    """The engine's group restarts so far (0 while /health does not answer)."""
    try:
        h = await http.get("/health")
        return sum(g["restarts"] for g in h.json()["engine"]["groups"].values()) if h.status_code == 200 else 0
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


async def served_again(http: httpx.AsyncClient, min_restarts: int = 0) -> bool:
    """Every group up (after at least `min_restarts` group restarts: a rank or node fault is over only once
    its group came back, not while the engine has yet to step it) and a short request served."""
    try:
        h = await http.get("/health")
        groups = h.json().get("engine", {}).get("groups", {}) if h.status_code == 200 else {}
        if not groups or not all(g["up"] for g in groups.values()):
            return False
        if sum(g["restarts"] for g in groups.values()) < min_restarts:
            return False
        r = await http.post("/v1/completions", json={"prompt": "probe", "max_tokens": 2})
        return r.status_code == 200
    except (httpx.HTTPError, ValueError):
        return False


def kill_named(prefix: str, restart: bool = False) -> str:
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    victim = random.Random(len(actors)).choice(actors)
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=not restart)
    return victim["name"]


def inject(kind: str, mn: mns.MultiNode, engine_id: str, node_cpus: int, rng: random.Random) -> str:
    if kind == "rank":
        return kill_named(f"kvfleet-rank-{engine_id}-")
    if kind == "aggregator":
        return kill_named(f"kvfleet-stats-{engine_id}", restart=True)
    if kind == "engine_replica":
        return kill_named(f"SERVE_REPLICA::{APP}#KVFleetEngine")
    if kind == "ingress_replica":
        return kill_named(f"SERVE_REPLICA::{APP}#KVFleetIngress")
    holding = set(mns.actor_nodes(f"kvfleet-rank-{engine_id}-").values())
    name = rng.choice(sorted(n for n, node in mn.nodes.items() if node.node_id in holding))
    mn.remove(name)
    return f"node {name}"


async def chaos(mn: mns.MultiNode, args: argparse.Namespace, stop: asyncio.Event, faults: list, t0: float) -> None:
    rng = random.Random(7)
    names = itertools.count(len(mn.nodes))
    async with httpx.AsyncClient(base_url=mn.url, timeout=30) as http:
        for kind in itertools.cycle(args.faults):
            next_at = t0 + (len(faults) + 1) * args.fault_every
            if next_at + args.fault_every / 2 > t0 + args.duration:
                break
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))  # the fault schedule
            before = await restarts(http) + 1 if kind in ("rank", "node") else 0
            t_fault, t_wall = time.monotonic(), time.time()
            what = await asyncio.to_thread(inject, kind, mn, args.engine_id, args.node_cpus, rng)
            await asyncio.sleep(0.5)  # let the fault land before asking whether it is over
            while not await served_again(http, before):
                if time.monotonic() - t_fault > RECOVERY_S:
                    break
                await asyncio.sleep(0.2)  # poll interval
            took = time.monotonic() - t_fault
            if kind == "node":  # re-add: the cluster keeps its size (on the main thread: Ray sets a signal handler)
                mn.add(f"n{next(names)}", args.node_cpus)
            faults.append((kind, what, took, t_wall))
            print(f"{t_fault - t0:7.1f} s  {kind:<16} {what:<44} served again after {took:5.1f} s", flush=True)
    stop.set()


class RSS:
    """The RSS of this process's descendants (the cluster's raylets, GCS, Serve, the actors) by pid, sampled
    now and then from `--rss-from` to the end: growth is first -> last, the samples between show whether it
    levels off."""

    def __init__(self) -> None:
        self.samples: list[dict[int, tuple[str, int]]] = []
        self.series: list[int] = []  # the metric series the head's Ray metrics agent exports, at each sample

    @staticmethod
    def sample(settled_s: float = 0.0) -> dict[int, tuple[str, int]]:
        """RSS by pid; with `settled_s`, only processes at least that old (a worker process Ray is still
        starting, or one just made an actor, is not yet what it will be)."""
        out = {}
        for p in psutil.Process(os.getpid()).children(recursive=True):
            try:
                if time.time() - p.create_time() < settled_s:
                    continue
                out[p.pid] = (f"{p.name()} (pid {p.pid})", p.memory_info().rss)
            except psutil.Error:
                continue
        return out

    def growth(self) -> list[tuple[float, str, list[int]]]:
        """(growth %, process, its RSS at every sample) of the processes alive from the first sample to the last."""
        if len(self.samples) < 2:
            return []
        first, last = self.samples[0], self.samples[-1]
        rows = []
        for pid, (title, a) in first.items():
            if pid in last and a > 0:
                rows.append(((last[pid][1] - a) / a * 100, title, [s[pid][1] for s in self.samples if pid in s]))
        return sorted(rows)


def head_metric_series(head_id: str) -> int:
    """How many series the head node's Ray metrics agent exports (it keeps a dead process's counters and
    histograms: what grows in the agent); -1 when it does not answer."""
    try:
        node = next(n for n in ray.nodes() if n["NodeID"] == head_id)
        text = httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics", timeout=30).text
    except (StopIteration, KeyError, httpx.HTTPError):
        return -1
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


async def rss_watch(rss: RSS, stop: asyncio.Event, at_s: float, every_s: float, head_id: str) -> None:
    settled_s = 30.0  # the first sample skips processes younger than this; the later ones must match its pids
    try:
        await asyncio.wait_for(stop.wait(), at_s)
    except TimeoutError:
        while not stop.is_set():
            rss.samples.append(await asyncio.to_thread(RSS.sample, settled_s))
            rss.series.append(await asyncio.to_thread(head_metric_series, head_id))
            settled_s = 0.0
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                pass
        rss.samples.append(await asyncio.to_thread(RSS.sample))
        rss.series.append(await asyncio.to_thread(head_metric_series, head_id))


def broken_iterations(records: list[dict]) -> list[tuple[int, float, dict]]:
    """Records whose iteration counters differ from the change of the cumulative since the record before:
    (iteration, wall time, cumulative change - counters). Where the whole-run law breaks, and when."""
    out = []
    for prev, rec in zip(records, records[1:], strict=False):
        summed = dict.fromkeys(COUNTERS.values(), 0)
        for bucket in rec["kvCacheIterationStats"].values():
            for it, cum in COUNTERS.items():
                summed[cum] += bucket.get(it, 0)
        diff = {k: rec["kvCacheStats"][k] - prev["kvCacheStats"][k] - v for k, v in summed.items()}
        if any(diff.values()):
            when = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
            out.append((rec["iter"], when, {k: v for k, v in diff.items() if v}))
    return out


def after_fault(t_wall: float, faults: list) -> str:
    """The fault that came last before wall time `t_wall`."""
    before = [f for f in faults if f[3] <= t_wall]
    return before[-1][0] if before else "none"


def conservation(records: list[dict], start: dict, end: dict) -> dict[str, int]:
    summed = dict.fromkeys(COUNTERS.values(), 0)
    for r in records:
        for bucket in r["kvCacheIterationStats"].values():
            for it, cum in COUNTERS.items():
                summed[cum] += bucket.get(it, 0)
    return {k: end[k] - start.get(k, 0) - summed[k] for k in summed}


async def run(mn: mns.MultiNode, args: argparse.Namespace) -> None:
    url = mn.url
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        start_cum = (await http.get("/kv_cache_stats")).json()
    stop, records, cumulative, faults, tally, rss = asyncio.Event(), {}, [], [], Tally(), RSS()
    t0 = time.monotonic()
    read_all = asyncio.Event()  # set once the end is read: the follower then reads on until nothing is new
    follower = asyncio.ensure_future(follow(url, read_all, records, cumulative))
    watcher = asyncio.ensure_future(rss_watch(rss, stop, min(args.rss_from, args.duration / 3), args.rss_every,
                                                mn.head_id))
    traffic_done = asyncio.Event()
    await asyncio.gather(traffic(url, traffic_done, args.clients, args.max_tokens, tally, t0),
                         chaos(mn, args, traffic_done, faults, t0))
    took = time.monotonic() - t0
    stop.set()  # the RSS watcher's end
    await watcher
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not await served_again(http):
            await asyncio.sleep(0.5)  # poll interval: the last fault may still be recovering
        await asyncio.sleep(3.0)  # the last iterations (the probes' too) reach the aggregator and the mirror
        end_cum = (await http.get("/kv_cache_stats")).json()
    read_all.set()
    await follower
    newest = records[max(records)]["kvCacheStats"] if records else end_cum
    if any(newest[k] != end_cum[k] for k in COUNTERS.values()):
        print(f"note: the newest record read is behind /kv_cache_stats: {newest} vs {end_cum}")
    iters = sorted(records)
    gaps = sum(b - a - 1 for a, b in zip(iters, iters[1:], strict=False) if b != a + 1)
    lost = conservation([records[i] for i in iters], start_cum, end_cum)
    backwards = sum(any(b[k] < a[k] for k in COUNTERS.values()) for a, b in zip(cumulative, cumulative[1:],
                                                                                  strict=False))
    print(f"\n{took:.0f} s of traffic, {args.clients} streaming clients, {len(faults)} faults, "
          f"load average {os.getloadavg()[0]:.1f}")
    for kind in FAULTS:
        times = [t for k, _, t, _ in faults if k == kind]
        if times:
            print(f"  {kind:<16} x{len(times)}: recovery p50 {statistics.median(times):.1f} s, max {max(times):.1f} s")
    total = tally.ok + tally.refused + tally.lost
    print(f"requests: {total}: {tally.ok} completed ({tally.resumed} cuts resumed, {tally.retried} refusals "
          f"retried), {tally.refused} refused for good, {tally.lost} lost (chunks, then a failure) -> "
          f"{'OK' if not tally.lost else 'LOST'}; {tally.why}")
    if tally.lost_at:
        by_fault: dict[str, int] = {}
        for t, why in tally.lost_at:
            key = f"{why.split(':')[0]} after {after_fault(t, faults)}"
            by_fault[key] = by_fault.get(key, 0) + 1
        print(f"  refused or lost, by the fault before them: {by_fault}")
    print(f"records: {len(iters)} from iteration {iters[0] if iters else None}, gaps {gaps}; epochs "
          f"{sorted({r['aggregatorEpoch'] for r in records.values()})}")
    print(f"conservation (cumulative change - summed iteration counters): {lost} -> "
          f"{'OK' if not any(lost.values()) else 'MISMATCH'}")
    for it, when, diff in broken_iterations([records[i] for i in iters])[:10]:
        print(f"  iteration {it}: cumulative change - counters {diff}, after the fault {after_fault(when, faults)}")
    print(f"cumulative: {len(cumulative)} samples, went backwards {backwards} times -> "
          f"{'OK' if not backwards else 'BACKWARDS'}")
    growth = rss.growth()
    worst = growth[-3:]
    print(f"RSS of {len(growth)} long-lived processes from {min(args.rss_from, args.duration / 3):.0f} s to the end "
          f"({len(rss.samples)} samples): max growth {worst[-1][0] if worst else 0:.1f}% -> "
          f"{'OK' if not worst or worst[-1][0] < 10 else 'GROWS'}")
    for pct, title, mib in worst:
        print(f"  {pct:5.1f}%  {' '.join(f'{b / 2**20:.1f}' for b in mib)} MiB  {title}")
    print(f"series the head's Ray metrics agent exports: {' '.join(map(str, rss.series))}")


def leftovers(engine_id: str) -> tuple[int, int, int]:
    """After the app is deleted: rank actors alive, placement groups not removed, other alive actors of ours."""
    from ray._private import state

    alive = [a.get("Name") or a.get("ActorClassName", "") for a in state.actors(actor_state_name="ALIVE").values()]
    ranks = [n for n in alive if n.startswith(f"kvfleet-rank-{engine_id}-")]
    pgs = [p for p in ray.util.placement_group_table().values()
           if (p.get("name") or "").startswith(f"kvfleet-{engine_id}-") and p["state"] != "REMOVED"]
    replicas = [n for n in alive if n.startswith(f"SERVE_REPLICA::{APP}#")]
    return len(ranks), len(pgs), len(replicas)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=240.0)
    ap.add_argument("--fault-every", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--nodes", type=int, default=3, help="worker nodes (one more than the groups need: a spare)")
    ap.add_argument("--node-cpus", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="random")
    ap.add_argument("--engine-id", default="chaos")
    ap.add_argument("--faults", type=lambda v: tuple(v.split(",")), default=FAULTS,
                    help=f"the faults to cycle through, comma-separated (default: all: {','.join(FAULTS)})")
    ap.add_argument("--rss-from", type=float, default=600.0, help="the first RSS sample (s; at most duration / 3)")
    ap.add_argument("--rss-every", type=float, default=600.0, help="the RSS samples after the first (s)")
    args = ap.parse_args()
    if set(args.faults) - set(FAULTS):
        ap.error(f"--faults: unknown {sorted(set(args.faults) - set(FAULTS))}; known: {', '.join(FAULTS)}")
    print(f"chaos soak: {args.duration:.0f} s, a fault every {args.fault_every:.0f} s ({', '.join(args.faults)}), "
          f"{args.nodes} worker nodes x {args.node_cpus} CPUs, dp {args.dp} x tp {args.tp}", flush=True)
    mn = mns.start({f"n{i}": (args.node_cpus, {}) for i in range(args.nodes)}, fast_verdict=False)
    try:
        t0 = time.monotonic()
        mns.serve(mn, APP, {"model": args.model, "engine_id": args.engine_id, "dp": str(args.dp),
                            "tp": str(args.tp), "num_cpus_per_rank": "1", "max_seq_len": "512",
                            "restart_backoff_s": "0.5", "placement_timeout_s": "180",
                            "ingress_resource": mns.CONTROL, "engine_resource": mns.CONTROL})
        print(f"app up in {time.monotonic() - t0:.1f} s", flush=True)
        asyncio.run(run(mn, args))
        from ray import serve

        t0 = time.monotonic()
        serve.delete(APP)
        ranks, pgs, replicas = leftovers(args.engine_id)
        print(f"app deleted in {time.monotonic() - t0:.1f} s; left: rank actors {ranks}, placement groups {pgs}, "
              f"replicas {replicas} -> {'OK' if not (ranks or pgs or replicas) else 'LEAK'}")
    finally:
        mns.shutdown(mn)


if __name__ == "__main__":
    main()
