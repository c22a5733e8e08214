"""Step transports (issue 19): what stepping the ranks costs the engine, compiled graph vs actor calls.

    python -m bench.step_bench [--ranks 2 4 8] [--rounds 2] [--requests 0] [--device cpu|cuda] [--skip-e2e]

Control overhead: an engine of N dp groups x tp 1 (built-in random model, one short request per group, so a
tiny batch; `--requests 1`: one request in all, the other groups step with empty plans), each of its steps
timed around the transport, minus the slowest rank's own compute as the rank measured it
(`StepResult.step_s`); the median over the steps of a round, then the median over rounds.
Target: compiled graph <= 0.35x the actor calls at 8 ranks. End to end: output tokens/s of
bench/engine_bench.py's decode workload (16 concurrent requests x 48 tokens) at dp 2; target >= 1.0x.
For scale, each size also steps N echo actors (no model, no engine) through the same two transports: the
floor either could reach. Also the CPU the idle engine's ranks burn (a compiled graph's readers poll their
channels). Rounds alternate the transports' order to share the machine's noise. Prints the load average, no assertions.
"""

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import psutil  # noqa: E402
import ray  # noqa: E402

from bench.engine_bench import decode_tokens_per_s  # noqa: E402
from deployment.settings import Settings  # noqa: E402
from engine.core import Engine  # noqa: E402
from engine.transport import STEP_TRANSPORTS, make_transport  # noqa: E402
from workers.sampling_params import SamplingParams  # noqa: E402
from workers.step import StepPlan, StepResult  # noqa: E402


class TimedTransport:
    """Wraps the engine's transport: per step, wall time minus the slowest rank's own compute."""

    pipelined = False  # timed one step at a time: no step is sent before the last one's result (async scheduling)

    def __init__(self, inner) -> None:
        self.inner = inner
        self.overheads: list[float] = []

    def submit(self, plans):
        return asyncio.ensure_future(self.step(plans))

    async def step(self, plans):
        t0 = time.perf_counter()
        out = await self.inner.step(plans)
        wall = time.perf_counter() - t0
        compute = max((o.step_s for o in out if isinstance(o, StepResult)), default=0.0)
        self.overheads.append(wall - compute)
        return out

    def replace(self, workers) -> None:
        self.inner.replace(workers)

    async def close(self) -> None:
        await self.inner.close()


async def overhead_ms(eng: Engine, gen: int, requests: int = 0) -> float:
    """Median control overhead per step of one decode round: `requests` requests (0: one per dp group; the
    groups without one step with an empty plan)."""
    timed = eng.transport = TimedTransport(eng.transport)
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> None:
        async for _ in eng.generate(None, [1 + i, 2, 3, 4], params):
            pass

    await asyncio.gather(*[one(i) for i in range(requests or eng.config.dp)])
    eng.transport = timed.inner
    return statistics.median(timed.overheads) * 1000


def base_settings(device: str, dp: int, transport: str, tag: str) -> Settings:
    return Settings(model="random", dp=dp, tp=1, device=device, max_seq_len=1024,
                    kv_cache_bytes=8 << 20 if device == "cpu" else 0, host_cache_bytes=0,
                    num_cpus_per_rank=0.25, max_num_batched_tokens=512, engine_id=f"step-bench-{tag}-{transport}",
                    step_transport=transport)


async def idle_rank_cpu(eng: Engine, seconds: float = 2.0) -> float:
    """CPU % of one core that the engine's ranks burn together while the engine has nothing to do."""
    procs = [psutil.Process((await w.address.remote())["pid"]) for w in eng.workers]
    for p in procs:
        p.cpu_percent()
    await asyncio.sleep(seconds)
    return sum(p.cpu_percent() for p in procs)


async def with_engine(settings: Settings, rounds: int, fn, *args, idle: list | None = None) -> list[float]:
    eng = Engine(settings.engine_config())
    await eng.start()
    try:
        got = [await fn(eng, *args) for _ in range(rounds)]
        if idle is not None:
            idle.append(await idle_rank_cpu(eng))
        return got
    finally:
        await eng.shutdown()


class Echo:
    """A rank that does no work: what the transport alone costs, with the same code path."""

    def step(self, plan: StepPlan) -> int:
        return plan.iteration


async def floor_ms(kind: str, n: int, steps: int = 200) -> float:
    """Median wall time of one step of `n` echo actors through the real transport `kind`."""
    actors = [ray.remote(num_cpus=0.25)(Echo).remote() for _ in range(n)]
    transport = make_transport(kind, actors)
    times = []
    try:
        for i in range(steps):
            t0 = time.perf_counter()
            await transport.step([StepPlan(i)] * n)
            times.append(time.perf_counter() - t0)
    finally:
        await transport.close()
        for a in actors:
            ray.kill(a)
    return statistics.median(times[steps // 10:]) * 1000  # the first steps compile and warm up


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--rounds", type=int, default=2, help="engine starts per transport and size")
    ap.add_argument("--steps", type=int, default=3, help="decode rounds per engine start")
    ap.add_argument("--gen", type=int, default=48)
    ap.add_argument("--requests", type=int, default=0, help="requests per overhead round (0: one per dp group)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()
    print(f"step transports on {args.device}, {os.cpu_count()} cores, {load()}")
    load_desc = f"{args.requests} request(s) in all" if args.requests else "one request per dp group"
    print(f"control overhead per step (ms; median of steps, median of {args.rounds}x{args.steps} rounds; "
          f"{load_desc}):")
    for n in args.ranks:
        got: dict[str, list[float]] = {t: [] for t in STEP_TRANSPORTS}
        idle: dict[str, list[float]] = {t: [] for t in STEP_TRANSPORTS}
        for r in range(args.rounds):
            for t in STEP_TRANSPORTS if r % 2 == 0 else STEP_TRANSPORTS[::-1]:
                got[t] += await with_engine(base_settings(args.device, n, t, f"o{n}-{r}"), args.steps,
                                            overhead_ms, args.gen, args.requests, idle=idle[t])
        cg, ac = (statistics.median(got[t]) for t in STEP_TRANSPORTS)
        icg, iac = (statistics.median(idle[t]) for t in STEP_TRANSPORTS)
        print(f"  {n} ranks: compiled_graph {cg:6.2f}  actor_calls {ac:6.2f}  ratio {cg / ac:.2f} "
              f"(target at 8 ranks <= 0.35); idle ranks burn {icg:.0f}% vs {iac:.0f}% of a core   [{load()}]")
        fcg, fac = [await floor_ms(t, n) for t in STEP_TRANSPORTS]
        print(f"     the transport alone, {n} echo actors: compiled_graph {fcg:6.2f}  actor_calls {fac:6.2f}  "
              f"ratio {fcg / fac:.2f}   [{load()}]")
    if args.skip_e2e:
        return
    tps: dict[str, list[float]] = {t: [] for t in STEP_TRANSPORTS}
    for r in range(args.rounds):
        for t in STEP_TRANSPORTS if r % 2 == 0 else STEP_TRANSPORTS[::-1]:
            tps[t] += await with_engine(base_settings(args.device, 2, t, f"e{r}"), args.steps,
                                        decode_tokens_per_s, 16, 48)
    cg, ac = (statistics.median(tps[t]) for t in STEP_TRANSPORTS)
    print("end to end, dp 2 (16 concurrent x 48 tokens), output tok/s per round:")
    for t in STEP_TRANSPORTS:
        print(f"  {t:15s} " + ", ".join(f"{x:.0f}" for x in tps[t]))
    print(f"  median: compiled_graph {cg:.0f}  actor_calls {ac:.0f}  ratio {cg / ac:.2f} (target >= 1.0)  "
          f"[{load()}]")


if __name__ == "__main__":
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    asyncio.run(main())
