"""HTTP statistics benchmark: /stats latency under 50 concurrent pollers, SSE fan-out to 100 subscribers.

Each is measured against a baseline of one client, while background completions keep records flowing.

    python bench/http_bench.py                       # starts a local app (CPU settings) and benchmarks it
    python bench/http_bench.py --url http://127.0.0.1:8000 --duration 10

Pollers ask `/stats?since=<last iter they saw>` like a dashboard does; subscribers follow /stats/stream.
Lag = time a subscriber parsed a record - the record's `timestamp` (emission time; same machine clock).
"""

import argparse
import asyncio
import json
import statistics
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


async def _poller(http: httpx.AsyncClient, stop: asyncio.Event, lat: list[float]) -> None:
    since = -1
    while not stop.is_set():
        t0 = time.perf_counter()
        r = await http.get("/stats", params={"since": since, "limit": 100})
        lat.append(time.perf_counter() - t0)
        records = r.json()
        if records:
            since = records[-1]["iter"]


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


async def stats_latency(url: str, pollers: int, duration: float, traffic: int) -> dict:
    async def body(http, stop):
        lat: list[float] = []
        tasks = [asyncio.create_task(_poller(http, stop, lat)) for _ in range(pollers)]

        async def result(elapsed):
            await asyncio.gather(*tasks)
            return {"pollers": pollers, "requests": len(lat), "req_per_s": len(lat) / elapsed,
                    "p50_ms": 1e3 * _pct(lat, 0.50), "p99_ms": 1e3 * _pct(lat, 0.99),
                    "mean_ms": 1e3 * statistics.fmean(lat) if lat else float("nan")}
        return result

    return await _phase(url, duration, traffic, body)


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
            return {"subscribers": subscribers, "records_delivered": delivered,
                    "records_per_s": delivered / elapsed, "records_per_s_per_sub": delivered / elapsed / subscribers,
                    "out_of_order": gaps, "lag_p50_ms": 1e3 * _pct(lags, 0.5), "lag_p99_ms": 1e3 * _pct(lags, 0.99)}
        return result

    return await _phase(url, duration, traffic, body)


def _start_local_app() -> str:
    import ray
    from ray import serve

    from deployment import build_app

    sys.path.insert(0, "tests")
    from e2e_fixtures import E2E_SETTINGS, free_port, wait_healthy

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
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
    rows = [
        ("stats latency, 1 poller", asyncio.run(stats_latency(url, 1, a.duration, a.traffic))),
        (f"stats latency, {a.pollers} pollers", asyncio.run(stats_latency(url, a.pollers, a.duration, a.traffic))),
        ("sse fan-out, 1 subscriber", asyncio.run(sse_fanout(url, 1, a.duration, a.traffic))),
        (f"sse fan-out, {a.subscribers} subscribers",
         asyncio.run(sse_fanout(url, a.subscribers, a.duration, a.traffic))),
    ]
    for name, row in rows:
        print(f"{name:32s} " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
