"""Replaying a request trace in Mooncake's format against a running app, and what each request saw.

A trace line is `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`, one id
per 512-token block of the prompt: two requests share a prefix exactly as far as their ids agree. A request's
prompt is made of its ids' blocks, the same id always the same text (printable bytes drawn from the id: one
token each for the byte tokenizer of `random` and `simulated`), a final partial block for the rest of its
length. `scale` shrinks every length (the block, the prompt, the output) by one factor, so a trace written for
a GPU fits a small model or this machine: at 1/8, a 512-token block is 64 tokens.

Requests go in trace order, streamed, either at the trace's times divided by `speed` (open loop: arrivals do
not wait for the server) or `concurrency` at a time (closed loop). Each result has its time to first token,
mean inter-token latency, end-to-end latency and the usage the server reported.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import httpx
from tqdm import tqdm

MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's traces


@dataclass(frozen=True)
class TraceRequest:
    at_s: float  # arrival, seconds from the trace's first request
    prompt: str
    max_tokens: int
    hash_ids: tuple[int, ...]


@dataclass
class Result:
    at_s: float  # when it was sent, seconds from the replay's start
    ttft_s: float = 0.0
    itl_s: float = 0.0  # mean time between tokens after the first
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


@dataclass
class Replay:
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0


@lru_cache(maxsize=65_536)
def block_text(hash_id: int, tokens: int) -> str:
    """The text of one trace block: `tokens` printable bytes drawn from its id (a space every 8th)."""
    rng = random.Random(hash_id)
    return "".join(" " if i % 8 == 7 else chr(rng.randrange(33, 127)) for i in range(tokens))


def scaled_length(length: int, ids: int, block: int, scale: float) -> int:
    """A prompt's length times `scale`, kept within its ids' blocks (the last one partial, never empty), as AIPerf
    checks a trace line: rounding must not drop or add a block."""
    tokens = max(1, round(length * scale))
    return min(max(tokens, (ids - 1) * block + 1), ids * block) if ids else tokens


def read_trace(path: str | Path, limit: int | None = None, scale: float = 1.0) -> list[TraceRequest]:
    """The first `limit` requests of a Mooncake-format trace, their lengths times `scale`."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    block = max(1, round(MOONCAKE_BLOCK * scale))
    out: list[TraceRequest] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ids, length = d["hash_ids"], int(d["input_length"])
                at, output = float(d["timestamp"]) / 1000, int(d["output_length"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({exc})") from None
            tokens = scaled_length(length, len(ids), block, scale)
            parts = [block_text(h, block) for h in ids]
            prompt = "".join(parts)[:tokens]
            out.append(TraceRequest(at, prompt, max(1, round(output * scale)), tuple(ids)))
    if out:
        first = out[0].at_s
        out = [TraceRequest(r.at_s - first, r.prompt, r.max_tokens, r.hash_ids) for r in out]
    return out


async def timed_completion(http: httpx.AsyncClient, req: TraceRequest, model: str | None = None,
                           t0: float = 0.0) -> Result:
    """One streamed completion of `req` and what it saw (sent at `at_s` from `t0`); an error is in the result."""
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    sent = time.perf_counter()
    res = Result(at_s=sent - t0)
    first = last = None
    chunks = 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"{r.status_code} {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if first is None:
        res.error = "no token streamed"
        return res
    res.ttft_s, res.e2e_s = first - sent, last - sent
    if res.output_tokens > 1:
        res.itl_s = (last - first) / (res.output_tokens - 1)
    return res


async def replay(url: str, requests: list[TraceRequest], *, speed: float | None = 1.0, concurrency: int | None = None,
                 model: str | None = None, progress: bool = True, timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> Replay:
    """Send `requests` at the trace's times / `speed`, or `concurrency` at a time when given (`transport`:
    tests)."""
    if concurrency is None and (speed is None or speed <= 0):
        raise ValueError("give a speed > 0 (open loop) or a concurrency (closed loop)")
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    out = Replay(results=[Result(0.0)] * len(requests))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits, transport=transport) as http:
        t0 = time.perf_counter()

        async def run(i: int, req: TraceRequest) -> None:
            out.results[i] = await timed_completion(http, req, model, t0)
            bar.update(1)

        if concurrency:
            sem = asyncio.Semaphore(concurrency)

            async def limited(i: int, req: TraceRequest) -> None:
                async with sem:
                    await run(i, req)

            await asyncio.gather(*(limited(i, r) for i, r in enumerate(requests)))
        else:
            tasks = []
            for i, req in enumerate(requests):
                delay = t0 + req.at_s / speed - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # the trace's arrival time
                tasks.append(asyncio.create_task(run(i, req)))
            await asyncio.gather(*tasks)
        out.seconds = time.perf_counter() - t0
    bar.close()
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s)) - 1))]


def summary(replay: Replay) -> dict:
    """Latency percentiles (p50, p90, p99), throughput and failures of a replay."""
    ok = [r for r in replay.results if not r.error]
    out = {"requests": len(replay.results), "failed": len(replay.results) - len(ok), "seconds": replay.seconds,
           "output_tokens": sum(r.output_tokens for r in ok),
           "output_tok_s": sum(r.output_tokens for r in ok) / replay.seconds if replay.seconds else 0.0}
    for name in ("ttft_s", "itl_s", "e2e_s"):
        values = [getattr(r, name) for r in ok if name != "itl_s" or r.output_tokens > 1]
        for q in (0.5, 0.9, 0.99):
            out[f"{name[:-2]}_p{round(q * 100)}_s"] = percentile(values, q)
    return out


def write_results(path: str | Path, meta: dict, replay: Replay) -> None:
    """The run's settings, summary and every request's result as JSON, and a plot of it over time next to it
    (`.html`, plotly: TTFT, inter-token latency and requests in flight)."""
    path = Path(path)
    path.write_text(json.dumps({**meta, "summary": summary(replay),
                                "results": [asdict(r) for r in replay.results]}, indent=1))
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ok = [r for r in replay.results if not r.error]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=("latency (s)", "requests in flight"))
    fig.add_trace(go.Scatter(x=[r.at_s for r in ok], y=[r.ttft_s for r in ok], mode="markers", name="TTFT"), 1, 1)
    fig.add_trace(go.Scatter(x=[r.at_s for r in ok], y=[r.itl_s for r in ok], mode="markers", name="ITL"), 1, 1)
    edges = sorted([(r.at_s, 1) for r in ok] + [(r.at_s + r.e2e_s, -1) for r in ok])
    xs, ys, n = [], [], 0
    for t, d in edges:
        n += d
        xs.append(t)
        ys.append(n)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line_shape="hv", name="in flight"), 2, 1)
    fig.update_layout(title=meta.get("title", "trace replay"), xaxis2_title="seconds since the replay's start")
    fig.write_html(path.with_suffix(".html"), include_plotlyjs=True)
