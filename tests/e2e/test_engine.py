"""The engine on the shared Ray cluster: lockstep dp ranks, continuous batching, preemption, stats, aborts.

One small engine per step transport (compiled graph, actor calls) serves the module's tests: dp=2 x tp=1 CPU
ranks with a deliberately tiny KV cache (16 blocks per pool group and a small host tier), so ordinary tests
exercise chunked prefill, reuse, suspension to the host tier and recompute. Outputs are checked against a
single-process greedy reference of the same model; tp=2 runs on both transports too.
"""

import asyncio
import threading
import time

import pytest
import ray
import torch

from deployment.settings import Settings
from engine.core import Engine
from engine.errors import EngineError, RequestError
from engine.transport import STEP_TRANSPORTS
from kvcache import KVCacheManager
from workers.config import CacheSettings
from workers.loader import kv_cache_config, load_model
from workers.model import SeqInput
from workers.sampling_params import SamplingParams

SETTINGS = dict(engine_id="engine-test", dp=2, tp=1, device="cpu", max_seq_len=256, kv_cache_bytes=512 << 10,
                host_cache_bytes=256 << 10, max_num_batched_tokens=48, seed=0, model="random")


def reference_greedy(prompt: list[int], n: int, seed: int = 0) -> list[int]:
    """Greedy tokens of the built-in model, one request alone, no reuse: what the engine must reproduce."""
    torch.set_num_threads(1)
    model, cfg = load_model(None, seed=seed)
    mgr = KVCacheManager(kv_cache_config(cfg, 1, CacheSettings(tokens_per_block=16, max_seq_len=512,
                                                               kv_cache_bytes=8 << 20, enable_block_reuse=False)))
    kv = mgr.create_kv_cache("ref", prompt)
    assert kv.resume() and kv.resize(len(prompt))
    logits = model([SeqInput(prompt, 0, kv)], mgr)[0]
    kv.commit(prompt)
    out = []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        assert kv.resize(kv.history_length + 1)
        logits = model([SeqInput([tok], kv.history_length, kv)], mgr)[0]
        kv.commit([tok])
    return out


class LoopThread:
    """The engine's event loop runs in its own thread, as in a Serve replica, so it steps while tests wait."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run_until_complete(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module", params=STEP_TRANSPORTS)
def engine(ray_cluster, request):
    loop = LoopThread()
    settings = Settings(**{**SETTINGS, "engine_id": f"engine-test-{request.param}", "step_transport": request.param})
    eng = loop.run_until_complete(_start(settings))
    yield eng, loop
    loop.run_until_complete(eng.shutdown())
    loop.close()


async def _start(settings):
    eng = Engine(settings.engine_config())
    await eng.start()
    return eng


async def _collect(eng, prompt, max_tokens, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    toks, reasons = [], []
    async for ev in eng.generate(None, prompt, params, **kw):
        toks.append(ev.token_id)
        reasons.append(ev.finish_reason)
    return toks, reasons[-1]


def _prompts(eng, n):
    base = eng.tokenizer.encode("The KV cache of a whole cluster, seen as one stream: ")
    return [base + eng.tokenizer.encode(f"request number {i}") for i in range(n)]


def test_greedy_matches_reference_under_batching_and_preemption(engine):
    eng, loop = engine
    prompts = _prompts(eng, 10)
    before = eng.preemptions

    # 48 tokens each: with the shared prefix reused (the scheduler admits a request once the prefix is published),
    # five requests a group still outgrow its 256-token cache
    async def run():
        return await asyncio.gather(*[_collect(eng, p, 48) for p in prompts])

    outs = loop.run_until_complete(run())
    for prompt, (toks, reason) in zip(prompts, outs, strict=True):
        assert reason == "length"
        assert toks == reference_greedy(prompt, 48)
    assert eng.preemptions > before, "the tiny cache must have forced preemption (suspend or recompute)"


def test_stats_stream_adds_up_to_the_cluster_totals(engine):
    eng, loop = engine
    async def run():
        return await asyncio.gather(*[_collect(eng, p, 8) for p in _prompts(eng, 4)])

    loop.run_until_complete(run())
    loop.run_until_complete(run())  # the same prompts again: their blocks are reused (also when run alone)
    last = eng.iteration - 1
    agg = eng.aggregator
    deadline = time.monotonic() + 60
    while ray.get(agg.health.remote()).last_iter in (None, *range(last)):
        assert time.monotonic() < deadline, "the aggregator never emitted the engine's last iteration"
        time.sleep(0.1)
    recs = ray.get(agg.query.remote(-1, None, False))
    assert [r["iter"] for r in recs] == sorted({r["iter"] for r in recs})
    assert all(r["numRanks"] == 2 for r in recs)
    totals = ray.get(agg.kv_cache_stats.remote())
    for field, key in (("iterAllocTotalBlocks", "allocTotalBlocks"), ("iterReusedBlocks", "reusedBlocks"),
                       ("iterMissedBlocks", "missedBlocks")):
        assert sum(b[field] for r in recs for b in r["kvCacheIterationStats"].values()) == totals[key]
    assert totals["reusedBlocks"] > 0, "requests sharing a prefix reuse blocks"
    # one channel: every stepped iteration became a complete record, each with every rank's delta
    assert [r["iter"] for r in recs] == list(range(recs[0]["iter"], recs[-1]["iter"] + 1))
    assert all(r["complete"] and r["reportedRanks"] == [0, 1] for r in recs)
    loop.run_until_complete(asyncio.wait_for(eng.stats.drained(), 30))  # acknowledged iterations are forgotten
    steps = [r["inflightBatchingStats"] for r in recs]
    assert sum(s["numCtxTokens"] for s in steps) > 0 and sum(s["numGenRequests"] for s in steps) > 0
    assert sum(r["numCompletedRequests"] for r in recs) >= 8
    assert all(r["iterLatencyMS"] > 0 and r["maxNumActiveRequests"] > 0 for r in recs)


def test_abort_frees_the_request_blocks(engine):
    eng, loop = engine

    async def run():
        gen = eng.generate("to-abort", _prompts(eng, 1)[0], SamplingParams(max_tokens=150, temperature=0.0))
        async for _ in gen:
            break
        await gen.aclose()

    loop.run_until_complete(run())
    assert "to-abort" not in eng._requests
    deadline = time.monotonic() + 30
    while True:
        snaps = ray.get([w.kv_snapshot.remote() for w in eng.workers])
        if all(s["requests"] == 0 and s["kvCacheStats"]["usedNumBlocks"] == 0 for s in snaps):
            break
        assert time.monotonic() < deadline, f"blocks still held after abort: {snaps}"
        time.sleep(0.05)


def test_bad_requests_never_reach_a_rank(engine):
    eng, loop = engine
    steps = eng.steps

    async def first(prompt, params):
        async for ev in eng.generate(None, prompt, params):
            return ev

    with pytest.raises(RequestError, match="maximum context length"):
        loop.run_until_complete(first([1] * 250, SamplingParams(max_tokens=10)))
    with pytest.raises(RequestError, match="empty"):
        loop.run_until_complete(first([], SamplingParams(max_tokens=1)))
    with pytest.raises(RequestError, match="token ids"):
        loop.run_until_complete(first([10_000], SamplingParams(max_tokens=1)))
    assert eng.steps == steps
    assert loop.run_until_complete(first([5, 6, 7], SamplingParams(max_tokens=1))) is not None


def test_an_idle_engine_does_not_step(engine):
    eng, loop = engine
    loop.run_until_complete(_collect(eng, [1, 2, 3], 1))
    deadline = time.monotonic() + 30
    while eng._groups[0].to_close or eng._groups[1].to_close or eng._wake.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    steps = eng.steps
    time.sleep(0.5)  # observing that nothing happens takes a window of time
    assert eng.steps == steps


def test_an_engine_refuses_an_aggregator_of_another_shape(ray_cluster):
    from aggregator import get_or_create_aggregator

    agg = get_or_create_aggregator("engine-shape", world_size=3, tp=1)
    eng = Engine(Settings(**{**SETTINGS, "engine_id": "engine-shape"}).engine_config())
    with pytest.raises(EngineError, match="world_size 3"):
        asyncio.run(eng.start())
    assert eng.workers == [], "nothing was started"
    ray.kill(agg, no_restart=True)


@pytest.mark.parametrize("transport", STEP_TRANSPORTS)
def test_tp2_greedy_matches_reference(ray_cluster, transport):
    """One dp group of two tp ranks (gloo): both step each iteration and the output is the reference's."""
    settings = Settings(**{**SETTINGS, "engine_id": f"engine-tp2-{transport}", "dp": 1, "tp": 2,
                           "step_transport": transport})

    async def run():
        eng = await _start(settings)
        try:
            prompts = _prompts(eng, 3)
            outs = await asyncio.gather(*[_collect(eng, p, 12) for p in prompts])
            return prompts, outs, eng.steps
        finally:
            await eng.shutdown()

    prompts, outs, steps = asyncio.run(asyncio.wait_for(run(), 600))
    assert steps >= 12
    for prompt, (toks, reason) in zip(prompts, outs, strict=True):
        assert reason == "length" and toks == reference_greedy(prompt, 12)
