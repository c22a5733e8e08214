"""Autoscaling judged on a real trace: Mooncake's conversation trace, its arrivals re-timed so the load rises and
falls, replayed against simulated GPU replicas under each autoscaling policy and under a fixed fleet.

    python bench/autoscale_bench.py [--trace ../shared/traces/mooncake_conversation_trace.jsonl] [--scale 0.125]
                                    [--speedup 0.03] [--trough 1.5] [--peak 6] [--minutes 7]
                                    [--policies kv threshold serve fixed] [--r1 R --e2e S]
                                    [--serve-target X] [--out DIR]

First one replica is measured: its throughput at saturation (`r1`, requests a wall second, closed loop) and
its unloaded end-to-end time. The load then follows a trough of `--trough` x r1 requests a second, a ramp to a
peak of `--peak` x r1, the peak, a ramp down and a trough again (about 2 and 8 replicas' worth at 75%), over
`--minutes` of wall time: the trace's requests in their order (its conversations' turns keep their order), each
at the time the rate curve gives it. Each policy is a fresh app of `engine_replicas` 2 in 1..10 (`fixed`: 10, no
autoscaling), dp 1, the default cost profile (an H100 serving Llama-3.1-8B) with its KV cache and the trace's
lengths times `--scale`. The simulated GPUs run at `--speedup` of the profile's speed, so the fleet's control plane
fits on this machine: TTFTs are reported in the profile's seconds (wall x speedup), and the policies' TTFT target
is `--ttft` profile seconds; Serve's delays, a replica's start and the replica-seconds are wall time (a replica
starts fast here against the profile: seconds of wall, a fraction of a profile second). `serve` gets
`target_ongoing_requests` = r1 x the unloaded end-to-end time (a replica's requests in flight at full load, by
Little's law) x 0.75 (x `--serve-target`: a larger target runs fewer replicas). `--r1` and `--e2e` reuse
an earlier calibration.

Prints per policy: TTFT p50/p90 (profile s), the share of requests within the target, replica-seconds (and their
ratio to `fixed`), scale events, requests lost. Writes each run's JSON and an SVG of replicas, requests waiting
for their first token and TTFT over time to `--out`. No assertions on time.
"""

import argparse
import asyncio
import dataclasses
import json
import os
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from deployment import build_app  # noqa: E402
from deployment.clients.trace import TraceRequest, percentile, read_trace, replay, summary  # noqa: E402
from workers.cost_model import H100_LLAMA_8B  # noqa: E402
from workers.model_setting import simulated_config  # noqa: E402

PORT = 8393
APP = "scale"
TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
TOKEN_BYTES = simulated_config(H100_LLAMA_8B).kv_bytes_per_token(1, 4)  # fp32 K and V a token, as a rank sizes it
BLOCK = 16
MAX_REPLICAS = 10
COLORS = {"kv": "#1f77b4", "threshold": "#2ca02c", "serve": "#d62728", "fixed": "#7f7f7f"}


def app_settings(args: argparse.Namespace, extra: dict) -> dict:
    kv_tokens = int(H100_LLAMA_8B.kv_tokens * args.scale)
    return {"model": "simulated", "tp": "1", "dp": "1", "tokens_per_block": str(BLOCK),
            "max_seq_len": str(int(140_000 * args.scale) + 4096), "host_cache_bytes": "0",
            "kv_cache_bytes": str(kv_tokens * TOKEN_BYTES), "max_num_seqs": "256", "max_num_batched_tokens": "8192",
            "simulated_speedup_ratio": str(args.speedup), "num_cpus_per_rank": "0.01", "placement_timeout_s": "600",
            "fleet_routing": "kv", **extra}


def policies(args: argparse.Namespace, target_ongoing: float) -> dict[str, dict]:
    scaled = {"engine_replicas": "2", "engine_replicas_min": "1", "engine_replicas_max": str(MAX_REPLICAS),
              "autoscale_ttft_target_s": str(args.ttft / args.speedup),
              "autoscale_downscale_delay_s": str(args.downscale_delay)}
    return {"kv": {**scaled, "autoscaling_policy": "kv"},
            "threshold": {**scaled, "autoscaling_policy": "threshold"},
            "serve": {**scaled, "autoscaling_policy": "serve",
                      "autoscale_target_ongoing_requests": f"{target_ongoing:.2f}"},
            "fixed": {"engine_replicas": str(MAX_REPLICAS)}}


def shaped(requests: list[TraceRequest], phases: list[tuple[float, float, float]]) -> list[TraceRequest]:
    """The requests in order, the k-th at the time the rate curve has delivered k of them: `phases` are (wall
    seconds, rate at its start, rate at its end), linear in between."""
    out, t, k, due = [], 0.0, 0, 0.0
    step = 0.01
    for seconds, r0, r1 in phases:
        for i in range(int(seconds / step)):
            due += (r0 + (r1 - r0) * i * step / seconds) * step
            while due >= 1 and k < len(requests):
                out.append(dataclasses.replace(requests[k], at_s=t))
                k += 1
                due -= 1
            t += step
    return out


class ReplicaCounter(threading.Thread):
    """Samples the engine deployment's replicas (every state: a starting or stopping replica holds its GPUs)
    every second from Serve's status."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int, int]] = []  # (wall s, replicas, running)
        self.t0 = time.perf_counter()
        self.stop = threading.Event()

    def run(self) -> None:
        from ray import serve

        while not self.stop.wait(1.0):
            try:
                dep = serve.status().applications[APP].deployments["KVFleetEngine"]
            except Exception:
                continue
            states = dict(dep.replica_states)
            self.samples.append((time.perf_counter() - self.t0, sum(states.values()), states.get("RUNNING", 0)))


async def run_policy(name: str, settings: dict, requests: list[TraceRequest], args) -> dict:
    from ray import serve

    serve.run(build_app(settings), name=APP, route_prefix="/")
    counter = ReplicaCounter()
    counter.start()
    got = await replay(f"http://127.0.0.1:{PORT}", requests, speed=1.0, progress=not args.quiet, timeout_s=1800)
    counter.stop.set()
    counter.join()
    serve.delete(APP)
    samples = counter.samples
    replica_s = sum(n for _, n, _ in samples)  # one sample a second
    events = sum(1 for a, b in zip(samples, samples[1:], strict=False) if a[2] != b[2])
    ok = [r for r in got.results if not r.error]
    ttfts = [r.ttft_s * args.speedup for r in ok]
    s = summary(got)
    row = {"policy": name, "requests": len(got.results), "lost": s["failed"], "ttft_p50_s": percentile(ttfts, 0.5),
           "ttft_p90_s": percentile(ttfts, 0.9),
           "within": sum(t <= args.ttft for t in ttfts) / max(1, len(got.results)),
           "replica_s": replica_s, "events": events, "peak_replicas": max((n for _, n, _ in samples), default=0),
           "samples": samples, "results": [(r.at_s, r.ttft_s * args.speedup, bool(r.error)) for r in got.results]}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{name}.json").write_text(json.dumps({"settings": settings, **row}))
    return row


async def calibrate(args: argparse.Namespace, requests: list[TraceRequest]) -> tuple[float, float]:
    """One replica's requests a wall second at saturation, and a request's unloaded end-to-end wall time."""
    from ray import serve

    serve.run(build_app(app_settings(args, {"engine_replicas": "1", "engine_id": "scale-calibration"})), name=APP,
              route_prefix="/")
    url = f"http://127.0.0.1:{PORT}"
    alone = await replay(url, requests[:8], concurrency=1, progress=False)
    full = await replay(url, requests[8:8 + args.calibration], concurrency=64, progress=False)
    serve.delete(APP)
    return len(full.results) / full.seconds, summary(alone)["e2e_p50_s"]


def svg(rows: list[dict], path: Path, ttft_target: float) -> None:
    """Three panels over wall time, one line per policy: replicas, requests waiting for their first token, and
    TTFT (p90 of the requests sent in each 10 s)."""
    W, H, PAD = 900, 200, 40
    end = max(max(s[0] for s in r["samples"]) for r in rows if r["samples"])

    def panel(y0: int, title: str, series: dict[str, list[tuple[float, float]]], line: float | None = None) -> str:
        top = max([v for pts in series.values() for _, v in pts] + [line or 0, 1e-9])
        out = [f'<text x="{PAD}" y="{y0 + 14}" font-size="13">{title} (max {top:.3g})</text>',
               f'<rect x="{PAD}" y="{y0 + 20}" width="{W - 2 * PAD}" height="{H - 40}" fill="none" stroke="#ccc"/>']

        def xy(t: float, v: float) -> str:
            return f"{PAD + (W - 2 * PAD) * t / end:.1f},{y0 + H - 20 - (H - 40) * v / top:.1f}"
        for name, pts in series.items():
            if pts:
                out.append(f'<polyline fill="none" stroke="{COLORS[name]}" stroke-width="1.5" '
                           f'points="{" ".join(xy(t, v) for t, v in pts)}"/>')
        if line is not None:
            out.append(f'<polyline fill="none" stroke="#000" stroke-dasharray="4" '
                       f'points="{xy(0, line)} {xy(end, line)}"/>')
        return "\n".join(out)

    replicas = {r["policy"]: [(t, n) for t, n, _ in r["samples"]] for r in rows}
    waiting, ttft = {}, {}
    for r in rows:
        done = [(at, at + t / max(1e-9, r["speedup"])) for at, t, err in r["results"] if not err]
        waiting[r["policy"]] = [(float(t), sum(a <= t < b for a, b in done)) for t in range(0, int(end) + 1, 2)]
        buckets: dict[int, list[float]] = {}
        for at, t, err in r["results"]:
            if not err:
                buckets.setdefault(int(at // 10), []).append(t)
        ttft[r["policy"]] = [(10 * b + 5, percentile(v, 0.9)) for b, v in sorted(buckets.items())]
    legend = " ".join(f'<tspan fill="{COLORS[r["policy"]]}">{r["policy"]}</tspan>' for r in rows)
    body = [panel(0, "engine replicas", replicas), panel(H, "requests waiting for their first token", waiting),
            panel(2 * H, "TTFT p90, profile s (dashed: the target)", ttft, ttft_target),
            f'<text x="{PAD}" y="{3 * H + 16}" font-size="13">wall seconds 0..{end:.0f}; {legend}</text>']
    path.write_text(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{3 * H + 24}" '
                    f'font-family="sans-serif">\n' + "\n".join(body) + "\n</svg>\n")


async def main(args: argparse.Namespace) -> None:
    from ray import serve

    trace = read_trace(args.trace, None, args.scale)
    ray.init(address="local", num_cpus=256, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    r1, e2e = (args.r1, args.e2e) if args.r1 else await calibrate(args, trace)
    minute = args.minutes * 60 / 7  # the phases' unit: 1 trough, 1 ramp, 2 peak, 1 ramp, 2 trough
    phases = [(minute, args.trough * r1, args.trough * r1), (minute, args.trough * r1, args.peak * r1),
              (2 * minute, args.peak * r1, args.peak * r1), (minute, args.peak * r1, args.trough * r1),
              (2 * minute, args.trough * r1, args.trough * r1)]
    requests = shaped(trace[args.calibration + 8:], phases)
    target_ongoing = max(1.0, r1 * e2e * 0.75 * args.serve_target)
    print(f"one replica: {r1:.2f} requests a wall second at saturation, {e2e:.1f} s end to end alone; load "
          f"{args.trough * r1:.2f} -> {args.peak * r1:.2f} requests a second, {len(requests)} requests over "
          f"{args.minutes} min; serve's target_ongoing_requests {target_ongoing:.1f}", flush=True)
    rows = []
    for name, extra in policies(args, target_ongoing).items():
        if name in args.policies:
            # an engine id of its own per run: a fixed fleet's engines would take a previous autoscaled run's ids
            # while its registry still removes their aggregators (docs/architecture.md, "Autoscaling")
            settings = app_settings(args, {**extra, "engine_id": f"scale-{name}"})
            rows.append({**await run_policy(name, settings, requests, args), "speedup": args.speedup})
            r = rows[-1]
            print(f"{name}: {r['requests']} requests, lost {r['lost']}, TTFT p50 {r['ttft_p50_s']:.2f} p90 "
                  f"{r['ttft_p90_s']:.2f} s, within {r['within']:.1%}, {r['replica_s']} replica-s, "
                  f"{r['events']} scale events, peak {r['peak_replicas']}", flush=True)
    serve.shutdown()
    ray.shutdown()
    fixed = next((r["replica_s"] for r in rows if r["policy"] == "fixed"), None)
    print(f"\n{len(requests)} requests of {Path(args.trace).name} (lengths x {args.scale}), simulated H100s at "
          f"{args.speedup}x; TTFT in profile seconds, target {args.ttft} s; replica-seconds in wall seconds")
    print(f"{'policy':<11}{'lost':>5}{'TTFT p50':>9}{'p90':>7}{'<=target':>9}{'replica-s':>10}{'x fixed':>8}"
          f"{'events':>7}{'peak':>5}")
    for r in rows:
        ratio = f"{r['replica_s'] / fixed:.2f}" if fixed else "-"
        print(f"{r['policy']:<11}{r['lost']:>5}{r['ttft_p50_s']:>8.2f}s{r['ttft_p90_s']:>6.2f}s{r['within']:>9.1%}"
              f"{r['replica_s']:>10}{ratio:>8}{r['events']:>7}{r['peak_replicas']:>5}")
    if args.out and rows:
        svg(rows, Path(args.out) / "autoscale.svg", args.ttft)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--scale", type=float, default=0.125, help="every length (and the KV cache) times this")
    ap.add_argument("--speedup", type=float, default=0.03, help="the simulated GPUs' speed (of the profile's)")
    ap.add_argument("--trough", type=float, default=1.5, help="the trough's load, in one replica's throughputs")
    ap.add_argument("--peak", type=float, default=6.0, help="the peak's load, in one replica's throughputs")
    ap.add_argument("--minutes", type=float, default=7.0, help="wall minutes of load per policy")
    ap.add_argument("--ttft", type=float, default=2.0, help="the TTFT target, profile seconds")
    ap.add_argument("--downscale-delay", type=float, default=60.0, help="Serve's downscale_delay_s (wall)")
    ap.add_argument("--calibration", type=int, default=200, help="requests of the saturation run")
    ap.add_argument("--policies", nargs="*", default=["kv", "threshold", "serve", "fixed"])
    ap.add_argument("--r1", type=float, default=0.0, help="one replica's requests a wall second (skips calibrating)")
    ap.add_argument("--e2e", type=float, default=0.0, help="with --r1: a request's unloaded end-to-end wall time")
    ap.add_argument("--serve-target", type=float, default=1.0, help="`serve`'s target_ongoing_requests times this")
    ap.add_argument("--out", help="a directory for each run's JSON and the SVG plot")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    asyncio.run(main(ap.parse_args()))
