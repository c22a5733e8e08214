"""A dead rank, over in-process ranks (no Ray): its group's requests finish elsewhere with the very tokens of a
run without the fault, the group is restarted and serves again, or stays down after failing too often; a
request nobody can take gets its 503 at its deadline; a full waiting queue refuses with 429."""

import asyncio
import dataclasses
import types

import pytest
import ray

from engine.errors import EngineError, Overloaded
from tests.support.engine_harness import generate, make_engine, until
from workers.sampling_params import SamplingParams

PROMPTS = [list(range(1, 20)) + [i] for i in range(4)]


def run(coro):
    return asyncio.run(coro)


def dies_after(steps: int, eng=None, dp: int = 1, seen: list | None = None):
    """A rank fault: the rank's step raises ActorDiedError from its (steps+1)-th call on. With `seen`, records
    how many tokens each of the group's running requests had when it died."""
    calls = [0]

    def fail(plan):
        calls[0] += 1
        if calls[0] > steps:
            if seen is not None and not seen:
                seen.append([len(r.generated) for r in eng._groups[dp].running])
            raise ray.exceptions.ActorDiedError()

    return fail


def always_dead(plan):
    raise ray.exceptions.ActorDiedError()


async def reference(params: dict) -> list[list[int]]:
    eng = await make_engine(dp=2)
    return [await generate(eng, p, **params) for p in PROMPTS]


@pytest.mark.parametrize("params", [
    dict(max_tokens=12, temperature=0.0, ignore_eos=True),
    dict(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_dead_ranks_requests_finish_elsewhere_with_the_tokens_of_a_run_without_fault(params):
    async def main():
        expected = await reference(params)
        eng = await make_engine(dp=2)
        seen: list = []
        eng.workers[1].fail = dies_after(4, eng, 1, seen)
        got = await asyncio.gather(*[generate(eng, p, **params) for p in PROMPTS])
        assert seen and any(n > 0 for n in seen[0]), "the group died before generating anything"
        assert got == expected  # streamed token by token: no gap, no repeat
        await until(lambda: eng._groups[1].down is None, "the group's return")
        assert eng._groups[1].restarts == 1 and len(eng.launches) == 1
        health = await eng.health()
        assert health.down_groups == {} and health.groups["1"].restarts == 1
        again = await asyncio.gather(*[generate(eng, p, **params) for p in PROMPTS])
        assert again == expected
        assert eng.rank_workers[1].kv.get_kv_cache_stats().alloc_total_blocks > 0  # the new rank serves

    run(main())


def test_a_group_that_keeps_dying_stays_down_and_the_others_serve():
    async def main():
        eng = await make_engine(dp=2, max_group_restarts=2)
        eng.workers[1].fail = always_dead

        def dead_on_arrival(dp, local):
            for r in local:
                r.fail = always_dead

        eng.on_launch = dead_on_arrival
        params = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
        got = await asyncio.gather(*[generate(eng, p, **params) for p in PROMPTS])
        assert all(len(t) == 6 for t in got)
        await until(lambda: eng._groups[1].stays_down, "the group staying down")
        assert len(eng.launches) == 2 and eng._groups[1].failures == 3  # a death, then two failed restarts
        health = await eng.health()
        assert health.ok and list(health.down_groups) == ["1"]
        assert "stays down after 3 failures" in health.down_groups["1"]
        assert health.groups["1"].stays_down and not health.groups["1"].restarting
        assert len(await generate(eng, PROMPTS[0], **params)) == 6  # group 0 serves on
        eng.workers[0].fail = always_dead
        with pytest.raises(EngineError):
            await generate(eng, PROMPTS[0], **params)
        await until(lambda: eng.error is not None, "the engine's error")
        with pytest.raises(EngineError, match="every dp group is down"):
            await eng.health()
        with pytest.raises(EngineError, match="every dp group is down"):
            await generate(eng, PROMPTS[0], **params)

    run(main())


def test_with_no_group_up_a_request_waits_for_the_restart_and_completes():
    async def main():
        params = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
        expected = (await reference(params))[:2]
        eng = await make_engine(dp=1)
        gate = asyncio.Event()
        launch = eng._launch

        async def slow_launch(dp):
            await gate.wait()
            return await launch(dp)

        eng._launch = slow_launch
        eng.workers[0].fail = dies_after(3)
        pending = [asyncio.ensure_future(generate(eng, p, **params)) for p in PROMPTS[:2]]
        await until(lambda: eng._groups[0].down is not None, "the fault")
        assert len(eng._orphans) == 2
        with pytest.raises(EngineError, match="no dp group is up"):
            await eng.health()
        late = asyncio.ensure_future(generate(eng, PROMPTS[2], **params))  # arrives during the outage
        await until(lambda: len(eng._orphans) == 3, "the late request waiting")
        gate.set()
        assert await asyncio.gather(*pending) == expected
        assert len(await late) == 10
        assert (await eng.health()).groups["0"].restarts == 1

    run(main())


def test_a_request_no_group_takes_in_time_gets_a_retryable_engine_error():
    async def main():
        eng = await make_engine(dp=1, placement_timeout_s=0.05)
        never = asyncio.Event()

        async def stuck_launch(dp):
            await never.wait()

        eng._launch = stuck_launch
        eng.workers[0].fail = always_dead
        with pytest.raises(EngineError, match="placement_timeout_s") as info:
            await generate(eng, PROMPTS[0], max_tokens=4, temperature=0.0)
        assert info.value.retry_after_s >= 1
        assert not eng._requests and not len(eng._orphans)

    run(main())


def test_a_full_waiting_queue_refuses_new_requests_and_serves_the_admitted():
    async def main():
        eng = await make_engine(dp=1, max_waiting_requests=2)
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        admitted = [eng.submit(None, p, params) for p in PROMPTS[:2]]  # nothing stepped yet: both wait
        with pytest.raises(Overloaded, match="max_waiting_requests"):
            eng.submit(None, PROMPTS[2], params)
        for req in admitted:
            assert len([ev async for ev in eng.stream(req)]) == 3
        assert len(await generate(eng, PROMPTS[2], max_tokens=3, temperature=0.0)) == 3  # room again

    run(main())


def test_a_shutdown_during_a_restart_removes_what_the_restart_launched():
    async def main():
        eng = await make_engine(dp=2)
        stopped: list = []
        eng._stop = lambda workers, pgs: stopped.extend(workers)
        never = asyncio.Event()

        async def stuck_prepare(launched):
            await never.wait()

        eng._prepare = stuck_prepare
        eng.workers[1].fail = always_dead
        got = await asyncio.gather(*[generate(eng, p, max_tokens=4, temperature=0.0) for p in PROMPTS])
        assert all(len(t) == 4 for t in got)
        await until(lambda: len(eng.launches) == 1, "the restart's launch")
        await eng.shutdown()
        assert all(any(w is s for s in stopped) for w in eng.launches[0][1])  # the new ranks went too
        assert not eng._restarting

    run(main())


def test_leftovers_are_an_engines_own_ranks_and_groups_not_those_of_an_id_it_prefixes():
    from engine.ranks import left_by, pg_name, rank_name

    assert left_by("engine-0", rank_name("engine-0", 3, "ab12cd34"))
    assert left_by("engine-0", pg_name("engine-0", 1))
    assert not left_by("engine", rank_name("engine-0", 3, "ab12cd34"))  # was killed: a prefix match
    assert not left_by("engine", pg_name("engine-dp0", 0))
    assert not left_by("engine-0", rank_name("engine", 0, "ab12cd34"))
    assert not left_by("engine-0", "kvfleet-rank-engine-0-3")  # not a name the engine gives


def test_requests_of_the_last_group_to_stay_down_get_one_error_each():
    async def main():
        eng = await make_engine(dp=1, max_group_restarts=0)
        eng.workers[0].fail = dies_after(2)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        reqs = [eng.submit(None, p, params) for p in PROMPTS[:2]]
        for req in reqs:
            with pytest.raises(EngineError, match="every dp group is down"):
                async for _ in eng.stream(req):
                    pass
            assert req.queue.empty()  # one error, not one from the failure and another from the re-queue
        assert not eng._requests and not eng._orphans.reqs and not eng._groups[0].waiting

    run(main())


def test_a_request_a_smaller_restarted_cache_can_never_hold_fails_instead_of_waiting_forever():
    """On CUDA a restarted group's cache is sized from the memory free then: it may hold less than before."""
    async def main():
        from engine import ranks
        from engine.errors import RequestError
        from tests.support import engine_harness as h

        eng = await make_engine(dp=1)
        before = eng.max_model_len
        small = dataclasses.replace(eng.config, cache=dataclasses.replace(eng.config.cache, kv_cache_bytes=96 << 10))

        async def launch(dp):
            w = h.make_rank(small, dp)
            eng.rank_workers[dp] = w
            return ranks.Launched(None, [h.LocalRank(w)], [h.setup_info(w)])

        eng._launch = launch
        eng.workers[0].fail = dies_after(0)
        with pytest.raises(RequestError, match="needs 127 tokens .* hold at most 32") as exc:
            await asyncio.wait_for(generate(eng, list(range(1, 120)), max_tokens=8, ignore_eos=True), 30)
        assert exc.value.code == "context_length_exceeded"
        assert eng.max_model_len == 32 < before  # what /v1/models and the ingress's checks advertise
        with pytest.raises(RequestError, match="maximum context length is 32"):
            await generate(eng, list(range(1, 40)), max_tokens=8)
        assert len(await generate(eng, [1, 2, 3], max_tokens=8, ignore_eos=True)) == 8  # what fits is served

    run(main())


def test_a_request_moved_off_a_dead_group_is_counted_once_in_routing():
    async def main():
        eng = await make_engine(dp=2, routing="kv")
        its = []
        eng.stats = types.SimpleNamespace(put=its.append, register=_noop, drained=_noop, close=_noop)
        eng.workers[1].fail = dies_after(4)
        got = await asyncio.gather(*[generate(eng, p, max_tokens=12, temperature=0.0, ignore_eos=True)
                                     for p in PROMPTS])
        assert all(len(t) == 12 for t in got)
        await until(lambda: eng._groups[1].down is None, "the restart")
        routed = [it.routing for it in its]
        assert sum(r["requests"] for r in routed) == len(PROMPTS)
        assert sum(sum(r["perGroupRequests"]) for r in routed) == len(PROMPTS)

    run(main())


async def _noop(*args):
    return None


def test_a_rank_adopted_by_a_new_engine_keeps_its_cache_and_counts_from_its_adoption():
    """The engine's replica died with a request running on the rank, and steps whose statistics never reached
    the aggregator: the new engine's `adopt` closes what the dead one left, keeps the cached blocks (the next
    request reuses them), and starts a new incarnation whose cumulative counters begin at the adoption (the
    records still sum to the cumulative). A rank set up for other settings is not taken."""
    from dataclasses import fields

    from aggregator.delta import SchedulerStats
    from workers.step import NewRequest, StepPlan, Work

    async def main():
        eng = await make_engine()
        prompt = list(range(1, 60))
        await generate(eng, prompt, max_tokens=4, temperature=0.0)
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = eng.generate(None, list(range(100, 140)), params)
        await anext(stream)  # running on the rank when its engine "dies": the loop stops, nothing closes it
        eng._loop_task.cancel()
        w = eng.rank_workers[0]
        assert w.reqs
        assert w.adopt(dataclasses.replace(w.spec, seed=w.spec.seed + 1)) is None and w.reqs  # untouched
        old = w.incarnation
        info = w.adopt(w.spec)
        assert info["incarnation"] == info["layout"].incarnation == w.incarnation != old and not w.reqs
        at = w.kv.get_kv_cache_stats()
        new = NewRequest("after", prompt, SamplingParams(max_tokens=1, temperature=0.0), None)
        res = w.step(StepPlan(eng.iteration + 1, [new], [Work("after", len(prompt))], record=True))
        n = len(fields(SchedulerStats))
        kv = res.delta.row[-n - 8:-n].tolist()  # KvCacheStats: 4 gauges, then alloc total/new, reused, missed
        now = w.kv.get_kv_cache_stats()
        assert kv[4:] == [now.alloc_total_blocks - at.alloc_total_blocks, now.alloc_new_blocks - at.alloc_new_blocks,
                          now.reused_blocks - at.reused_blocks, now.missed_blocks - at.missed_blocks]
        assert kv[6] > 0 and res.delta.incarnation == w.incarnation  # the prompt's blocks were still cached
        await stream.aclose()

    run(main())
