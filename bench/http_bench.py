"""HTTP benchmark: what statistics readers cost generation, and the split's own cost, in one run.

    python bench/http_bench.py                       # starts a local app (CPU settings) and benchmarks it
    python bench/http_bench.py --url http://127.0.0.1:8000 --duration 10

Rows (targets of issue 12):
- completions/s with no reader, then with 50 pollers asking `/stats?since=<last>` once a second each:
  /stats p99 < 50 ms, completions/s >= 0.9x the no-reader run;
- 20 clients as fast as they can: `/stats?since=<latest>` vs `/v1/models` (the Serve floor): ratio >= 0.9;
- 100 `/stats/stream` subscribers: lag p99 < 100 ms (lag = parse time - the record's `timestamp`);
- the completion path through the split: a 1-token completion over HTTP (ingress -> engine handle) vs the
  same request sent straight to the engine deployment's handle (no HTTP, no ingress), p50 of each.
"""

import argparse
import asyncio
import json
import random
import sys
import time
from datetime import datetime

import httpx

from deployment.sse import SSEDecoder


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


async def _poller(http: httpx.AsyncClient, stop: asyncio.Event, lat: list[float], every_s: float | None,
                  since: int = -1) -> None:
    if every_s:  # dashboards poll at their own phase: 50 polls in the same millisecond are a burst, not a load
        await asyncio.sleep(random.random() * every_s)
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await http.get("/stats", params={"since": since, "limit": 100})
        lat.append(time.perf_counter() - t0)
        records = r.json()
        if records:
            since = records[-1]["iter"]
        if every_s:
            await asyncio.sleep(max(0.0, t0 + every_s - time.perf_counter()))


async def _hammer(http: httpx.AsyncClient, stop: asyncio.Event, path: str, params: dict, n: list[int]) -> None:
    while not stop.is_set():
        r = await http.get(path, params=params)
        r.raise_for_status()
        n[0] += 1


async def _subscriber(http: httpx.AsyncClient, stop: asyncio.Event, since: int, got: list[int],
                      lags: list[float]) -> None:
    dec = SSEDecoder()
    async with http.stream("GET", "/stats/stream", params={"since": since}, timeout=None) as resp:
        async for line in resp.aiter_lines():
            ev = dec.feed(line)
            if ev is not None and ev.event == "stats":
                rec = json.loads(ev.data)
                lags.append(time.time() - datetime.fromisoformat(rec["timestamp"]).timestamp())
                got.append(rec["iter"])
            if stop.is_set():
                return


async def _latest_iter(http: httpx.AsyncClient) -> int:
    since, last = -1, -1
    while True:
        page = (await http.get("/stats", params={"since": since, "limit": 1000})).json()
        if not page:
            return last
        last = since = page[-1]["iter"]


async def _phase(url: str, duration: float, traffic: int, body) -> dict:
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        stop = asyncio.Event()
        bg = asyncio.create_task(_traffic(http, stop, traffic))
        t0 = time.perf_counter()
        result = await body(http, stop)
        await asyncio.sleep(duration)  # the measurement window
        stop.set()
        elapsed = time.perf_counter() - t0
        out = await result(elapsed)
        out["completions"] = await bg
        return out


async def completions_only(url: str, duration: float, traffic: int) -> dict:
    async def body(http, stop):
        async def result(elapsed):
            return {"elapsed": elapsed}
        return result

    out = await _phase(url, duration, traffic, body)
    return {"completions_per_s": out["completions"] / out["elapsed"]}


async def stats_latency(url: str, pollers: int, duration: float, traffic: int) -> dict:
    async def body(http, stop):
        lat: list[float] = []
        tasks = [asyncio.create_task(_poller(http, stop, lat, 1.0)) for _ in range(pollers)]

        async def result(elapsed):
            await asyncio.gather(*tasks)
            return {"elapsed": elapsed, "pollers": pollers, "polls": len(lat), "p50_ms": 1e3 * _pct(lat, 0.50),
                    "p99_ms": 1e3 * _pct(lat, 0.99)}
        return result

    out = await _phase(url, duration, traffic, body)
    out["completions_per_s"] = out.pop("completions") / out.pop("elapsed")
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

        from workers.sampling import SamplingParams

        handle = serve.get_deployment_handle("KVFleetEngine", app_name).options(stream=True)
        ids = list(body["prompt"].encode())
        for _ in range(n):
            t0 = time.perf_counter()
            async for _ev in handle.generate.remote(None, ids, SamplingParams(max_tokens=1, temperature=0.0)):
                pass
            handle_lat.append(time.perf_counter() - t0)
    return {"http_p50_ms": 1e3 * _pct(http_lat, 0.5), "engine_handle_p50_ms": 1e3 * _pct(handle_lat, 0.5)}


async def sse_fanout(url: str, subscribers: int, duration: float, traffic: int) -> dict:
    async def body(http, stop):
        since = await _latest_iter(http)
        got: list[list[int]] = [[] for _ in range(subscribers)]
        lags: list[float] = []
        tasks = [asyncio.create_task(_subscriber(http, stop, since, g, lags)) for g in got]

        async def result(elapsed):
            await asyncio.sleep(2.0)  # let subscribers drain what was emitted before the stop
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            delivered = sum(len(g) for g in got)
            gaps = sum(1 for g in got for a, b in zip(g, g[1:], strict=False) if b <= a)
            return {"subscribers": subscribers, "records_delivered": delivered, "out_of_order": gaps,
                    "lag_p50_ms": 1e3 * _pct(lags, 0.5), "lag_p99_ms": 1e3 * _pct(lags, 0.99)}
        return result

    return await _phase(url, duration, traffic, body)


def _start_local_app() -> str:
    import ray
    from ray import serve

    from deployment import build_app

    sys.path.insert(0, "tests")
    from e2e_fixtures import E2E_SETTINGS, free_port, wait_healthy

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(E2E_SETTINGS), name="kvfleet-bench", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 300)
    return url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running app; default: start one locally")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    p.add_argument("--pollers", type=int, default=50)
    p.add_argument("--subscribers", type=int, default=100)
    p.add_argument("--traffic", type=int, default=2, help="concurrent background completion requests")
    a = p.parse_args(argv)
    url = a.url or _start_local_app()
    app_name = None if a.url else "kvfleet-bench"
    base = asyncio.run(completions_only(url, a.duration, a.traffic))
    polled = asyncio.run(stats_latency(url, a.pollers, a.duration, a.traffic))
    models = asyncio.run(route_rate(url, "/v1/models", 20, a.duration))
    stats = asyncio.run(route_rate(url, "/stats", 20, a.duration))
    sse = asyncio.run(sse_fanout(url, a.subscribers, a.duration, a.traffic))
    split = asyncio.run(completion_overhead(url, app_name))
    rows = [
        ("completions, no reader", base),
        (f"completions + {a.pollers} pollers at 1/s", {
            **polled, "completions_ratio": polled["completions_per_s"] / base["completions_per_s"]}),
        ("20 clients: /stats vs /v1/models", {"stats_per_s": stats, "models_per_s": models,
                                              "ratio": stats / models}),
        (f"sse, {a.subscribers} subscribers", sse),
        ("1-token completion", {**split, "split_overhead_ms": split["http_p50_ms"] - split["engine_handle_p50_ms"]}),
    ]
    for name, row in rows:
        print(f"{name:36s} " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
