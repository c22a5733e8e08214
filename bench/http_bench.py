"""HTTP benchmark: what statistics readers cost generation, and the split's own cost, in one run.

    python bench/http_bench.py                       # starts a local app (CPU settings) and benchmarks it
    python bench/http_bench.py --url http://127.0.0.1:8000 --duration 10

Rows (targets of issue 12):
- completions/s with no reader, then with 50 pollers asking `/stats?since=<last>` once a second each:
  /stats p99 < 50 ms, completions/s >= 0.9x the no-reader run;
- 20 clients as fast as they can: `/stats?since=<latest>` vs `/v1/models` (the Serve floor): ratio >= 0.9;
- 100 `/stats/stream` subscribers: lag p99 < 100 ms (lag = parse time - the record's `timestamp`);
- the completion path through the split: a 1-token completion over HTTP (ingress -> engine handle) vs the
  same request sent straight to the engine deployment's handle (no HTTP, no ingress), p50 of each;
- 100 `/stats/stream` subscribers of a simulated 100 records/s source (bench/stats_source.py: the real ingress,
  no engine) at `interval_ms` 0 vs 500 (issue 28): proxy + ingress CPU per record, lag p99. `--sim-only`
  runs this row alone.
- `--token-path` (issue 37), alone: token streams from the engine to the client by `token_transport` (grpc, the
  default, vs actor_calls), on simulated ranks (they sleep a GPU's step time, so what is measured is the CPU of
  the token path itself): 256 requests streamed at once, 64 tokens each; CPU ms a token of the proxy, the ingress
  and the engine, and tokens/s; the transports alternate over `--rounds`.

The readers run in a process of their own (a dashboard is another client than the one generating), and on
this shared machine they read every byte but decode only what they measure by (a poll's cursor, an event's
iteration and timestamp): the bench charges the server for what readers cost, not the client's JSON parser.
Each row also gives the CPU, in % of one core, that the reader process and each part of the app used (the
app's parts: only the processes on this machine, so zeros for an app elsewhere).
"""

import argparse
import asyncio
import collections
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from datetime import datetime

import httpx
import psutil


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _traffic(http: httpx.AsyncClient, stop: asyncio.Event, concurrency: int) -> int:
    sent = 0

    async def worker(k: int) -> None:
        nonlocal sent
        i = 0
        while not stop.is_set():
            prompt = f"shared benchmark prefix about kv caches and ranks {k % 2} | request {i}"
            try:
                await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=120)
                sent += 1
            except httpx.HTTPError:
                pass
            i += 1

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return sent


def _cursor(body: bytes) -> int | None:
    """The last record's `iter` of a /stats body, without decoding the rest (records are compact JSON that
    start with their iteration: deployment/ingress/stats/mirror.py)."""
    at = body.rfind(b'{"iter":')
    return None if at < 0 else int(body[at + 8:body.index(b",", at)])


async def _poller(http: httpx.AsyncClient, stop: asyncio.Event, lat: list[float], every_s: float | None,
                  since: int = -1) -> None:
    if every_s:  # dashboards poll at their own phase: 50 polls in the same millisecond are a burst, not a load
        await asyncio.sleep(random.random() * every_s)
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await http.get("/stats", params={"since": since, "limit": 100})
        lat.append(time.perf_counter() - t0)
        last = _cursor(r.content)
        if last is not None:
            since = last
        if every_s:
            await asyncio.sleep(max(0.0, t0 + every_s - time.perf_counter()))


async def _hammer(http: httpx.AsyncClient, stop: asyncio.Event, path: str, params: dict, n: list[int]) -> None:
    while not stop.is_set():
        r = await http.get(path, params=params)
        r.raise_for_status()
        n[0] += 1


async def _subscriber(http: httpx.AsyncClient, stop: asyncio.Event, since: int, got: list[int],
                      lags: list[float], interval_ms: int = 0) -> None:
    """Reads every event; decodes its `id:` (the iteration) and the record's timestamp, which the compact
    record text carries right after its iteration."""
    params = {"since": since, "interval_ms": interval_ms}
    async with http.stream("GET", "/stats/stream", params=params, timeout=None) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("id: "):
                got.append(int(line[4:]))
            elif line.startswith('data: {"iter":'):
                at = line.index('"timestamp":"') + 13
                stamp = line[at:line.index('"', at)]
                lags.append(time.time() - datetime.fromisoformat(stamp).timestamp())
            if stop.is_set():
                return


async def _latest_iter(http: httpx.AsyncClient) -> int:
    since, last = -1, -1
    while True:
        page = (await http.get("/stats", params={"since": since, "limit": 1000})).json()
        if not page:
            return last
        last = since = page[-1]["iter"]


ROLES = {"ProxyActor": "proxy", "KVFleetIngress": "ingress", "KVFleetEngine": "engine", "RankWorker": "ranks",
         "StatsAggregator": "aggregator", "SimulatedStats": "source"}


def _cpu_times() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of the app's processes on this machine, by pid, with their role."""
    out = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        role = next((r for key, r in ROLES.items() if key in cmd), None)
        if role is None and "ray" in cmd and "http_bench" not in cmd:
            role = "ray-other"  # GCS, raylet, Serve's controller, ...
        if role is not None:
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                out[proc.pid] = (role, t.user + t.system)
    return out


def _cpu_since(before: dict[int, tuple[str, float]], seconds: float) -> dict[str, float]:
    """% of one core each role used since `before`."""
    used: collections.Counter = collections.Counter()
    for pid, (role, t) in _cpu_times().items():
        if pid in before:
            used[role] += 100 * (t - before[pid][1]) / seconds
    return {f"cpu_{role}": round(used[role], 1) for role in (*ROLES.values(), "ray-other")}


def _readers(kind: str, url: str, n: int, interval_ms: int, ready, stop, send) -> None:
    """The reader process: `n` pollers (each once a second) or SSE subscribers (at `interval_ms`) until `stop`
    is set; sends back its figures and the CPU it used itself."""

    async def run() -> dict:
        limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
            stopping = asyncio.Event()
            lat: list[float] = []
            got: list[list[int]] = [[] for _ in range(n)]
            if kind == "pollers":
                tasks = [asyncio.create_task(_poller(http, stopping, lat, 1.0)) for _ in range(n)]
            else:
                since = await _latest_iter(http)
                tasks = [asyncio.create_task(_subscriber(http, stopping, since, g, lat, interval_ms)) for g in got]
            ready.set()
            cpu0, t0 = time.process_time(), time.perf_counter()
            await asyncio.to_thread(stop.wait)
            stopping.set()
            cpu = 100 * (time.process_time() - cpu0) / (time.perf_counter() - t0)
            if kind == "subscribers":
                await asyncio.sleep(2.0)  # let subscribers drain what was emitted before the stop
                for t in tasks:
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        out = {"cpu_readers": round(cpu)}
        if kind == "pollers":
            return {"polls": len(lat), "p50_ms": 1e3 * _pct(lat, 0.50), "p99_ms": 1e3 * _pct(lat, 0.99), **out}
        gaps = sum(1 for g in got for a, b in zip(g, g[1:], strict=False) if b <= a)
        return {"records_delivered": sum(map(len, got)), "out_of_order": gaps,
                "lag_p50_ms": 1e3 * _pct(lat, 0.5), "lag_p99_ms": 1e3 * _pct(lat, 0.99), **out}

    send.send(asyncio.run(run()))


async def _phase(url: str, duration: float, traffic: int, readers: tuple[str, int] | None = None,
                 interval_ms: int = 0) -> dict:
    """`traffic` completion workers for `duration` s, with `readers` (kind, count) in a process of their own."""
    proc = None
    if readers is not None:
        ctx = mp.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_readers, args=(readers[0], url, readers[1], interval_ms, ready, stop, send))
        proc.start()
        if not await asyncio.to_thread(ready.wait, 120):
            raise RuntimeError("the reader process did not start")
    limits = httpx.Limits(max_connections=traffic + 5, max_keepalive_connections=traffic + 5)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        stop_traffic = asyncio.Event()
        cpu0 = _cpu_times()
        bg = asyncio.create_task(_traffic(http, stop_traffic, traffic))
        t0 = time.perf_counter()
        await asyncio.sleep(duration)  # the measurement window
        stop_traffic.set()
        elapsed = time.perf_counter() - t0
        if proc is not None:
            stop.set()
        out = _cpu_since(cpu0, elapsed)
        out["completions_per_s"] = await bg / elapsed
    if proc is not None:
        out.update(await asyncio.to_thread(recv.recv))
        proc.join()
    return out


async def route_rate(url: str, path: str, clients: int, duration: float) -> float:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        params = {"since": await _latest_iter(http), "limit": 100} if path == "/stats" else {}
        stop, n = asyncio.Event(), [0]
        tasks = [asyncio.create_task(_hammer(http, stop, path, params, n)) for _ in range(clients)]
        await asyncio.sleep(duration)  # the measurement window
        stop.set()
        await asyncio.gather(*tasks)
        return n[0] / duration


async def completion_overhead(url: str, app_name: str | None, n: int = 20) -> dict:
    body = {"prompt": "a short prompt for one token", "max_tokens": 1}
    http_lat, handle_lat = [], []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for _ in range(n):
            t0 = time.perf_counter()
            (await http.post("/v1/completions", json=body)).raise_for_status()
            http_lat.append(time.perf_counter() - t0)
    if app_name is not None:
        from ray import serve

        from engine.messages import GenerateRequest
        from workers.sampling_params import SamplingParams

        handle = serve.get_deployment_handle("KVFleetEngine", app_name).options(stream=True)
        ids = list(body["prompt"].encode())
        for _ in range(n):
            t0 = time.perf_counter()
            one = GenerateRequest(ids, SamplingParams(max_tokens=1, temperature=0.0))
            async for _ev in handle.generate.remote(one):
                pass
            handle_lat.append(time.perf_counter() - t0)
    return {"http_p50_ms": 1e3 * _pct(http_lat, 0.5), "engine_handle_p50_ms": 1e3 * _pct(handle_lat, 0.5)}


async def simulated_rows(url: str, duration: float, subscribers: int, rate: float) -> list[tuple[str, dict]]:
    """`subscribers` SSE readers of the simulated source at interval 0 and 500 ms: the proxy's and the
    ingress's CPU per record emitted (all subscribers; and per subscriber), lag, and the share delivered."""
    rows, per = [], {}
    for interval in (0, 500):
        r = await _phase(url, duration, 0, ("subscribers", subscribers), interval)
        cpu_s = (r["cpu_proxy"] + r["cpu_ingress"]) / 100 / rate  # CPU seconds per record emitted
        per[interval] = (cpu_s, r["lag_p99_ms"])
        rows.append((f"sse, {subscribers} subs, {rate:g} rec/s, {interval} ms", {
            k: r[k] for k in ("cpu_proxy", "cpu_ingress", "cpu_source", "cpu_readers", "lag_p50_ms", "lag_p99_ms",
                              "out_of_order")} | {
            "delivered_share": r["records_delivered"] / (subscribers * rate * duration),
            "proxy_ingress_ms_per_record": 1e3 * cpu_s, "us_per_record_and_sub": 1e6 * cpu_s / subscribers}))
    rows.append(("  500 ms / 0 ms", {"cpu_per_record_ratio": per[500][0] / per[0][0],
                                     "lag_p99_ratio": per[500][1] / per[0][1]}))
    return rows


TOKEN_PATH_SETTINGS = {"model": "simulated", "dp": "1", "tp": "1", "num_cpus_per_rank": "0.1", "max_seq_len": "1024",
                       "host_cache_bytes": "0"}


async def _stream_all(url: str, prompts: list[list[int]], max_tokens: int) -> int:
    """Every prompt at once, streamed: the tokens received."""
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        async def one(prompt: list[int]) -> int:
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            n = 0
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    n += line.startswith("data: {")
            return n

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def token_path_rows(serve_url: str, rounds: int, requests: int, max_tokens: int) -> list[tuple[str, dict]]:
    """Token streams engine -> ingress -> proxy -> client by `token_transport`, on simulated ranks (they sleep a
    GPU's step, so the token path is what the machine's CPU does): `requests` streamed at once, `max_tokens`
    each; CPU ms a token of the proxy, ingress and engine, and tokens/s. Transports alternate by round."""
    from ray import serve

    from deployment import build_app

    rng = random.Random(0)
    got: dict[str, list[dict]] = {"grpc": [], "actor_calls": []}
    for r in range(rounds):
        for transport in ("grpc", "actor_calls") if r % 2 == 0 else ("actor_calls", "grpc"):
            name = f"kvfleet-tokens-{transport}-{r}"
            settings = {**TOKEN_PATH_SETTINGS, "engine_id": name, "token_transport": transport}
            url = _run_app(serve_url, build_app(settings), name, f"/{name}")
            prompts = [[rng.randrange(5, 250) for _ in range(64)] for _ in range(requests)]
            asyncio.run(_stream_all(url, prompts[:4], 4))  # first-call costs
            cpu0 = _cpu_times()
            t0 = time.perf_counter()
            tokens = asyncio.run(_stream_all(url, prompts, max_tokens))
            elapsed = time.perf_counter() - t0
            cpu = _cpu_since(cpu0, elapsed)
            ms = {role: cpu[f"cpu_{role}"] / 100 * elapsed / tokens * 1e3 for role in ("proxy", "ingress", "engine")}
            got[transport].append({**{f"{k}_ms_per_token": v for k, v in ms.items()},
                                   "path_ms_per_token": sum(ms.values()), "tokens_per_s": tokens / elapsed})
            serve.delete(name)
    rows = []
    for transport, runs in got.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        rows.append((f"token path, {transport} (median of {len(runs)})", med))
    g, a = rows[0][1], rows[1][1]
    rows.append(("token path, grpc / actor_calls", {"path_cpu_ratio": g["path_ms_per_token"] / a["path_ms_per_token"],
                                                   "tokens_per_s_ratio": g["tokens_per_s"] / a["tokens_per_s"]}))
    return rows


def _start_serve() -> str:
    import ray
    from ray import serve

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo: tests.support
    from tests.support.e2e_fixtures import free_port

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def _run_app(base: str, app, name: str, prefix: str) -> str:
    from ray import serve

    from tests.support.e2e_fixtures import wait_healthy

    serve.run(app, name=name, route_prefix=prefix)
    url = base + prefix.rstrip("/")
    wait_healthy(url, 300)
    return url


def _print(rows: list[tuple[str, dict]]) -> None:
    for name, row in rows:
        print(f"{name:36s} " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in row.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running app; default: start one locally")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    p.add_argument("--pollers", type=int, default=50)
    p.add_argument("--subscribers", type=int, default=100)
    p.add_argument("--traffic", type=int, default=2, help="concurrent background completion requests")
    p.add_argument("--sim-rate", type=float, default=100.0, help="records/s of the simulated source")
    p.add_argument("--sim-only", action="store_true", help="only the simulated source's rows (starts no engine)")
    p.add_argument("--token-path", action="store_true",
                   help="only the token streams' rows: `token_transport` grpc vs actor_calls on simulated ranks")
    p.add_argument("--rounds", type=int, default=2, help="--token-path: rounds of both transports")
    a = p.parse_args(argv)
    serve_url = None if a.url else _start_serve()
    if a.token_path:
        if serve_url is None:
            p.error("--token-path starts its own apps: leave --url out")
        _print(token_path_rows(serve_url, a.rounds, 256, 64))
        return 0
    if a.sim_only:
        from stats_source import simulated_app  # beside this script

        url = _run_app(serve_url, simulated_app(a.sim_rate), "kvfleet-sim", "/sim")
        _print(asyncio.run(simulated_rows(url, a.duration, a.subscribers, a.sim_rate)))
        return 0
    if a.url:
        url = a.url
    else:
        from deployment import build_app
        from tests.support.e2e_fixtures import E2E_SETTINGS

        url = _run_app(serve_url, build_app(E2E_SETTINGS), "kvfleet-bench", "/")
    app_name = None if a.url else "kvfleet-bench"
    base = asyncio.run(_phase(url, a.duration, a.traffic))
    polled = asyncio.run(_phase(url, a.duration, a.traffic, ("pollers", a.pollers)))
    models = asyncio.run(route_rate(url, "/v1/models", 20, a.duration))
    stats = asyncio.run(route_rate(url, "/stats", 20, a.duration))
    sse = asyncio.run(_phase(url, a.duration, a.traffic, ("subscribers", a.subscribers)))
    split = asyncio.run(completion_overhead(url, app_name))
    rows = [
        ("completions, no reader", base),
        (f"completions + {a.pollers} pollers at 1/s", {
            **polled, "completions_ratio": polled["completions_per_s"] / base["completions_per_s"]}),
        ("20 clients: /stats vs /v1/models", {"stats_per_s": stats, "models_per_s": models,
                                              "ratio": stats / models}),
        (f"sse, {a.subscribers} subscribers", {
            **sse, "completions_ratio": sse["completions_per_s"] / base["completions_per_s"]}),
        ("1-token completion", {**split, "split_overhead_ms": split["http_p50_ms"] - split["engine_handle_p50_ms"]}),
    ]
    if serve_url is not None:  # the simulated source beside the idle app (its engine's ranks stay idle)
        from stats_source import simulated_app  # beside this script

        sim = _run_app(serve_url, simulated_app(a.sim_rate), "kvfleet-sim", "/sim")
        rows += asyncio.run(simulated_rows(sim, a.duration, a.subscribers, a.sim_rate))
    _print(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
