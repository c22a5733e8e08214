"""Async scheduling over in-process ranks (no Ray): a step sent before the last one's result came back gives the
tokens and the statistics of steps sent in turn, never steps a request past its end, and a failure or an abort in
the middle of it loses nothing."""

import asyncio
import dataclasses
import types

import numpy as np
import pytest
import ray

from engine.errors import RequestFailed
from tests.support.engine_harness import generate, make_engine, settled
from workers.sampling_params import SamplingParams
from workers.step import LAST_SAMPLED, NewRequest, StepPlan, Work

PROMPTS = [list(range(1, 20)) + [i] for i in range(4)]


def run(coro):
    return asyncio.run(coro)


def record_steps(eng) -> list:
    """Every (plan, result) each rank steps, in the order the ranks ran them."""
    steps = []
    for rank in eng.workers:
        real = rank.step.remote

        async def step(plan, real=real):
            res = await real(plan)
            steps.append((plan, res))
            return res

        rank.step = types.SimpleNamespace(remote=step)
    return steps


async def released(eng) -> None:
    """Until the engine settles; then its rank holds no request and no block."""
    await settled(eng)
    assert eng.rank_workers[0].kv.get_kv_cache_stats().used_num_blocks == 0 and not eng.rank_workers[0].reqs


def sent_ahead(steps) -> int:
    return sum(1 for plan, _ in steps if any(w.new_token_id == LAST_SAMPLED for w in plan.work))


async def serve(async_scheduling: bool, params: list[dict]):
    eng = await make_engine(async_scheduling=async_scheduling)
    steps = record_steps(eng)

    async def one(prompt, p):
        return [(ev.token_id, ev.finish_reason) async for ev in eng.generate(None, prompt, SamplingParams(**p))]

    out = await asyncio.gather(*[one(prompt, p) for prompt, p in zip(PROMPTS, params, strict=True)])
    await settled(eng)
    return eng, steps, out


def counters(eng, steps) -> dict:
    """What the rank counted over the run: its cumulative cache statistics, the sum of its iterations' counters
    (blocks allocated, reused, freed, ...) and the requests its steps ran."""
    w = eng.rank_workers[0]
    rows = np.stack([res.delta.row for _, res in steps if res.delta is not None])
    counted = w.layout.parts(rows)[0].sum(axis=0)
    return {**dataclasses.asdict(w.kv.get_kv_cache_stats()), "counters": counted.tolist(),
            "ran": sum(len(res.ran) for _, res in steps)}


def test_steps_sent_ahead_give_the_tokens_and_statistics_of_steps_sent_in_turn():
    async def main():
        params = [dict(max_tokens=3, temperature=0.0, ignore_eos=True),
                  dict(max_tokens=9, temperature=0.8, seed=7, ignore_eos=True),
                  dict(max_tokens=14, temperature=0.0, ignore_eos=True),
                  dict(max_tokens=20, temperature=0.0, ignore_eos=True)]
        _, steps, want = await serve(False, params)
        assert sent_ahead(steps) == 0
        # the longest request stops on a token it samples mid-way: the step sent ahead of it must not run it
        stop = want[3][7][0]
        params[3] = dict(params[3], stop_token_ids=[stop])
        off, off_steps, want = await serve(False, params)
        assert want[3][-1] == (stop, "stop") and len(want[3]) <= 8
        on, on_steps, got = await serve(True, params)
        assert got == want
        assert sent_ahead(on_steps) >= 5  # the decodes of the shared steps went ahead
        assert counters(on, on_steps) == counters(off, off_steps)
        assert on.rank_workers[0].kv.get_kv_cache_stats().used_num_blocks == 0 and not on.rank_workers[0].reqs

    run(main())


def test_a_step_that_raises_with_one_sent_ahead_fails_the_running_requests_and_the_engine_goes_on():
    async def main():
        want = await generate(await make_engine(async_scheduling=False), PROMPTS[1], max_tokens=6, temperature=0.0)
        eng = await make_engine()
        steps = record_steps(eng)
        rank = eng.workers[0]
        raised = []

        def fail(plan):  # the first step run with a token the rank sampled itself raises
            if any(w.new_token_id == LAST_SAMPLED for w in plan.work) and not raised:
                raised.append(plan.iteration)
                raise ray.exceptions.RayTaskError("step", "Traceback ...", ValueError("boom"))

        rank.fail = fail
        with pytest.raises(RequestFailed, match="boom"):
            await generate(eng, PROMPTS[0], max_tokens=30, temperature=0.0, ignore_eos=True)
        assert raised
        assert await generate(eng, PROMPTS[1], max_tokens=6, temperature=0.0) == want
        await released(eng)
        assert sent_ahead(steps) > 0

    run(main())


def test_an_abort_while_steps_go_ahead_frees_the_request_and_the_others_keep_their_tokens():
    async def main():
        want = await generate(await make_engine(async_scheduling=False), PROMPTS[1], max_tokens=16,
                              temperature=0.0, ignore_eos=True)
        eng = await make_engine()
        steps = record_steps(eng)
        other = asyncio.ensure_future(generate(eng, PROMPTS[1], max_tokens=16, temperature=0.0, ignore_eos=True))
        stream = eng.generate("leaves", PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        for _ in range(5):
            await anext(stream)
        await stream.aclose()  # the client went away: aborted, with a step already sent ahead
        assert await other == want
        await released(eng)
        assert sent_ahead(steps) > 0

    run(main())


def test_a_rank_drops_a_token_it_did_not_sample_in_the_iteration_before_or_that_stopped_the_request():
    async def main():
        eng = await make_engine(async_scheduling=False)
        w = eng.rank_workers[0]
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        w.step(StepPlan(100, [NewRequest("a", PROMPTS[0], params), NewRequest("b", PROMPTS[1], params)],
                        [Work("a", len(PROMPTS[0])), Work("b", len(PROMPTS[1]))]))
        token_a = w.reqs["a"].last_sampled[1]
        res = w.step(StepPlan(101, work=[Work("a", 1, LAST_SAMPLED, frozenset({token_a})),
                                         Work("b", 1, LAST_SAMPLED)]))
        assert set(res.ran) == {"b"}  # a's last token stops it: not run past it
        assert w.reqs["a"].tokens == PROMPTS[0]
        res = w.step(StepPlan(103, work=[Work("b", 1, LAST_SAMPLED)]))  # its token is from 101, not 102
        assert res.ran == {} and len(w.reqs["b"].tokens) == len(PROMPTS[1]) + 1

    run(main())


@pytest.mark.parametrize("kv_kib", [256, 384])
def test_steps_sent_ahead_where_the_cache_runs_out_give_the_tokens_of_steps_sent_in_turn(kv_kib):
    """A request deferred or preempted in a step has a step already sent ahead of it: the token the rank took
    there must not be sent again."""
    async def main():
        params = [dict(max_tokens=40, temperature=0.0, ignore_eos=True)] * 4
        runs = {}
        for on in (False, True):
            eng = await make_engine(async_scheduling=on, kv_cache_bytes=kv_kib << 10, max_seq_len=96)
            steps = record_steps(eng)
            runs[on] = await asyncio.gather(*[generate(eng, p, **q) for p, q in zip(PROMPTS, params, strict=True)])
            await settled(eng)
            assert eng.preemptions > 0 or any(res.deferred for _, res in steps), "the cache never ran out"
            assert eng.rank_workers[0].kv.get_kv_cache_stats().used_num_blocks == 0
        assert runs[True] == runs[False]
        assert all(len(out) == 40 for out in runs[True])

    run(main())


def test_a_request_that_arrives_during_a_step_is_admitted_in_the_next_one():
    """A step goes ahead only shortly before the one in flight ends (by the last decode step's time): a request
    that arrives before then is in the very next step, not one later, and steps still go ahead without one."""
    async def main():
        eng = await make_engine()
        steps = record_steps(eng)
        for rank in eng.workers:  # steps of 50 ms, as the rank measures them
            real = rank.step.remote

            async def slow(plan, real=real):
                await asyncio.sleep(0.05)
                res = await real(plan)
                res.step_s = 0.05
                return res

            rank.step = types.SimpleNamespace(remote=slow)
        first = eng.generate("first", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        for _ in range(5):
            await anext(first)
        in_flight = eng.iteration  # the step after the one whose token just came, already sent
        second = asyncio.ensure_future(generate(eng, PROMPTS[1], max_tokens=3, temperature=0.0))
        rest = [ev async for ev in first]
        await second
        admitted = next(plan.iteration for plan, _ in steps if any(n.request_id != "first" for n in plan.new))
        assert admitted == in_flight + 1
        assert len(rest) == 7 and sent_ahead(steps) > 0

    run(main())
