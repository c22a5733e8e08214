"""The fleet at scale: engine replicas of simulated ranks (`model=simulated`), 2 to 16 of them, under a steady
stream sized so each simulated GPU is about 70% busy; what the fleet serves and what its control plane costs.

    python bench/fleet_scale.py [--sizes 2x1,4x1,8x1,16x1,16x1i2,8x2] [--seconds 120] [--speedup 0.1]
                                [--steps 0.2] [--rate 1.2] [--json out.json]

A size is `<engine replicas>x<dp>` (and `i2`: two ingress replicas). Every size runs on a fresh app with the
same settings but the replica count: the default cost profile (an H100 serving Llama-3.1-8B; its KV cache of
~400k tokens on the meta device), `fleet_routing=kv`, and the simulated GPUs slowed to min(`--speedup`,
`--steps` / dp groups) of the profile's speed, so every size steps as often a wall second and 16 engines' control
plane fits on this machine's 2 cores: every time below is in the profile's time (wall time x speedup) except the
fleet view's lag, the router's decision time and the CPU, which are real. Requests: Poisson arrivals at
`--rate` requests per second per dp group (profile time; 1.2: ~70% busy), each one of 64 shared 512-token
system prompts (Zipf) + a unique 512-token question, 128 output tokens, streamed over HTTP.

Per size it prints: output tokens/s and its ratio to linear from the smallest size (target >= 0.9 from 2 to
16; with `--concurrency C`, C streams per dp group in a closed loop instead of the Poisson stream, the tokens
streamed within the window: the fleet's capacity), TTFT and ITL p50/p99, the groups' busy share (their steps'
time over the run), the fleet view's lag (a record's timestamp to an SSE reader of the merged /stats/stream: p99
< 500 ms at 16), the kv router's decision time p50/p99 (/metrics: < 5 ms at 16), the followers' calls per second,
the CPU per request and per record of the ingress replicas, and the RSS of each kind of long-lived process (the
mean and the sum). No assertions on time.
"""

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import time
from datetime import datetime

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx  # noqa: E402
import psutil  # noqa: E402
import ray  # noqa: E402

from deployment import build_app  # noqa: E402
from deployment.clients.trace import TraceRequest, percentile, timed_completion  # noqa: E402

PORT = 8391
SYSTEMS, SYSTEM_TOKENS, QUESTION_TOKENS, OUTPUT_TOKENS = 64, 512, 512, 128


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)

    def text(k: int) -> str:
        return "".join(chr(rng.randrange(33, 127)) for _ in range(k))

    systems = [text(SYSTEM_TOKENS) for _ in range(SYSTEMS)]
    weights = [1 / (k + 1) for k in range(SYSTEMS)]
    return [rng.choices(systems, weights)[0] + text(QUESTION_TOKENS) for _ in range(n)]


def processes() -> dict[int, str]:
    """pid -> kind of every actor process of this driver's Ray (its children: another Ray on the machine is
    not counted), by the title Ray gives it (`ray::<class>`, `ray::ServeReplica:<app>:<deployment>`)."""
    kinds = {}
    for p in psutil.Process(os.getpid()).children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if not title.startswith("ray::"):
            continue
        for mark, kind in (("KVFleetIngress", "ingress"), ("KVFleetEngine", "engine"), ("RankWorker", "rank"),
                           ("StatsAggregator", "aggregator"), ("ServeController", "serve controller"),
                           ("ProxyActor", "serve proxy")):
            if mark in title:
                kinds[p.pid] = kind
                break
    return kinds


def cpu_of(pids) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def router_figures(url: str, scrapes: int = 12) -> dict[str, dict[str, float]]:
    """Per ingress replica: its kv router's decision quantiles and follower calls, from /metrics (each scrape
    is answered by one ingress replica: scrape until each has)."""
    out: dict[str, dict[str, float]] = {}
    pat = re.compile(r'^(kvfleet_router_\w+)\{ingress="([^"]+)"(?:,quantile="([\d.]+)")?\} (\S+)$', re.M)
    for _ in range(scrapes):
        text = httpx.get(f"{url}/metrics", timeout=30).text
        for name, ingress, q, value in pat.findall(text):
            kind = "decision_cpu" if "cpu" in name else "decision"
            key = f"{kind}_p{round(float(q) * 100)}" if q else "follow_calls"
            out.setdefault(ingress, {})[key] = float(value)
    return out


async def stream_lag(url: str, since: dict[str, int], stop: asyncio.Event, lags: list[float],
                     records: list[int]) -> None:
    """Read the merged /stats/stream from `since` (engine -> iteration), recording each record's age on arrival."""
    cursor = ",".join(f"{e}:{i}" for e, i in since.items())
    async with httpx.AsyncClient(base_url=url, timeout=None) as http:
        async with http.stream("GET", "/stats/stream", params={"since": cursor}) as r:
            async for line in r.aiter_lines():
                if stop.is_set():
                    return
                if line.startswith("data: {"):
                    now = time.time()
                    rec = json.loads(line[6:])
                    ts = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
                    lags.append(now - ts)
                    records.append(1)


async def one(http: httpx.AsyncClient, prompt: str, max_tokens: int = OUTPUT_TOKENS) -> tuple[float, float, int]:
    """(TTFT, mean ITL, output tokens) of one streamed completion, in wall seconds."""
    r = await timed_completion(http, TraceRequest(0.0, prompt, max_tokens, ()))
    if r.error:
        raise httpx.HTTPError(r.error)
    return r.ttft_s, r.itl_s, r.output_tokens


async def closed(url: str, concurrency: int, seconds: float, seed: int) -> tuple[list, float, int]:
    """`concurrency` streams, each sending its next request when its last ends, for `seconds`: every request's
    result, the wall time, and the tokens streamed within the window (the fleet's capacity)."""
    texts = iter(prompts(100_000, seed))
    results: list = []
    in_window = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        deadline = t0 + seconds

        async def stream() -> None:
            nonlocal in_window
            while time.perf_counter() < deadline:
                body = {"prompt": next(texts), "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                sent, first, last, n = time.perf_counter(), None, None, 0
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            last = time.perf_counter()
                            first = first or last
                            n += 1
                            in_window += last <= deadline
                results.append((first - sent, (last - first) / max(1, n - 1), n))

        await asyncio.gather(*(stream() for _ in range(concurrency)))
        return results, seconds, in_window


async def load(url: str, rate_wall: float, seconds: float, seed: int) -> tuple[list, float]:
    """Poisson arrivals at `rate_wall` a second for `seconds`; every request's result and the wall time."""
    rng = random.Random(seed)
    texts = prompts(int(rate_wall * seconds * 1.5) + 10, seed)
    results, tasks = [], []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        async def run(p: str) -> None:
            try:
                results.append(await one(http, p))
            except httpx.HTTPError as exc:
                results.append(exc)

        t0 = time.perf_counter()
        at = 0.0
        for p in texts:
            at += rng.expovariate(rate_wall)
            if at > seconds:
                break
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(run(p)))
        await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def busy_share(url: str, since_iters: dict[str, int], wall: float, groups: int) -> float:
    """The groups' steps' wall time over the run, per group: how busy the (simulated) GPUs were."""
    from deployment.clients.client import StatsClient

    total_ms = 0.0
    with StatsClient(url) as client:
        for r in client.get_all_stats():
            if r["iter"] > since_iters.get(r["engineId"], -1):
                total_ms += r.get("iterLatencyMS", 0.0)
    return total_ms / 1000 / wall / groups


def latest_iters(url: str) -> dict[str, int]:
    from deployment.clients.client import StatsClient

    out: dict[str, int] = {}
    with StatsClient(url) as client:
        for r in client.get_all_stats():
            out[r["engineId"]] = max(out.get(r["engineId"], -1), r["iter"])
    return out


async def run_size(size: str, args: argparse.Namespace) -> dict:
    from ray import serve

    m = re.fullmatch(r"(\d+)x(\d+)(?:i(\d+))?", size)
    replicas, dp, ingress = int(m[1]), int(m[2]), int(m[3] or 1)
    groups = replicas * dp
    speedup = min(args.speedup, args.steps / groups)  # the same steps a wall second at every size
    settings = {"model": "simulated", "engine_id": "scale", "engine_replicas": str(replicas), "dp": str(dp),
                "ingress_replicas": str(ingress), "tp": "1", "max_seq_len": "8192", "host_cache_bytes": "0",
                "max_num_seqs": "128", "max_num_batched_tokens": "8192", "fleet_routing": "kv",
                "simulated_speedup_ratio": str(speedup), "num_cpus_per_rank": "0.01",
                "placement_timeout_s": "300"}
    t = time.perf_counter()
    serve.run(build_app(settings), name="scale", route_prefix="/")
    started = time.perf_counter() - t
    url = f"http://127.0.0.1:{PORT}"
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:  # warm every replica once
        await asyncio.gather(*(one(http, p, 1) for p in prompts(2 * replicas, seed=99)))
    kinds = processes()
    since = latest_iters(url)
    cpu0 = cpu_of(kinds)
    stop, lags, records = asyncio.Event(), [], []
    reader = asyncio.create_task(stream_lag(url, since, stop, lags, records))
    before = router_figures(url)
    if args.concurrency:
        results, wall, tokens = await closed(url, args.concurrency * groups, args.seconds, seed=replicas)
    else:
        results, wall = await load(url, args.rate * groups * speedup, args.seconds, seed=replicas)
        tokens = sum(r[2] for r in results if not isinstance(r, Exception))
    after = router_figures(url)
    stop.set()
    cpu1 = cpu_of(kinds)
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    ok = [r for r in results if not isinstance(r, Exception)]
    sim = speedup  # wall seconds x this = the profile's seconds
    rss: dict[str, list[int]] = {}
    cpu: dict[str, float] = {}
    for pid, kind in kinds.items():
        try:
            rss.setdefault(kind, []).append(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            continue
        cpu[kind] = cpu.get(kind, 0.0) + cpu1.get(pid, 0.0) - cpu0.get(pid, 0.0)
    follow = sum(v.get("follow_calls", 0) for v in after.values()) - sum(
        v.get("follow_calls", 0) for v in before.values())
    row = {
        "size": size, "replicas": replicas, "dp": dp, "ingress": ingress, "start_s": started, "speedup": speedup,
        "requests": len(results), "failed": len(results) - len(ok),
        "tok_s": tokens / (wall * sim),
        "ttft_p50": percentile([r[0] * sim for r in ok], 0.5), "ttft_p99": percentile([r[0] * sim for r in ok], 0.99),
        "itl_p50": percentile([r[1] * sim for r in ok], 0.5), "itl_p99": percentile([r[1] * sim for r in ok], 0.99),
        "busy": busy_share(url, since, wall, groups),
        "lag_p50": percentile(lags, 0.5), "lag_p99": percentile(lags, 0.99), "records": len(records),
        "decision_p50": max((v.get("decision_p50", 0) for v in after.values()), default=0),
        "decision_p99": max((v.get("decision_p99", 0) for v in after.values()), default=0),
        "decision_cpu_p99": max((v.get("decision_cpu_p99", 0) for v in after.values()), default=0),
        "follow_per_s": follow / wall,
        "ingress_cpu_per_req_ms": cpu.get("ingress", 0) / max(1, len(results)) * 1e3,
        "ingress_cpu_per_record_ms": cpu.get("ingress", 0) / max(1, len(records)) * 1e3,
        "cpu_cores": {k: v / wall for k, v in sorted(cpu.items())},
        "rss_mb": {k: (statistics.mean(v) / 2**20, sum(v) / 2**20, len(v)) for k, v in sorted(rss.items())},
    }
    serve.delete("scale")
    remove_aggregators(settings_ids(replicas))
    return row


def settings_ids(replicas: int) -> list[str]:
    return [f"scale-{r}" for r in range(replicas)]


def remove_aggregators(engine_ids: list[str]) -> None:
    """The detached aggregators an app leaves (kept for a next engine of the same id): the next size starts
    clean, and its processes are its own."""
    from aggregator.actor import NAMESPACE, aggregator_name

    for eid in engine_ids:
        try:
            ray.kill(ray.get_actor(aggregator_name(eid), namespace=NAMESPACE))
        except ValueError:
            pass


async def main(args: argparse.Namespace) -> None:
    from ray import serve

    ray.init(address="local", num_cpus=256, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    rows = []
    for size in args.sizes.split(","):
        rows.append(await run_size(size, args))
        print(json.dumps(rows[-1]), flush=True)
    serve.shutdown()
    ray.shutdown()
    base = rows[0]
    per_group = base["tok_s"] / (base["replicas"] * base["dp"])
    print(f"\n{args.rate} req/s per group, {args.seconds:.0f} wall s a size, the simulated GPUs at "
          f"min({args.speedup}, {args.steps}/groups) of the profile's speed; times in the profile's seconds, but the "
          "fleet view's lag and the router's decisions (wall)")
    print(f"{'size':<8}{'req':>5}{'fail':>5}{'tok/s':>8}{'lin':>6}{'busy':>6}{'TTFT p50/p99 ms':>17}"
          f"{'ITL p50/p99':>13}{'lag p50/p99 ms':>16}{'decide p50/p99 ms':>19}{'follow/s':>9}"
          f"{'ingress ms/req':>15}{'ms/rec':>7}")
    for r in rows:
        linear = r["tok_s"] / (per_group * r["replicas"] * r["dp"])
        print(f"{r['size']:<8}{r['requests']:>5}{r['failed']:>5}{r['tok_s']:>8.0f}{linear:>6.2f}{r['busy']:>6.0%}"
              f"{r['ttft_p50'] * 1e3:>8.0f}/{r['ttft_p99'] * 1e3:<8.0f}{r['itl_p50'] * 1e3:>6.1f}/"
              f"{r['itl_p99'] * 1e3:<6.1f}{r['lag_p50'] * 1e3:>8.0f}/{r['lag_p99'] * 1e3:<7.0f}"
              f"{r['decision_p50'] * 1e3:>9.2f}/{r['decision_p99'] * 1e3:<9.2f}{r['follow_per_s']:>9.1f}"
              f"{r['ingress_cpu_per_req_ms']:>15.1f}{r['ingress_cpu_per_record_ms']:>7.2f}")
    print("\nRSS MB per process (mean; sum over the kind), and CPU cores used during the run:")
    for r in rows:
        mem = ", ".join(f"{k} {m:.0f} (x{n}: {s:.0f})" for k, (m, s, n) in r["rss_mb"].items())
        cores = ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_cores"].items())
        print(f"{r['size']:<8} {mem}\n{'':8} cores: {cores}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2x1,4x1,8x1,16x1,16x1i2,8x2")
    ap.add_argument("--seconds", type=float, default=120.0, help="wall seconds of load per size")
    ap.add_argument("--speedup", type=float, default=0.1, help="the simulated GPUs' speed (of the profile's) at most")
    ap.add_argument("--steps", type=float, default=0.2, help="the speed is this over the dp groups, at most "
                    "--speedup: as many steps a wall second at every size, what 2 cores keep up with")
    ap.add_argument("--rate", type=float, default=1.2, help="requests per second per dp group (profile time)")
    ap.add_argument("--concurrency", type=int, default=0, help="closed loop instead: this many streams per dp "
                    "group, tokens/s counted within the window (the fleet's capacity)")
    ap.add_argument("--json", help="write the rows here too")
    asyncio.run(main(ap.parse_args()))
