"""The engine's scheduling and failure handling over in-process ranks (no Ray): regressions of the review."""

import asyncio
import multiprocessing as mp

import pytest
import ray
import torch

from engine.errors import RequestError, RequestFailed
from engine.lifecycle import first_iteration
from tests.support.engine_harness import generate, make_engine, settled
from workers import worker as worker_module
from workers.sampling_params import SamplingParams
from workers.tokenizer import ByteTokenizer

PROMPT = list(range(1, 20))


def run(coro):
    return asyncio.run(coro)


def test_a_tiny_temperature_is_greedy_and_the_engine_goes_on():
    async def main():
        eng = await make_engine()
        greedy = await generate(eng, PROMPT, max_tokens=4, temperature=0.0)
        assert await generate(eng, PROMPT, max_tokens=4, temperature=1e-40) == greedy
        assert await generate(eng, PROMPT, max_tokens=4, temperature=0.0) == greedy
        assert (await eng.health()).ok

    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy
    run(main())


def test_a_request_whose_sampling_raises_fails_alone(monkeypatch):
    real = worker_module.sample

    def sample(logits, params, generators, histories=None):
        if any(p.seed == 666 for p in params):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0\nmore lines")
        return real(logits, params, generators, histories)

    monkeypatch.setattr(worker_module, "sample", sample)

    async def main():
        eng = await make_engine()
        good = asyncio.ensure_future(generate(eng, PROMPT, max_tokens=6, temperature=0.0))
        with pytest.raises(RequestFailed) as info:
            await generate(eng, PROMPT[:10], max_tokens=6, temperature=0.7, seed=666)
        assert "probability tensor" in str(info.value) and "\n" not in str(info.value)
        assert len(await good) == 6
        assert await generate(eng, PROMPT, max_tokens=3, temperature=0.0)
        await settled(eng)
        assert not eng.rank_workers[0].reqs  # the failed request was dropped, the others closed
        assert eng.rank_workers[0].kv.get_kv_cache_stats().used_num_blocks == 0

    run(main())


def test_a_step_that_raises_fails_the_running_requests_only():
    async def main():
        eng = await make_engine()
        rank = eng.workers[0]

        def once(plan):
            rank.fail = None
            raise ray.exceptions.RayTaskError("step", "Traceback (most recent call last):\n ...", ValueError("boom"))

        rank.fail = once
        with pytest.raises(RequestFailed) as info:
            await generate(eng, PROMPT, max_tokens=4, temperature=0.0)
        assert "Traceback" not in str(info.value)
        assert len(await generate(eng, PROMPT, max_tokens=4, temperature=0.0)) == 4

    run(main())


def test_a_retry_that_partially_reuses_a_whole_cache_completes():
    """The review's livelock: a request as long as one rank holds, run again with no host tier."""
    async def main():
        eng = await make_engine(max_seq_len=128, kv_cache_bytes=256 << 10, max_num_batched_tokens=48)
        n = eng.max_model_len
        prompt = [(i * 7) % 250 + 1 for i in range(n - 13)]
        first = await generate(eng, prompt, max_tokens=13, temperature=0.0, ignore_eos=True)
        steps = eng.steps
        again = await asyncio.wait_for(generate(eng, prompt, max_tokens=13, temperature=0.0, ignore_eos=True), 60)
        assert again == first and eng.steps - steps <= 20

    run(main())


def test_generation_stops_on_any_eos_id():
    class TwoEos(ByteTokenizer):
        eos_token_ids = (257, 147)  # 147 is the built-in model's first greedy token for PROMPT

    async def main():
        eng = await make_engine()
        eng.tokenizer = TwoEos()
        events = [(ev.token_id, ev.finish_reason) async for ev in
                  eng.generate(None, PROMPT, SamplingParams(max_tokens=6, temperature=0.0))]
        assert events == [(147, "stop")]

    run(main())


def test_a_request_beyond_what_one_rank_holds_is_refused_not_truncated():
    async def main():
        eng = await make_engine(max_seq_len=256, kv_cache_bytes=256 << 10)
        limit = eng.max_model_len
        assert 100 < limit < eng.max_seq_len
        with pytest.raises(RequestError, match=f"maximum context length is {limit} tokens") as info:
            await generate(eng, list(range(1, 101)), max_tokens=limit - 99, temperature=0.0)
        assert info.value.code == "context_length_exceeded"
        out = await generate(eng, list(range(1, 101)), max_tokens=limit - 100, temperature=0.0, ignore_eos=True)
        assert len(out) == limit - 100

    run(main())


def test_iterations_continue_after_the_last_emitted_one():
    assert first_iteration(None) == 0
    assert first_iteration(0) == 1
    assert first_iteration(41) == 42


def _rank_blocks(tp_rank: int, port: int, kv_bytes: int, out) -> None:
    from deployment.settings import Settings
    from tests.support.engine_harness import make_rank
    from workers.parallel import init_tp_group

    torch.set_num_threads(1)
    s = Settings(model="random", engine_id="tpmin", dp=1, tp=2, kv_cache_bytes=kv_bytes, host_cache_bytes=0)
    tp = init_tp_group(tp_rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=60)
    w = make_rank(s.engine_config(), tp_rank)
    w.kv = worker_module.build_kv_cache(w.spec, w.model.config, "cpu", torch.float32, tp)
    import ray

    # a rank built outside an actor asks Ray nothing: it used to join whichever cluster /tmp/ray named (a dead one
    # in CI, so the rank waited on its GCS until the queue timed out)
    out.put((tp_rank, (w.kv.get_kv_cache_stats().max_num_blocks, ray.is_initialized())))


@pytest.mark.slow
def test_tp_ranks_agree_on_the_smallest_pool():
    """Ranks of one tp group size their pools alike even when each would size its own differently."""
    from workers.parallel import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_blocks, args=(r, port, (200 + 40 * r) << 10, out)) for r in range(2)]
    for p in procs:
        p.start()
    blocks = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert blocks[0] == blocks[1], blocks
    assert blocks[0][1] is False, "a unit-test rank started or joined a Ray cluster"


def test_statistics_off_serves_the_same_tokens_and_the_ranks_report_nothing():
    async def main():
        on = await make_engine()
        off = await make_engine(enable_stats=False)  # set-up read the stats layout and failed with stats off
        assert off.rank_workers[0].layout.life_cycles == on.rank_workers[0].layout.life_cycles
        want = await generate(on, PROMPT, max_tokens=5, temperature=0.0)
        assert await generate(off, PROMPT, max_tokens=5, temperature=0.0) == want
        assert off.rank_workers[0].kv.get_iteration_stats() is None

    run(main())


def test_a_bug_in_the_step_loop_fails_the_engine_and_its_health_instead_of_hanging():
    """Without the guard the loop task died, requests waited forever and /health (and Serve's check) passed."""
    from engine.errors import EngineError

    async def main():
        eng = await make_engine()
        assert len(await generate(eng, PROMPT, max_tokens=2, ignore_eos=True)) == 2  # sampled: EOS may come

        def bug(plans):
            raise KeyError("a bug")

        eng.hub.plan = bug
        with pytest.raises(EngineError, match="step loop failed: KeyError"):
            await asyncio.wait_for(generate(eng, PROMPT, max_tokens=2), 10)
        assert eng.error and eng._loop_task.done()
        with pytest.raises(EngineError, match="step loop failed"):
            await eng.health()
        with pytest.raises(EngineError, match="step loop failed"):  # refused at once, not queued
            await generate(eng, PROMPT, max_tokens=2)

    run(main())


def test_the_per_step_actor_calls_record_no_task_events():
    """Each is one Ray task per iteration: with task events the GCS kept up to 100,000 of them and grew 135% in
    the hour-long soak (bench/task_events_bench.py). Ray reads this attribute when it builds the actor class."""
    from aggregator.actor import StatsAggregatorImpl
    from workers.worker import RankWorker

    for method in (RankWorker.step, StatsAggregatorImpl.ingest, StatsAggregatorImpl.wait_records):
        assert method.__ray_enable_task_events__ is False, method.__qualname__
