"""Both step transports against real rank actors: equal results, a rank dying inside an execution, replace()
and close(). One set of dp=2 x tp=1 CPU ranks (no block reuse, so a closed request leaves the cache as it
found it and the same plans give the same results again)."""

import asyncio
import threading

import pytest
import ray

from deployment.settings import Settings
from engine import ranks
from engine.transport import CompiledGraph, make_transport
from workers.sampling_params import SamplingParams
from workers.step import NewRequest, StepPlan, StepResult, Work

SETTINGS = dict(engine_id="transport-test", dp=2, tp=1, device="cpu", max_seq_len=128, kv_cache_bytes=256 << 10,
                host_cache_bytes=0, enable_block_reuse=False, model="random", num_cpus_per_rank=0.5)
KINDS = ("compiled_graph", "actor_calls")
GUARD_S = 120  # a hang fails the test instead of stalling the suite; not a speed assertion


async def start_ranks(s: Settings, dp: int) -> tuple:
    pg, workers = await ranks.start_group(s.engine_config(), dp, "cpu", "float32")
    await ranks.setup_group(workers)
    return pg, workers


async def start_all(s: Settings) -> tuple[list, list]:
    started = await asyncio.wait_for(asyncio.gather(*[start_ranks(s, dp) for dp in range(s.dp)]), GUARD_S)
    return [pg for pg, _ in started], [w for _, ws in started for w in ws]


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    s = Settings(**SETTINGS)
    pgs, workers = asyncio.run(start_all(s))
    yield s, workers, pgs
    ranks.stop(workers, pgs)


def _prompt(rank: int) -> list[int]:
    return [5 + rank, 17, 29, 3, 41, 8, 13, 21, 34, 55]


def _new(rank: int, rid: str) -> StepPlan:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return StepPlan(0, [NewRequest(rid, _prompt(rank), params)], [Work(rid, len(_prompt(rank)))])


async def _generate(transport, n: int, tag: str) -> list[list]:
    """Prefill then decode one request per rank through `transport`, then close them: each step's results."""
    ids = [f"{tag}-{r}" for r in range(n)]
    steps = [await transport.step([_new(r, ids[r]) for r in range(n)])]
    for it in range(1, 4):
        prev = steps[-1]
        steps.append(await transport.step([StepPlan(it, work=[Work(ids[r], 1, prev[r].ran[ids[r]][1])])
                                          for r in range(n)]))
    await transport.step([StepPlan(4, close=[ids[r]], record=False) for r in range(n)])
    return steps


def _same(res: StepResult) -> tuple:
    """What must match between transports (not the timings)."""
    return (res.iteration, sorted((k.split("-")[-1], v) for k, v in res.ran.items()), res.deferred,
            res.recomputed, res.suspended, sorted(res.reused.values()), res.failed, res.delta is not None)


def test_both_transports_give_the_same_results(cluster):
    _, workers, _ = cluster

    async def run(kind):
        transport = make_transport(kind, workers)
        try:
            return await asyncio.wait_for(_generate(transport, len(workers), kind), GUARD_S)
        finally:
            await transport.close()

    got = {kind: asyncio.run(run(kind)) for kind in KINDS}
    for a, b in zip(*got.values(), strict=True):
        assert all(isinstance(x, StepResult) for x in a + b)
        assert [_same(x) for x in a] == [_same(x) for x in b]
    assert all(len(step[0].ran) == 1 for step in got["compiled_graph"])


def test_a_rank_with_no_plan_is_not_stepped(cluster):
    _, workers, _ = cluster

    async def run():
        transport = make_transport("compiled_graph", workers)
        try:
            out = await asyncio.wait_for(transport.step([_new(0, "only-0"), None]), GUARD_S)
            await transport.step([StepPlan(1, close=["only-0"], record=False), None])
            return out
        finally:
            await transport.close()

    out = asyncio.run(run())
    assert isinstance(out[0], StepResult) and "only-0" in out[0].ran and out[1] is None
    snaps = ray.get([w.kv_snapshot.remote() for w in workers])
    assert [s["requests"] for s in snaps] == [0, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_rank_killed_inside_an_execution_is_an_error_of_its_own(ray_cluster, kind):
    s = Settings(**{**SETTINGS, "engine_id": f"transport-kill-{kind}"})

    def plant(worker):
        """On the rank: its next forward kills its process, so it dies inside the step, mid-execution.
        (Nested so that it pickles by value: the rank cannot import a test module.)"""
        import os

        def explode(*args, **kwargs):
            os._exit(1)

        worker.model = explode

    async def run():
        pgs, workers = await start_all(s)
        transport = make_transport(kind, workers)
        try:
            await transport.step([_new(r, f"warm-{r}") for r in range(2)])
            await workers[1].__ray_call__.remote(plant)
            out = await asyncio.wait_for(transport.step([_new(r, f"boom-{r}") for r in range(2)]), GUARD_S)
            # the live rank steps on; the dead one is an error again, with no new graph needed by the caller
            after = await asyncio.wait_for(transport.step([StepPlan(2, close=["boom-0"]), None]), GUARD_S)
            # its group restarted: new actors, replace(), and the graph compiled over them steps them both
            ranks.stop([workers[1]], [pgs[1]])
            pg2, fresh = await start_ranks(s, 1)
            pgs.append(pg2)
            transport.replace([workers[0], fresh[0]])
            again = await asyncio.wait_for(transport.step([_new(r, f"again-{r}") for r in range(2)]), GUARD_S)
            return out, after, again
        finally:
            await transport.close()
            ranks.stop(workers + locals().get("fresh", []), pgs)

    out, after, again = asyncio.run(run())
    assert isinstance(out[1], ray.exceptions.RayActorError), out[1]
    assert isinstance(out[0], StepResult) and "boom-0" in out[0].ran, "the live rank's result is kept"
    assert isinstance(after[0], StepResult) and after[1] is None
    assert all(isinstance(r, StepResult) and f"again-{i}" in r.ran for i, r in enumerate(again))


def _graph_threads() -> list[str]:
    """The compiled graph's threads in this process (its channel threads, Ray's graph monitor; not tqdm's)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("channel.")
            or (type(t).__module__.startswith("ray.") and "Monitor" in type(t).__name__)]


def test_close_leaves_no_graph_running(cluster):
    _, workers, _ = cluster

    async def run():
        transport = make_transport("compiled_graph", workers)
        assert isinstance(transport, CompiledGraph)
        await transport.step([StepPlan(0, record=False)] * len(workers))
        graph = transport.graph
        loops = list(graph.worker_task_refs.values())
        await transport.close()
        return graph, loops

    graph, loops = asyncio.run(run())
    assert graph.is_teardown
    done, pending = ray.wait(loops, num_returns=len(loops), timeout=GUARD_S)
    assert not pending, "every rank's graph loop has exited"
    pause = threading.Event()
    for _ in range(GUARD_S * 10):  # the threads end on their own once their channels are closed
        if not _graph_threads():
            break
        pause.wait(0.1)
    assert not _graph_threads(), _graph_threads()
    # the ranks take ordinary calls again, and a new graph compiles over them
    assert ray.get([w.kv_snapshot.remote() for w in workers])


def test_replace_while_an_execution_runs_lets_it_finish(ray_cluster, caplog):
    class SlowRank:  # defined here, so Ray ships it by value (workers cannot import a test module)
        """A rank whose step takes a while, so that an execution is in flight when replace() is called."""

        def step(self, plan: StepPlan) -> int:
            import time

            time.sleep(0.5)
            return plan.iteration

    slow = [ray.remote(num_cpus=0)(SlowRank).remote() for _ in range(2)]

    async def main():
        transport = CompiledGraph(slow)
        assert await transport.step([StepPlan(0)] * 2) == [0, 0]  # compiled
        running = asyncio.ensure_future(transport.step([StepPlan(1)] * 2))
        await asyncio.sleep(0.2)  # the execution has reached the ranks
        transport.replace([slow[0], None])  # a group went down (or came back) meanwhile
        assert await asyncio.wait_for(running, GUARD_S) == [1, 1]  # finished on the graph it started on
        out = await asyncio.wait_for(transport.step([StepPlan(2), None]), GUARD_S)  # then one over slow[0]
        assert out[0] == 2 and out[1] is None
        await transport.close()

    with caplog.at_level("WARNING", logger="kvfleet.engine"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "failed" in r.getMessage()], "the execution was torn down"
    for a in slow:
        ray.kill(a)
